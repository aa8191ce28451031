"""Rewards: resolving config names to functions, and scoring that survives broken user functions."""

from __future__ import annotations

import asyncio
import math
import textwrap
from pathlib import Path

import pytest

from tether.errors import ConfigError
from tether.rewards import RewardComputer, WeightedReward, exact_match, resolve_reward
from tether.rewards.compute import RewardResult
from tether.rewards.loader import check_called_per_sample

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", " 4\n", "7"]
FIELDS = [{"answer": "2"}, {"answer": "4"}, {"answer": "6"}]


def score(*rewards: WeightedReward):
    return RewardComputer(list(rewards)).score(PROMPTS, COMPLETIONS, FIELDS)


def write_module(directory: Path, name: str, body: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def resolve_error(spec: str) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_reward(spec)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- resolution -----------------------------------------------------------------------------------


def test_builtin_exact_match():
    assert resolve_reward("exact_match") is exact_match
    assert exact_match("2+2=", " 4 ", answer="4") == 1.0
    assert exact_match("2+2=", "40", answer="4") == 0.0
    assert exact_match("2+2=", "4", answer=4) == 1.0  # a numeric answer column still compares as text
    # a float column (Parquet, pandas: 85 read as 85.0) and a list of accepted answers
    assert exact_match("p", "85", answer=85.0) == exact_match("p", "85.0", answer=85.0) == 1.0
    assert exact_match("p", "2.5", answer=2.5) == 1.0 and exact_match("p", "3", answer=2.5) == 0.0
    assert exact_match("p", "four", answer=["4", "four"]) == 1.0 and exact_match("p", "5", answer=["4", 4]) == 0.0
    odd = RewardComputer([WeightedReward("exact_match", exact_match)]).score(["p"], ["4"], [{"answer": {"v": 4}}])
    assert odd.num_errors == {"exact_match": 1} and "must be a string, a number or a list" in odd.first_error
    result = score(WeightedReward("exact_match", exact_match))
    assert result.totals == [1.0, 1.0, 0.0]
    # A row without an answer (no column, a null in a table) is counted, not scored a silent 0.
    rows = [{"answer": "4"}, {}, {"answer": None}]
    result = RewardComputer([WeightedReward("exact_match", exact_match)]).score(PROMPTS, ["4", "4", "4"], rows)
    assert result.totals == [1.0, 0.0, 0.0] and result.num_errors == {"exact_match": 2}
    assert "has no 'answer' field" in result.first_error


def test_extra_builtins_take_a_name():
    task_reward = lambda prompt, completion, **fields: 0.5
    assert resolve_reward("task", {"task": task_reward}) is task_reward


def test_module_function_on_sys_path(tmp_path, monkeypatch):
    write_module(tmp_path, "my_rewards_mod", """
        def length_penalty(prompt, completion, **fields):
            return -0.1 * len(completion)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards_mod:length_penalty")
    assert fn("p", "abcd") == pytest.approx(-0.4)


def test_file_path_function(tmp_path):
    path = write_module(tmp_path, "file_rewards", """
        def has_answer(prompt, completion, answer="", **fields):
            return float(answer in completion)
    """)
    fn = resolve_reward(f"{path}:has_answer")
    assert fn("q", "the answer is 42", answer="42") == 1.0
    assert fn("q", "no idea", answer="42") == 0.0


@pytest.mark.parametrize(("spec", "fragment"), [
    ("nosuch_reward", "unknown reward 'nosuch_reward'"),
    ("file.py:", "unknown reward 'file.py:'"),
    (":fn", "unknown reward ':fn'"),
    ("tether_no_such_module_xyz:f", "cannot import 'tether_no_such_module_xyz'"),
    ("os:no_such_function", "os has no function 'no_such_function'"),
    ("os.path:sep", "os.path has no function 'sep'"),  # an attribute that is not callable
    ("missing/rewards.py:f", "file not found: missing/rewards.py"),
])
def test_bad_names_are_one_line_config_errors(spec, fragment):
    message = resolve_error(spec)
    assert message.startswith("rewards: ")
    assert fragment in message


def test_unknown_name_lists_the_builtins():
    assert "'exact_match'" in resolve_error("exact_mach")


def test_module_that_fails_to_import(tmp_path, monkeypatch):
    write_module(tmp_path, "broken_reward_mod", "import tether_not_a_real_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = resolve_error("broken_reward_mod:f")
    assert "cannot import 'broken_reward_mod'" in message and "tether_not_a_real_dependency" in message


def test_file_that_fails_to_load(tmp_path):
    path = write_module(tmp_path, "syntax_bad", "def f(:\n    pass\n")
    message = resolve_error(f"{path}:f")
    assert f"{path} failed to load: SyntaxError" in message
    path = write_module(tmp_path, "raises_bad", "raise RuntimeError('no GPU here')\n")
    assert "RuntimeError: no GPU here" in resolve_error(f"{path}:f")
    path = write_module(tmp_path, "exits_bad", "import sys\nsys.exit(1)\n")
    assert f"{path} failed to load: SystemExit: 1" in resolve_error(f"{path}:f")
    path = write_module(tmp_path, "multiline_bad", "raise RuntimeError('first line\\nsecond line')\n")
    message = resolve_error(f"{path}:f")
    assert "RuntimeError: first line" in message and "\n" not in message


def test_file_without_the_function(tmp_path):
    path = write_module(tmp_path, "few_rewards", "def a(prompt, completion, **fields):\n    return 1.0\n")
    assert f"has no function 'b' ({path}:b)" in resolve_error(f"{path}:b")


# --- scoring ----------------------------------------------------------------------------------------


def test_fields_reach_the_function():
    seen = []

    def record(prompt, completion, **fields):
        seen.append((prompt, completion, fields))
        return 0.0

    score(WeightedReward("record", record))
    assert seen == list(zip(PROMPTS, COMPLETIONS, FIELDS))


def test_weights_combine_and_components_stay_unweighted():
    length = lambda prompt, completion, **fields: float(len(completion.strip()))
    result = score(WeightedReward("exact_match", exact_match, 2.0), WeightedReward("length", length, -0.5))
    assert result.totals == [2.0 - 0.5, 2.0 - 0.5, 0.0 - 0.5]
    assert result.components == {"exact_match": [1.0, 1.0, 0.0], "length": [1.0, 1.0, 1.0]}
    metrics = result.metrics()
    assert metrics["reward/mean"] == pytest.approx(2.5 / 3)
    mean = 2.5 / 3  # totals are [1.5, 1.5, -0.5]; std is the population std
    assert metrics["reward/std"] == pytest.approx(math.sqrt(((1.5 - mean) ** 2 * 2 + (-0.5 - mean) ** 2) / 3))
    assert metrics["reward/exact_match/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/errors"] == 0.0 and metrics["reward/length/errors"] == 0.0


def test_dict_return_adds_named_sub_scores():
    def parts(prompt, completion, answer="", **fields):
        return {"format": 0.25, "correct": float(completion.strip() == answer)}

    result = score(WeightedReward("parts", parts, 2.0))
    assert result.totals == [2.5, 2.5, 0.5]
    assert result.components == {"parts": [1.25, 1.25, 0.25], "parts/format": [0.25] * 3,
                                 "parts/correct": [1.0, 1.0, 0.0]}  # its own: the unweighted sum
    assert result.metrics()["reward/parts/correct/mean"] == pytest.approx(2 / 3)
    assert result.metrics()["reward/parts/mean"] == pytest.approx(2.75 / 3)


def test_numpy_and_torch_scalars_and_bools_are_numbers():
    import numpy as np
    import torch

    values = iter([np.float32(0.25), torch.tensor(0.5), np.longdouble(0.75)])
    result = score(WeightedReward("mixed", lambda prompt, completion, **fields: next(values)))
    assert result.totals == [0.25, 0.5, 0.75] and result.num_errors == {"mixed": 0}
    result = score(WeightedReward("flag", lambda prompt, completion, **fields: True))
    assert result.totals == [1.0, 1.0, 1.0] and result.num_errors == {"flag": 0}


def test_numpy_text_is_not_a_number():
    """``float`` parses numpy's strings ("1.0" as np.str_, a 0-d string array): text is not a score."""
    import numpy as np

    for text in (np.str_("1.0"), np.bytes_(b"1"), np.array("0.7"), np.array("2", dtype=object)):
        result = score(WeightedReward("judge", lambda prompt, completion, t=text, **fields: t))
        assert result.totals == [0.0, 0.0, 0.0] and result.num_errors == {"judge": 3}, text


def test_a_reward_file_with_a_dataclass_loads_by_path(tmp_path):
    """dataclasses resolve string annotations through sys.modules: the file's module is registered."""
    path = write_module(tmp_path, "dc_rewards", """
        from __future__ import annotations
        from dataclasses import dataclass

        @dataclass
        class Judge:
            scale: float = 1.0

        def judged(prompt, completion, **fields):
            return Judge(2.0).scale
    """)
    assert resolve_reward(f"{path}:judged")("p", "c") == 2.0


def test_two_functions_of_one_reward_file_share_one_load_of_it(tmp_path):
    """A judge loaded at import time is loaded once, and a cache in the file's globals is shared."""
    path = write_module(tmp_path, "shared_rewards", """
        LOADS = []
        LOADS.append("judge")
        CACHE = {}

        def first(prompt, completion, **fields):
            CACHE[completion] = 1.0
            return 1.0

        def second(prompt, completion, **fields):
            return CACHE[completion] + len(LOADS)
    """)
    first, second = resolve_reward(f"{path}:first"), resolve_reward(f"{path}:second")
    assert first("p", "c") == 1.0 and second("p", "c") == 2.0


def test_a_reward_file_imports_a_helper_module_beside_it(tmp_path, monkeypatch):
    """rewards/acc.py doing `from helpers import extract`, run from elsewhere, as a script would."""
    import sys

    (tmp_path / "rewards").mkdir()
    write_module(tmp_path / "rewards", "answer_helpers_beside", """
        def extract(text):
            return text.strip()
    """)
    write_module(tmp_path / "rewards", "acc_with_helper", """
        from answer_helpers_beside import extract

        def acc(prompt, completion, answer="", **fields):
            import answer_helpers_beside  # lazily, at call time, too
            return float(answer_helpers_beside.extract(completion) == extract(answer))
    """)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve_reward("rewards/acc_with_helper.py:acc")("p", " 4 ", answer="4") == 1.0


def test_a_module_in_the_working_directory_imports_from_the_console_script(tmp_path, monkeypatch):
    """The `tether` script puts its bin directory on sys.path, not the directory it runs in."""
    import sys

    write_module(tmp_path, "cwd_rewards_mod", """
        def one(prompt, completion, **fields):
            return 1.0
    """)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve_reward("cwd_rewards_mod:one")("p", "c") == 1.0
    assert str(tmp_path) not in sys.path  # only while importing


def _bad_on_second(bad_value):
    """A reward that is fine (1.0) except on the second sample, where it returns ``bad_value``
    (or raises it, when it is an exception)."""
    def fn(prompt, completion, **fields):
        if prompt != PROMPTS[1]:
            return 1.0
        if isinstance(bad_value, BaseException):
            raise bad_value
        return bad_value
    return fn


class _FloatRaises(float):
    """A number-like result whose conversion fails (as a user's tensor-like type may)."""

    def __float__(self):
        raise RuntimeError("bad score object")

    def __repr__(self):
        raise RuntimeError("no repr either")


def test_none_means_the_reward_does_not_apply_to_that_sample_as_in_trl():
    """A mixture of tasks: each reward returns None for the other task's rows. No error; the sample's
    total is the applicable rewards' sum; each reward's mean is over the samples it applies to."""
    def math_reward(prompt, completion, task="", **fields):
        return float(completion.strip() == "2") if task == "math" else None

    def judge(prompt, completion, task="", **fields):
        return {"style": 0.5, "safe": 1.0} if task == "chat" else None

    computer = RewardComputer([WeightedReward("math", math_reward), WeightedReward("judge", judge, 2.0)])
    rows = [{"task": "chat"}, {"task": "math"}, {"task": "chat"}]  # judge's sub-scores unknown at row 1
    result = computer.score(PROMPTS, ["2", "2", "x"], rows)
    assert result.totals == [3.0, 1.0, 3.0]
    metrics = result.metrics()
    assert metrics["reward/errors"] == 0.0 and result.first_error is None
    assert metrics["reward/math/mean"] == 1.0 and metrics["reward/judge/mean"] == 1.5
    assert metrics["reward/judge/style/mean"] == 0.5 and metrics["reward/judge/safe/mean"] == 1.0
    assert math.isnan(result.components["judge/style"][1])
    nothing = computer.score(PROMPTS[:1], ["2"], [{"task": "chat"}]).metrics()
    assert math.isnan(nothing["reward/math/mean"]) and nothing["reward/judge/mean"] == 1.5
    # Groups scored apart (async mode) and joined: a group scored before the sub-scores were known
    # leaves its not-applicable samples out of their means too.
    fresh = RewardComputer([WeightedReward("judge", judge)])
    parts = [fresh.score(PROMPTS[:2], ["a", "b"], [{"task": "math"}] * 2),
             fresh.score(PROMPTS[:2], ["a", "b"], [{"task": "chat"}, {"task": "math"}])]
    joined = RewardResult.concatenate(parts).metrics()
    assert (joined["reward/judge/style/mean"], joined["reward/judge/mean"]) == (0.5, 1.5)


@pytest.mark.parametrize(("bad_value", "fragment"), [
    (ValueError("cannot parse"), "ValueError: cannot parse"),
    (SystemExit(3), "SystemExit: 3"),  # model-written code run by a code reward calls exit()
    (asyncio.CancelledError("judge call cancelled"), "CancelledError: judge call cancelled"),  # an async judge
    (float("nan"), "returned nan"),
    (float("inf"), "returned inf"),
    ("1.0", "returned '1.0'"),
    ([1.0], "returned [1.0]: a reward is called once per sample"),
    ({"format": 1.0, "correct": "yes"}, "sub-score 'correct' is not a finite number"),
    ({"format": float("nan")}, "sub-score 'format'"),
    # Finite in Python, but its square overflows the float32 advantages (one NaN step ruins the weights)
    (1e39, "returned 1e+39, not a finite number within +-1e+15"),
    ({"a": 1.7e308, "b": 1.7e308}, "sub-score 'a' is not a finite number within"),
    ({"a": 9e14, "b": 9e14}, "its sub-scores sum to 1.8e+15, beyond +-1e+15"),
    ({}, "returned no sub-scores ({})"),
    ({1: 0.5, "1": 0.25}, "two sub-scores are named '1'"),
])
def test_broken_function_is_counted_and_scores_zero(bad_value, fragment):
    good = WeightedReward("good", lambda prompt, completion, **fields: 0.5, 2.0)
    result = score(WeightedReward("flaky", _bad_on_second(bad_value)), good)
    assert result.totals == [1.0 + 1.0, 0.0 + 1.0, 1.0 + 1.0]  # only sample 1 of 'flaky' is lost
    assert result.num_errors == {"flaky": 1, "good": 0}
    assert result.first_error is not None and result.first_error.startswith("flaky: ")
    assert fragment in result.first_error
    metrics = result.metrics()
    assert metrics["reward/errors"] == 1.0
    assert metrics["reward/flaky/errors"] == 1.0
    assert metrics["reward/good/errors"] == 0.0
    assert metrics["reward/good/mean"] == 0.5


def test_a_failed_call_of_a_sub_score_reward_removes_no_metric_name():
    """A failure scores 0 in the function's sub-scores seen so far: the run's metric names are the
    same in a batch with failures, one where every call fails, and one without."""
    def judge(prompt, completion, **fields):
        if completion == "fail":
            raise RuntimeError("judge down")
        return {"acc": 1.0, "fmt": 0.5}

    computer = RewardComputer([WeightedReward("judge", judge)])
    rows = [{}, {}]
    clean = computer.score(PROMPTS[:2], ["a", "b"], rows).metrics()
    mixed = computer.score(PROMPTS[:2], ["a", "fail"], rows)
    failed = computer.score(PROMPTS[:2], ["fail", "fail"], rows).metrics()
    assert mixed.components == {"judge": [1.5, 0.0], "judge/acc": [1.0, 0.0], "judge/fmt": [0.5, 0.0]}
    assert set(clean) == set(mixed.metrics()) == set(failed)
    assert failed["reward/judge/acc/mean"] == 0.0 and failed["reward/judge/errors"] == 2.0
    # Failing before its first success (its sub-scores unknown yet), it writes its own mean, which
    # it keeps writing once the sub-scores are known: no metric name is replaced by others.
    fresh = RewardComputer([WeightedReward("judge", judge)])
    first = fresh.score(PROMPTS[:2], ["fail", "fail"], rows).metrics()
    later = fresh.score(PROMPTS[:2], ["a", "b"], rows).metrics()
    assert set(first) <= set(later) and later["reward/judge/mean"] == 1.5


def test_a_result_whose_conversion_and_repr_raise_is_counted():
    result = score(WeightedReward("odd", _bad_on_second(_FloatRaises(1.0))))
    assert result.num_errors == {"odd": 1}
    assert "returned <_FloatRaises>, not a finite number" in result.first_error


def test_every_sample_failing_is_still_not_fatal():
    def always_raises(prompt, completion, **fields):
        raise KeyError("answer")

    result = score(WeightedReward("broken", always_raises), WeightedReward("exact_match", exact_match))
    assert result.totals == [1.0, 1.0, 0.0]
    assert result.metrics()["reward/broken/errors"] == 3.0
    assert result.metrics()["reward/errors"] == 3.0


def test_no_reward_functions_is_refused():
    with pytest.raises(ValueError, match="at least one reward"):
        RewardComputer([])


def test_huge_integer_is_counted_not_fatal():
    result = score(WeightedReward("huge", _bad_on_second(10**400)))
    assert result.num_errors == {"huge": 1}


def test_row_with_a_completion_column_still_reaches_the_function():
    fields = [{"answer": "2", "completion": "reference"}] * 3
    result = RewardComputer([WeightedReward("exact_match", exact_match)]).score(PROMPTS, COMPLETIONS, fields)
    assert result.num_errors == {"exact_match": 0}
    assert result.totals == [1.0, 0.0, 0.0]


def test_a_reward_that_mutates_its_inputs_changes_nothing_for_later_calls():
    """A judge that appends to the chat prompt or a field it was given: the dataset's record is
    shared by every sample of every epoch, so each call gets copies."""
    chat = [{"role": "user", "content": "2+2="}]
    rows = [{"answer": ["4"]} for _ in range(3)]
    seen = []

    def judge(prompt, completion, answer, **fields):
        seen.append((len(prompt), len(answer)))
        prompt.append({"role": "assistant", "content": completion})
        answer.append("four")
        return 1.0

    RewardComputer([WeightedReward("judge", judge)]).score([chat] * 3, COMPLETIONS, rows)
    assert seen == [(1, 1)] * 3
    assert chat == [{"role": "user", "content": "2+2="}] and rows[0] == {"answer": ["4"]}
    # a field that cannot be copied (a lock, a connection, in rows given in memory) is passed as is
    import threading

    lock = threading.Lock()
    result = RewardComputer([WeightedReward("locked", lambda prompt, completion, guard, **fields: float(
        guard is lock))]).score(PROMPTS, COMPLETIONS, [{"guard": lock}] * 3)
    assert result.totals == [1.0, 1.0, 1.0] and result.num_errors == {"locked": 0}


def _trl_batched(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _one_argument(completion):
    return 1.0


def _needs_a_field(prompt, completion, solution):
    return 1.0


class _RewardClass:
    def __init__(self, prompt, completion, **fields):
        pass


@pytest.mark.parametrize(("fn", "fragment"), [
    (_trl_batched, "TRL's batched form is not tether's: tether calls it once per sample"),
    (_one_argument, "cannot be called as f(prompt, completion and the data's fields ['answer'])"),
    (_needs_a_field, "missing a required argument: 'solution'"),
    (_RewardClass, "is a class; name a function"),
])
def test_a_reward_that_cannot_be_called_per_sample_is_refused_before_the_run(fn, fragment):
    """Every call would raise and score 0: the run trained on nothing and exited 0 (TRL's form)."""
    with pytest.raises(ConfigError) as error:
        check_called_per_sample(fn, "rewards.0.fn=r.py:f", {"answer": "4"})
    assert str(error.value).startswith("rewards: rewards.0.fn=r.py:f") and fragment in str(error.value)
    check_called_per_sample(exact_match, "exact_match", {"answer": "4"})
    check_called_per_sample(lambda prompt, completion, **fields: 1.0, "f", {"answer": "4"})
    check_called_per_sample(max, "max", {})  # no signature to read: its calls will tell


def _per_sample_adapter(batched):
    """A TRL batched reward wrapped per sample: its signature is the wrapper's, not the wrapped one's."""
    import functools

    @functools.wraps(batched)
    def reward(prompt, completion, **fields):
        return batched([completion], **{k: [v] for k, v in fields.items()})[0]

    return reward


def test_rewards_that_work_at_run_time_pass_the_check():
    """A `completion` column (TRL's tldr rows) is not passed twice, as RewardComputer leaves it out;
    a functools.wraps adapter is judged by its own signature; a field any row has may be required."""
    def length(prompt, completion, **fields):
        return float(len(completion))

    check_called_per_sample(length, "f", {"completion": "a reference summary"})
    assert RewardComputer([WeightedReward("f", length)]).score(["p"], ["abc"], [{"completion": "x"}]).totals == [3.0]
    check_called_per_sample(_per_sample_adapter(_trl_batched), "f", {"solution": "4"})
    mixture = dict.fromkeys(["tests", "answer"])  # a code row's field and a math row's, whichever comes first
    check_called_per_sample(lambda prompt, completion, answer=None, **fields: 1.0, "f", mixture)
    check_called_per_sample(lambda prompt, completion, answer, **fields: 1.0, "f", mixture)


def test_a_grpo_run_with_a_trl_style_reward_stops_before_its_first_step(tmp_path):
    from tether.builders import build_model_and_tokenizer
    from tether.config import load_config
    from tether.recipes.grpo import check_run_inputs

    (tmp_path / "trl_reward.py").write_text("def reward_len(completions, **kwargs):\n    return [0.0]\n")
    config = load_config(None, [f"rewards=[{{fn: '{tmp_path / 'trl_reward.py'}:reward_len'}}]",
                                "data.num_train=8", "model.scratch.hidden_size=32", "model.scratch.num_layers=1"])
    model, tokenizer = build_model_and_tokenizer(config.model, None, 0)
    with pytest.raises(ConfigError, match=r"rewards\.0\.fn=.*trl_reward.py:reward_len\(completions, \*\*kwargs\)"):
        check_run_inputs(config, model, tokenizer)
