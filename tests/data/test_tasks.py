from __future__ import annotations

import re
import string

import pytest

from tether.data import ArithTask, CopyTask, get_task, task_names
from tether.data.tasks import check_task_options, split_of
from tether.errors import ConfigError, DataError

ARITH = re.compile(r"^\d+([+-]\d+)+=$")


def test_registry():
    assert {"arith", "copy"} <= set(task_names())
    task = get_task("arith", num_digits=2)
    assert isinstance(task, ArithTask) and task.num_digits == 2
    with pytest.raises(ConfigError, match="data.task='nope': unknown task; available: arith, copy"):
        get_task("nope")
    with pytest.raises(ConfigError, match="data.task_options.digits: task 'arith' has no such option"):
        get_task("arith", digits=2)
    with pytest.raises(ConfigError, match="data.task_options.name: task 'arith' has no such option"):
        check_task_options("arith", {"name": "x"})  # the registry's name, not an option
    with pytest.raises(ConfigError, match="operators"):
        get_task("arith", operators="*")


@pytest.mark.parametrize("kwargs", [{}, {"num_digits": 1}, {"num_terms": 4, "operators": "-"}])
def test_arith_answers_are_correct(kwargs):
    task = get_task("arith", **kwargs)
    for record in task.prompts(200, seed=3):
        assert ARITH.match(record.prompt), record.prompt
        expected = eval(record.prompt[:-1])  # the prompt is a plain integer expression
        assert record.fields == {"answer": str(expected)}
        assert expected >= 0  # allow_negative is off by default
        assert task.reward(record.prompt, str(expected), **record.fields) == 1.0


def test_arith_respects_num_digits_and_operators():
    prompts = [r.prompt for r in get_task("arith", num_digits=2, operators="+").prompts(300, seed=0)]
    operands = [int(x) for p in prompts for x in p[:-1].split("+")]
    assert max(operands) <= 99 and max(operands) >= 50
    assert all("-" not in p for p in prompts)
    negatives = get_task("arith", operators="-", allow_negative=True).prompts(200, seed=0)
    assert any(r.fields["answer"].startswith("-") for r in negatives)


@pytest.mark.parametrize("name", ["arith", "copy"])
def test_deterministic_per_seed(name):
    task = get_task(name)
    assert task.prompts(50, seed=7) == task.prompts(50, seed=7)
    assert [r.prompt for r in task.prompts(50, seed=7)] != [r.prompt for r in task.prompts(50, seed=8)]
    assert task.sft(20, seed=7) == task.sft(20, seed=7)


@pytest.mark.parametrize("name", ["arith", "copy"])
def test_train_and_heldout_are_disjoint(name):
    task = get_task(name, heldout_fraction=0.2)
    train = {r.prompt for seed in range(3) for r in task.prompts(300, seed=seed)}
    test = {r.prompt for seed in range(3) for r in task.prompts(300, seed=seed, split="test")}
    assert train and test and not train & test
    assert all(split_of(p, 0.2) == "train" for p in train)


def test_small_problem_space_still_splits_disjointly():
    task = get_task("arith", num_digits=1, operators="+")  # only 100 distinct problems
    train = {r.prompt for r in task.prompts(500, seed=0)}
    test = {r.prompt for r in task.prompts(100, seed=0, split="test")}
    assert not train & test and len(train) + len(test) <= 100


def test_reward_and_is_correct():
    task = get_task("arith")
    fields = {"answer": "522"}
    assert task.reward("37+485=", "522", **fields) == 1.0
    assert task.reward("37+485=", "522 \n", **fields) == 1.0
    assert task.reward("37+485=", "5220", **fields) == 0.0
    assert task.reward("37+485=", "", **fields) == 0.0
    assert task.is_correct("522", **fields) and not task.is_correct("523", **fields)
    with pytest.raises(DataError, match="'answer' field"):
        task.reward("37+485=", "522")


@pytest.mark.parametrize("name", ["arith", "copy"])
def test_sft_and_preferences_agree_with_prompts(name):
    task = get_task(name)
    prompts = task.prompts(100, seed=1)
    sft = task.sft(100, seed=1)
    prefs = task.preferences(100, seed=1)
    for p, s, pref in zip(prompts, sft, prefs):
        assert s.prompt == pref.prompt == p.prompt
        assert s.completion == pref.chosen == p.fields["answer"]
        assert pref.rejected != pref.chosen
        assert task.reward(p.prompt, pref.rejected, **p.fields) == 0.0
        assert "<eos>" not in s.completion
    assert [p.index for p in prompts] == list(range(100))


def test_copy_task_shape():
    task = get_task("copy")
    printable = set(string.printable) - set("\t\n\r\x0b\x0c")
    for record in task.prompts(200, seed=0):
        text, separator = record.prompt[:-1], record.prompt[-1]
        assert separator == ">" and ">" not in text
        assert 40 <= len(text) <= 120
        assert record.fields["answer"] == text
        assert set(record.prompt) <= printable


def test_copy_task_chunk_reversal():
    task = CopyTask(chunk_size=3, min_chars=7, max_chars=7)
    assert task.transform("abcdefg") == "cbafedg"
    record = task.prompts(1, seed=0)[0]
    assert record.fields["answer"] == task.transform(record.prompt[:-1])
    with pytest.raises(ConfigError, match="min_chars"):
        CopyTask(min_chars=10, max_chars=5)


def test_copy_reward_counts_spaces_as_characters():
    """The copy alphabet has a space: a copy that drops or adds one at the edges is wrong."""
    task = CopyTask()
    assert task.reward("", " ab ", answer=" ab ") == 1.0
    assert task.reward("", "ab", answer=" ab ") == 0.0
    assert task.reward("", " ab   \n", answer=" ab ") == 0.0
    assert ArithTask().reward("", " 12\n", answer="12") == 1.0  # arith answers are numbers: stripped
