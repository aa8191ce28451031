"""Config: defaults, YAML + overrides, one-line errors that name the key, the saved resolved config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tether
from tether import runs
from tether.config import ExperimentConfig, load_config, parse_override, save_resolved
from tether.errors import ConfigError
from tether.runs import create_run_dir, release_run_dir


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(path: Path | None = None, overrides: list[str] | None = None) -> str:
    """The message of the ConfigError that loading raises; asserts it is a single line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- values -----------------------------------------------------------------------------------


def test_defaults_validate_and_match_the_schema():
    config = load_config()
    assert config == ExperimentConfig()
    assert config.recipe == "grpo"
    assert config.trainer.lr == 1e-4
    assert config.trainer.betas == (0.9, 0.999)
    assert [r.fn for r in config.rewards] == ["task"]


def test_empty_yaml_file_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == ExperimentConfig()


def test_yaml_values_then_overrides_win(tmp_path):
    path = write(tmp_path, "recipe: sft\ntrainer:\n  lr: 3e-4\n  max_steps: 7\nname: from-yaml\n")
    config = load_config(path, ["trainer.max_steps=9", "name=from-cli"])
    assert config.recipe == "sft"
    assert config.trainer.lr == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as text; pydantic coerces it
    assert config.trainer.max_steps == 9
    assert config.name == "from-cli"
    assert config.trainer.schedule == "constant"  # untouched siblings keep their defaults


@pytest.mark.parametrize(
    ("override", "attribute", "expected"),
    [
        ("trainer.max_steps=12", ("trainer", "max_steps"), 12),
        ("trainer.lr=3e-4", ("trainer", "lr"), 3e-4),
        ("trainer.lr=0.25", ("trainer", "lr"), 0.25),
        ("model.scratch.tie_word_embeddings=false", ("model", "scratch", "tie_word_embeddings"), False),
        ("model.scratch.tie_word_embeddings=true", ("model", "scratch", "tie_word_embeddings"), True),
        ("trainer.betas=[0.8, 0.95]", ("trainer", "betas"), (0.8, 0.95)),
        ("data.task_options={num_digits: 2, operators: '+-'}", ("data", "task_options"),
         {"num_digits": 2, "operators": "+-"}),
        ("data.task=null", ("data", "task"), None),
        ("model.path=", ("model", "path"), None),
        ("name=a=b", ("name",), "a=b"),  # only the first '=' splits key from value
    ],
)
def test_override_values_are_read_as_yaml(override, attribute, expected):
    config = load_config(None, [override])
    value = config
    for name in attribute:
        value = getattr(value, name)
    if isinstance(expected, float):
        assert value == pytest.approx(expected)
    else:
        assert value == expected


def test_override_a_list_of_sections_with_yaml_flow_syntax():
    config = load_config(None, ["rewards=[{fn: exact_match, weight: 0.5}, {fn: task}]"])
    assert [(r.fn, r.weight) for r in config.rewards] == [("exact_match", 0.5), ("task", 1.0)]


def test_override_replaces_a_yaml_section_value_without_dropping_siblings(tmp_path):
    path = write(tmp_path, "rollout:\n  group_size: 4\n  temperature: 0.7\n")
    config = load_config(path, ["rollout.group_size=2"])
    assert (config.rollout.group_size, config.rollout.temperature) == (2, 0.7)


def test_parse_override_reads_exponent_floats_as_numbers():
    assert parse_override("trainer.lr=3e-4") == ("trainer.lr", 3e-4)
    config = load_config(None, ["data.task_options={heldout_fraction: 2e-1}"])
    assert config.data.task_options["heldout_fraction"] == pytest.approx(0.2)


@pytest.mark.parametrize(("override", "expected"), [
    ("data.task_options={bogus: 1}", "command line: data.task_options.bogus: task 'arith' has no such option; "
                                     "its options: num_digits, "),
    ("data.task_options={num_digits: 2.5}", "command line: data.task_options.num_digits: task 'arith' needs int"),
    ("data.task=nope", "command line: data.task='nope': unknown task; available: arith, copy"),
])
def test_task_and_options_are_checked_with_the_config(override, expected):
    """Before a model is built (an unknown option failed after it, naming the task's class)."""
    assert config_error(overrides=[override]).startswith(expected)


# --- one-line errors naming the key -------------------------------------------------------------


def test_misspelt_key_names_the_closest_valid_key():
    message = config_error(overrides=["trainer.max_step=3"])
    assert "unknown key 'trainer.max_step'" in message
    assert "did you mean 'trainer.max_steps'" in message


def test_misspelt_section_names_the_closest_section():
    message = config_error(overrides=["trainr.lr=1"])
    assert "unknown key 'trainr'" in message and "did you mean 'trainer'" in message


def test_misspelt_key_in_yaml_names_file_and_closest_key(tmp_path):
    path = write(tmp_path, "rollout:\n  temprature: 0.5\n")
    message = config_error(path)
    assert str(path) in message
    assert "rollout.temprature" in message and "rollout.temperature" in message


def test_wrong_type_names_key_and_expected_type():
    message = config_error(overrides=["trainer.max_steps=abc"])
    assert message == "command line: trainer.max_steps: expected an integer, got 'abc'"
    assert "trainer.lr: expected a number" in config_error(overrides=["trainer.lr=fast"])
    assert "expected true or false" in config_error(overrides=["model.scratch.tie_word_embeddings=maybe"])


def test_out_of_range_names_the_bound():
    assert config_error(overrides=["trainer.max_steps=0"]) == "command line: trainer.max_steps: must be >= 1, got 0"
    assert "rollout.top_p: must be <= 1" in config_error(overrides=["rollout.top_p=2"])
    assert "trainer.lr: must be > 0" in config_error(overrides=["trainer.lr=-1e-3"])


def test_literal_lists_the_allowed_values():
    message = config_error(overrides=["recipe=ppo"])
    assert message.startswith("command line: recipe: must be one of")
    assert "'sft'" in message and "'grpo'" in message and "'ppo'" in message
    message = config_error(overrides=["model.dtype=float64"])
    assert "model.dtype" in message and "'bfloat16'" in message


def test_cross_field_check_names_the_section():
    message = config_error(overrides=["model.scratch.num_heads=3"])
    assert "model.scratch" in message and "num_heads must be a multiple of num_kv_heads" in message


def test_missing_required_key_inside_a_list():
    assert "rewards.0.fn: required key is missing" in config_error(overrides=["rewards=[{weight: 1}]"])


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert config_error(missing) == f"config file not found: {missing}"


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 1\n  betas: [0.9, 0.99\n")
    message = config_error(path)
    assert message.startswith(f"{path}:")
    assert message.split(":")[1].isdigit()


@pytest.mark.parametrize(("text", "kind"), [("- 1\n- 2\n", "list"), ("just text\n", "str"), ("3\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    assert config_error(path) == f"{path}: the top level must be a mapping of keys, got {kind}"


@pytest.mark.parametrize("item", ["trainer.lr", "=3", " =3"])
def test_override_without_key_or_equals(item):
    message = config_error(overrides=[item])
    assert message.startswith(f"override {item!r}: expected KEY=VALUE")


@pytest.mark.parametrize("item", [".lr=1", "trainer..lr=1", "trainer.=1"])
def test_override_with_an_empty_key_part(item):
    """It was blamed on the config file as "unknown key ''"."""
    assert config_error(overrides=[item]).startswith(f"override {item!r}: an empty part in the key")


def test_an_override_given_twice_on_the_command_line_is_refused(tmp_path):
    """The last one won silently (Hydra refuses it); a program composing overrides may repeat one."""
    from tether.recipes import run_train

    with pytest.raises(ConfigError, match="^command line: trainer.lr is given twice; give it once$"):
        run_train(str(write(tmp_path, "name: x\n")), ["trainer.lr=1e-3", "seed=1", "trainer.lr=5e-5"],
                  out=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert load_config(None, ["trainer.lr=1e-3", "trainer.lr=5e-5"]).trainer.lr == 5e-5


def test_overriding_a_leaf_from_yaml_as_a_section(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 0.1\n")
    message = config_error(path, ["trainer.lr.value=3"])
    assert message == "trainer.lr: is a value, not a section (override trainer.lr.value)"


def test_overriding_a_default_leaf_as_a_section_names_the_leaf():
    assert config_error(overrides=["trainer.lr.value=3"]).startswith("command line: trainer.lr: expected a number")


def test_overriding_a_section_with_a_value():
    assert config_error(overrides=["trainer=5"]) == "command line: trainer: expected a mapping of keys, got 5"


def test_long_values_are_shortened_to_keep_one_line():
    message = config_error(overrides=["trainer.max_steps=" + "x" * 500])
    assert len(message) < 160 and message.endswith("...")


def test_union_error_names_the_user_key_only():
    message = config_error(overrides=["data.task_options.k=[1]"])
    assert "data.task_options.k:" in message
    assert ".int" not in message


def test_non_finite_learning_rate_is_rejected():
    assert "trainer.lr" in config_error(overrides=["trainer.lr=.inf"])


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = write(tmp_path, "name: first\nrecipe: sft\nname: second\n")
    message = config_error(path)
    assert "name" in message and "duplicate" in message


def test_yaml_merge_keys_work_and_keys_written_beside_them_win(tmp_path):
    path = write(tmp_path, "trainer:\n  <<: {max_steps: 3, lr: 0.5}\n  lr: 0.001\n")
    config = load_config(path)
    assert config.trainer.max_steps == 3 and config.trainer.lr == 0.001


@pytest.mark.parametrize(("override", "needle"), [
    ("seed=99999999999999999999999", "seed: must be < 4294967296"),  # passed validation, then overflowed
    ("rewards=[]", "rewards: List should have at least 1 item"),
])
def test_values_that_used_to_fail_later_are_config_errors(override, needle):
    assert needle in config_error(overrides=[override])


def test_data_train_turns_the_default_task_off_and_both_is_an_error():
    config = load_config(None, ["data.train=mine.jsonl"])  # not silently the arith task
    assert config.data.task is None and config.data.train == "mine.jsonl"
    assert "set data.task: null" in config_error(overrides=["data.train=mine.jsonl", "data.task=copy"])
    assert load_config(None, []).data.task == "arith"


@pytest.mark.parametrize("name", ["1e-4", "3e5", "+1e3", ".5"])
def test_a_string_that_looks_like_a_number_survives_the_saved_config(tmp_path, name):
    config = load_config(None, [f'name="{name}"'])
    assert load_config(save_resolved(config, tmp_path)) == config


def test_task_option_of_the_wrong_type_is_a_config_error():
    from tether.data.tasks import get_task

    assert "data.task_options.num_digits: task 'arith' needs int, got 2.5" in config_error(
        overrides=["data.task_options.num_digits=2.5"])
    with pytest.raises(ConfigError, match=r"data.task_options.num_digits: task 'arith' needs int, got 2.5"):
        get_task("arith", num_digits=2.5)  # built from Python, checked the same


def test_a_list_as_a_yaml_key_is_a_config_error(tmp_path):
    message = config_error(write(tmp_path, "trainer:\n  ? [max_steps]\n  : 3\n"))
    assert "a key must be a plain value" in message


def test_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    assert str(path) in config_error(path)


# --- the resolved config of a run -----------------------------------------------------------------


def test_save_resolved_loads_back_equal(tmp_path):
    config = load_config(None, ["trainer.lr=3e-4", "trainer.betas=[0.8, 0.9]",
                                "data.task_options={num_digits: 2}",
                                "rewards=[{fn: exact_match, weight: 2}]"])
    path = save_resolved(config, tmp_path)
    assert path == tmp_path / "config.yaml"
    assert load_config(path) == config


def test_create_run_dir_saves_config_and_refuses_an_existing_run(tmp_path):
    config = load_config(None, ["name=exp", f"logging.run_root={tmp_path / 'runs'}"])
    run_dir = create_run_dir(config)
    assert run_dir.parent == tmp_path / "runs" and run_dir.name.startswith("exp-")
    assert load_config(run_dir / "config.yaml") == config
    second = create_run_dir(config)  # same second: a separate directory, never the same one
    assert second != run_dir
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds a run") as info:
        create_run_dir(config, out=run_dir)
    assert "\n" not in str(info.value)


def test_create_run_dir_never_overwrites_a_config_yaml_it_did_not_write(tmp_path):
    """`tether train exp/config.yaml --out exp` must not replace the user's file (and its comments)."""
    mine = write(tmp_path, "# my experiment\nname: exp\n")
    config = load_config(mine)
    with pytest.raises(ConfigError, match="holds a config.yaml that tether did not write"):
        create_run_dir(config, out=tmp_path)
    assert mine.read_text() == "# my experiment\nname: exp\n"
    run_dir = create_run_dir(config, out=tmp_path / "run")  # a run that failed before its first step:
    (run_dir / "metrics.jsonl").write_text("")
    release_run_dir(run_dir)  # (its process ended)
    assert create_run_dir(config, out=run_dir) == run_dir  # its own config.yaml may be rewritten


_CLAIM = """
import sys
from tether.config import load_config
from tether.errors import ConfigError
from tether.runs import create_run_dir
config = load_config(None, ["name=exp", f"logging.run_root={sys.argv[1]}"])
try:
    print(create_run_dir(config, sys.argv[2]), flush=True)
except ConfigError as error:
    print("error:", error, flush=True)
sys.stdin.read()  # holds the run directory until the test closes stdin
"""


def test_a_run_directory_in_use_by_a_live_run_is_refused(tmp_path):
    """A second run given the --out of a run that is still starting (config.yaml written, no step
    yet: what a failed run leaves too) is refused while the first one's process lives; once it has
    ended, the directory may be reused. Runs on the default path never share one."""
    def claim(out):
        proc = subprocess.Popen([sys.executable, "-c", _CLAIM, str(tmp_path / "runs"), str(out)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return proc, proc.stdout.readline().strip()

    first, first_dir = claim(tmp_path / "run")
    second, second_out = claim(tmp_path / "run")
    assert second_out.startswith("error: run directory") and f"pid {first.pid}" in second_out, second_out
    (tmp_path / "run" / "metrics.jsonl").write_text("")  # the first run has not finished a step
    for proc in (first, second):
        proc.communicate("")
    third, third_dir = claim(tmp_path / "run")  # the first run's process has ended
    assert third_dir == first_dir == str(tmp_path / "run")
    third.communicate("")


def test_runs_on_the_default_path_never_share_a_directory(tmp_path, monkeypatch):
    """Two runs started in the same second both find ``exp-<time>`` free; the one that creates it
    second takes the next name instead of writing into the other run's directory."""
    config = load_config(None, ["name=exp", f"logging.run_root={tmp_path}"])
    taken, fresh = tmp_path / "exp-1", tmp_path / "exp-1-1"
    other = create_run_dir(config, out=taken)  # the other run, still starting: config.yaml only
    names = iter([taken, fresh])
    monkeypatch.setattr(runs, "new_run_path", lambda root, name: next(names))
    assert create_run_dir(config) == fresh
    assert sorted(p.name for p in other.iterdir()) == [".tether.lock", "config.yaml", "run.json"]


def test_a_run_directory_says_what_ran_it(tmp_path):
    """Versions, command and machine beside the config: the README's figures move with torch and the CPU."""
    run_dir = create_run_dir(load_config(None, ["name=exp"]), out=tmp_path / "run")
    info = json.loads((run_dir / "run.json").read_text())
    assert info["versions"]["torch"] == torch.__version__ and info["versions"]["tether"] == tether.__version__
    assert info["command"] == sys.argv and info["num_cpus"] == os.cpu_count() and info["started"].endswith("+00:00")
    release_run_dir(run_dir)
    release_run_dir(create_run_dir(load_config(None, ["name=exp"]), out=run_dir))  # failed to start: reused


def test_only_a_run_directory_that_holds_nothing_of_a_run_is_removed(tmp_path):
    run_dir = create_run_dir(load_config(None, ["name=exp"]), out=tmp_path / "run")
    (run_dir / "generator_error.log").write_text("Traceback ...\n")  # why the generator died: kept
    assert not runs.remove_if_unused(run_dir) and run_dir.exists()
    (run_dir / "generator_error.log").unlink()
    (run_dir / "metrics.jsonl").write_text("")
    assert runs.remove_if_unused(run_dir) and not run_dir.exists()
    assert not runs.remove_if_unused(tmp_path / "run")  # deleted mid-run: the run's own error tells


def test_create_run_dir_refuses_a_directory_with_other_files(tmp_path):
    """--out pointing at a directory that holds anything else (a checkpoint, notes) is refused: a
    run would write over its files (final/model.safetensors)."""
    config = load_config(None, ["name=exp"])
    busy = tmp_path / "busy"
    (busy / "final").mkdir(parents=True)
    (busy / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match=r"run directory .*busy is not empty \(holds 'final' and 1 more\)"):
        create_run_dir(config, out=busy)
    assert sorted(p.name for p in busy.iterdir()) == ["final", "notes.txt"]
    with pytest.raises(ConfigError, match="is a file"):
        create_run_dir(config, out=busy / "notes.txt")


def test_a_temperature_too_small_to_divide_the_logits_by_is_rejected():
    assert config_error(overrides=["rollout.temperature=1e-9"]) == (
        "command line: rollout.temperature: must be 0 (greedy) or at least 1e-05, got 1e-09")
    assert load_config(None, ["algorithm.advantage=reinforce_pp", "rollout.temperature=0"]).rollout.temperature == 0


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False), ("auto", "auto")])
def test_engine_batch_invariant_is_true_false_or_auto(value, expected):
    assert load_config(None, [f"engine.batch_invariant={value}"]).engine.batch_invariant == expected
    assert load_config(None, []).engine.batch_invariant == "auto"
    for bad in ("maybe", "1"):
        assert "engine.batch_invariant: must be true, false or auto, got" in config_error(
            overrides=[f"engine.batch_invariant={bad}"])


def test_a_run_directorys_config_names_local_files_by_absolute_path(tmp_path, monkeypatch):
    """`tether train RUN/config.yaml` reruns the run from any directory: the relative paths of files
    that exist are saved absolute; names that are no local path stay as written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "my_reward.py").write_text("def score(prompt, completion, **fields):\n    return 1.0\n")
    sft = load_config(None, ["recipe=sft", "data.train=data/train.jsonl", "data.eval=some/hub-name"])
    grpo = load_config(None, ["data.train=data/train.jsonl", "rewards=[{fn: my_reward.py:score}, {fn: exact_match}]"])
    sft_dir, grpo_dir = create_run_dir(sft, out=tmp_path / "sft"), create_run_dir(grpo, out=tmp_path / "grpo")
    monkeypatch.chdir(sft_dir)
    saved, saved_grpo = load_config(sft_dir / "config.yaml"), load_config(grpo_dir / "config.yaml")
    assert saved.data.train == saved_grpo.data.train == str(tmp_path / "data" / "train.jsonl")
    assert saved.data.eval == "some/hub-name"
    assert [r.fn for r in saved_grpo.rewards] == [f"{tmp_path / 'my_reward.py'}:score", "exact_match"]


def test_a_reward_listed_twice_is_refused():
    """Its metrics and error counts are keyed by name: two entries would share (and miscount) them."""
    message = config_error(overrides=["rewards=[{fn: task, weight: 1.0}, {fn: task, weight: 0.5}]"])
    assert "'task' is listed twice" in message and "weights summed" in message


def test_a_reward_file_is_named_in_metrics_by_its_stem_and_function(tmp_path):
    """A path's '/' would read as sub-score separators in `reward/<name>/...`; a `name` overrides."""
    from tether.builders import build_rewards, build_task

    rewards = tmp_path / "checks" / "fmt_rewards.py"
    rewards.parent.mkdir()
    rewards.write_text("def ok(prompt, completion, **fields):\n    return 1.0\n")
    config = load_config(None, [f"rewards=[{{fn: '{rewards}:ok'}}, {{fn: task, name: exact}}]"])
    assert [spec.metric_name for spec in config.rewards] == ["fmt_rewards:ok", "exact"]
    metrics = build_rewards(config, build_task(config.data)).score(["1+1="], ["2"], [{"answer": "2"}]).metrics()
    assert {"reward/fmt_rewards:ok/mean", "reward/exact/mean"} <= set(metrics)
    assert config_error(overrides=["rewards=[{fn: task, name: x/y}]"]).startswith(
        "command line: rewards.0.name: must be non-empty, without '/'")


@pytest.mark.parametrize("override,expected", [
    ("trainer.betas=[0.9,1.0]", "trainer.betas: each beta must be in [0, 1)"),
    ("rollout.top_k=3000000000", "rollout.top_k: must be <= 2147483647"),
    ("trainer.num_threads=10000", "trainer.num_threads: must be <= 1024"),
    ("rollout.generator_threads=1e10", "rollout.generator_threads: "),
    ("rollout.group_size=10000000000", "rollout.group_size: must be <= 65536"),
])
def test_values_torch_would_refuse_later_are_config_errors(override, expected):
    """AdamW's betas, the engine's top-k, torch's thread count: refused when the config is read, not
    with a traceback (or a crash) once the run has started."""
    assert config_error(overrides=[override]).startswith(f"command line: {expected}")


def test_sft_examples_need_two_tokens():
    assert config_error(overrides=["recipe=sft", "data.max_seq_len=1"]).startswith(
        "command line: data.max_seq_len: must be >= 2")


@pytest.mark.parametrize("overrides,expected", [
    (["algorithm.advantage=dr_grpo", "rollout.group_size=1"], "every advantage would be 0"),
    (["algorithm.advantage=reinforce_pp_baseline", "rollout.group_size=1"], "every advantage would be 0"),
    (["rollout.temperature=0"], "rollout.temperature=0 samples the 8 completions of a group alike"),
    (["algorithm.kl_coef=0.05", "algorithm.kl_estimator=k1"], "algorithm.kl_estimator=k1 as a loss term pulls "
                                                              "toward nothing"),
])
def test_settings_under_which_nothing_is_learned_are_refused(overrides, expected):
    assert expected in config_error(overrides=overrides)


def test_reinforce_pp_may_sample_one_completion_per_prompt():
    """No group baseline: its batch whitening gives advantages to groups of one, greedy ones too."""
    config = load_config(None, ["algorithm.advantage=reinforce_pp", "rollout.group_size=1", "rollout.temperature=0"])
    assert config.rollout.group_size == 1


@pytest.mark.parametrize("override", ["data.eval=held_out.jsonl", "data.max_seq_len=64"])
def test_data_settings_the_grpo_recipe_does_not_read_are_refused(override):
    overrides = ["data.task=null", "data.train=train.jsonl", override]
    assert "grpo recipe" in config_error(overrides=overrides)
    load_config(None, ["recipe=sft", *overrides])  # the sft recipe reads both


@pytest.mark.parametrize("override", ["data.num_train=100", "data.num_eval=10", "data.task_options={num_digits: 2}"])
@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_built_in_task_settings_given_with_a_data_file_are_refused(override, recipe):
    """A user subsampling a file with data.num_train would train on every row: refused, not ignored."""
    assert "read by built-in tasks only" in config_error(
        overrides=[f"recipe={recipe}", "data.train=train.jsonl", override])
    load_config(None, [f"recipe={recipe}", override])  # the built-in task reads it


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.batch_size=256"], "not read by the grpo recipe: a step trains on rollout.prompts_per_step"),
    (["trainer.min_lr_ratio=0.1"], "not read by trainer.schedule=constant"),
    (["recipe=sft", "trainer.min_lr_ratio=0.1"], "not read by trainer.schedule=constant"),
])
def test_trainer_settings_that_would_be_ignored_are_refused(overrides, expected):
    assert expected in config_error(overrides=overrides)
    load_config(None, ["recipe=sft", "trainer.batch_size=256", "trainer.schedule=cosine", "trainer.min_lr_ratio=0.1"])


@pytest.mark.parametrize("overrides,expected", [
    (["algorithm.proximal=bypass", "algorithm.correction=tis_token"], "does nothing with algorithm.proximal=bypass"),
    (["algorithm.correction=geo_mask", "algorithm.correction_cap=0.9"], "the cap must be >= 1"),
])
def test_corrections_that_would_do_nothing_or_fail_at_the_first_step_are_refused(overrides, expected):
    assert expected in config_error(overrides=overrides)


@pytest.mark.parametrize("source", ["init_from=sft/final", "model.path=ckpt"])
def test_a_scratch_shape_given_with_a_checkpoint_is_refused(source):
    """The checkpoint's config.json sets the shape: `model.scratch.num_layers=12` would be ignored."""
    message = config_error(overrides=[source, "model.scratch.num_layers=12"])
    assert "model.scratch.num_layers=12 is not read with" in message and source.split("=")[0] in message
    assert "or reset it with 'model.scratch={}'" in message  # a saved config.yaml holds the shape
    load_config(None, [source])
    load_config(None, ["model.scratch.num_layers=12"])
    load_config(None, ["model.scratch.num_layers=12", source, "model.scratch={}"])


def test_a_directory_given_as_the_config_points_at_its_config_yaml(tmp_path):
    (tmp_path / "config.yaml").write_text("name: x\n")
    assert config_error(tmp_path) == f"{tmp_path} is a directory, not a config file; did you mean " \
                                     f"{tmp_path / 'config.yaml'}?"


def test_the_demos_grpo_stage_config_reruns_alone(tmp_path):
    """Its config.yaml names the SFT checkpoint and no scratch shape, so `tether train` accepts it."""
    from tether.demo import demo_configs

    sft, grpo = demo_configs(quick=True, seed=0, sft_final=tmp_path / "sft" / "final")
    assert grpo.init_from == str((tmp_path / "sft" / "final").resolve()) and sft.init_from is None
    assert sft.model.scratch.num_layers == 3
    assert load_config(save_resolved(grpo, tmp_path), []) == grpo


def test_paths_starting_with_a_tilde_are_the_users_home(monkeypatch, tmp_path):
    """No shell expands `~` in YAML or after `key=`: `data.train: ~/x.jsonl` named a missing file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(None, ["data.train=~/x.jsonl", "init_from=~/ckpt", "logging.run_root=~/runs"])
    assert (config.data.train, config.init_from) == (str(tmp_path / "x.jsonl"), str(tmp_path / "ckpt"))
    assert config.logging.run_root == str(tmp_path / "runs")


@pytest.mark.parametrize("override,named", [
    ("rollout.top_k=20", "rollout.top_k=20"), ("algorithm.kl_coef=0.5", "algorithm.kl_coef=0.5"),
    ("rewards=[{fn: exact_match}]", "rewards=[{'fn': 'exact_match'"),
])
def test_rl_settings_in_an_sft_config_are_refused(override, named):
    """A GRPO config turned into an SFT one: its sampling, loss and rewards would be ignored."""
    message = config_error(overrides=["recipe=sft", override])
    assert message.startswith(f"command line: {named}") and "not read by the sft recipe" in message
    load_config(None, ["recipe=grpo", override])


def test_float16_training_without_loss_scaling_is_refused():
    """fp16 gradients of a 32k vocabulary flush to 0 (92% of the embedding's) without loss scaling."""
    assert "float16 training needs loss scaling" in config_error(overrides=["model.dtype=float16"])
    assert load_config(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"


def test_errors_in_override_values_say_command_line_not_the_file(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 1e-4\n")
    assert config_error(path, ["rollout.max_staleness=-1"]) == (
        "command line: rollout.max_staleness: must be >= 0, got -1")
    bad = write(tmp_path, "rollout:\n  max_staleness: -1\n", name="bad.yaml")
    assert config_error(bad, ["trainer.lr=1e-3"]).startswith(f"{bad}: rollout.max_staleness")


@pytest.mark.parametrize("override,hint", [
    ("rollout.temp=0.7", "rollout.temperature"),
    ("rewards=[{fn: task, wieght: 2}]", "rewards.0.weight"),
    ("rewards=[{fnn: task}]", "rewards.0.fn"),
    # TRL's, verl's and TrainingArguments' names: the nearest spelling misled (learning_rate -> min_lr_ratio)
    ("trainer.learning_rate=1e-6", "trainer.lr"), ("rollout.num_generations=8", "rollout.group_size"),
    ("rollout.max_completion_length=256", "rollout.max_new_tokens"), ("algorithm.beta=0.04", "algorithm.kl_coef"),
    ("trainer.max_grad_norm=1", "trainer.grad_clip"), ("trainer.num_iterations=2", "algorithm.epochs_per_batch"),
    ("trainer.gradient_accumulation_steps=4", "trainer.micro_batch_tokens"),
])
def test_unknown_keys_suggest_the_closest_field_of_their_section(override, hint):
    assert f"(did you mean '{hint}'?)" in config_error(overrides=[override])


def test_an_override_indexes_a_list_the_config_gives(tmp_path):
    path = write(tmp_path, "rewards:\n  - fn: task\n  - fn: exact_match\n")
    config = load_config(path, ["rewards.1.weight=2"])
    assert [r.weight for r in config.rewards] == [1.0, 2.0]
    assert "rewards is a list of 2" in config_error(path, ["rewards.2.weight=2"])
    assert "gives no list rewards to index" in config_error(overrides=["rewards.0.weight=2"])


def test_an_override_value_with_a_hash_is_kept_as_written():
    """YAML would read `ablation #3` as `ablation` and a comment."""
    assert load_config(None, ["name=ablation #3"]).name == "ablation #3"
    assert load_config(None, ["trainer.lr=3e-4"]).trainer.lr == 3e-4
    # reinforce_pp has no group baseline: greedy groups of one prompt still get advantages
    assert load_config(None, ["algorithm.advantage=reinforce_pp", "rollout.temperature=0"]).rollout.temperature == 0


def test_a_staleness_bound_in_sync_mode_is_refused():
    """Sync mode trains on-policy: a bound there would be written to config.yaml and never read."""
    assert "read in async mode only" in config_error(overrides=["rollout.max_staleness=4"])
    assert load_config(None, ["rollout.mode=async", "rollout.max_staleness=4"]).rollout.max_staleness == 4


def test_evaluating_sft_without_held_out_data_is_refused():
    overrides = ["recipe=sft", "data.task=null", "data.train=train.jsonl", "trainer.eval_every=5"]
    assert "no held-out data to evaluate on; set data.eval" in config_error(overrides=overrides)
    load_config(None, [*overrides, "data.eval=held_out.jsonl"])


@pytest.mark.parametrize("key", ["init_from", "model.path"])
def test_a_missing_checkpoint_names_the_key_that_points_at_it(tmp_path, key):
    """examples/grpo_arith.yaml before the SFT example has run: the key to fix, not only the path."""
    from tether.builders import build_model_and_tokenizer
    from tether.errors import CheckpointError

    config = load_config(None, [f"{key}={tmp_path / 'sft' / 'final'}"])
    with pytest.raises(CheckpointError, match=rf"^{key}: checkpoint directory .*sft/final does not exist$"):
        build_model_and_tokenizer(config.model, config.init_from, 0)


def test_two_reward_files_of_one_stem_are_told_to_take_names():
    message = config_error(overrides=["rewards=[{fn: a/r.py:f}, {fn: b/r.py:f}]"])
    assert "two rewards (a/r.py:f, b/r.py:f) are both named 'r:f' in metrics; give each a `name`" in message
    assert "auto, decoupled_ppo, ppo_clip" in config_error(overrides=["algorithm.policy_loss=ppo"])


def test_a_registered_estimator_without_lengths_is_refused_when_the_config_is_read():
    """The loops pass lengths=[B]: an estimator written as fn(rewards, group_size) is found at start,
    not with a TypeError at the first RL step."""
    from tether.algorithms import ADVANTAGES

    @ADVANTAGES.register("test_two_argument_estimator")
    def two_arguments(rewards, group_size):
        return rewards - rewards.mean()

    try:
        message = config_error(overrides=["algorithm.advantage=test_two_argument_estimator"])
    finally:
        ADVANTAGES._entries.pop("test_two_argument_estimator")
    assert "algorithm.advantage='test_two_argument_estimator' must take (rewards, group_size, *, lengths)" in message


def test_an_override_that_breaks_a_check_across_keys_is_named_as_the_command_line(tmp_path):
    path = write(tmp_path, "rollout:\n  group_size: 4\n")
    assert config_error(path, ["rollout.temperature=0"]).startswith("command line: rollout.temperature=0 ")
    bad = write(tmp_path, "rollout:\n  temperature: 0\n", name="bad.yaml")
    assert config_error(bad, ["trainer.lr=1e-3"]).startswith(f"{bad}: rollout.temperature=0 ")


@pytest.mark.parametrize("item,value", [("name=ablation #3", "ablation #3"), ("name='run #2'", "run #2"),
                                        ('name="run #2"', "run #2"), ("name=a#b", "a#b"), ("name=#3", "#3"),
                                        ("trainer.lr=3e-4 # warm-up peak", 3e-4)])
def test_override_values_with_a_hash(item, value):
    assert parse_override(item)[1] == value


def test_a_run_whose_generator_failed_before_its_first_step_may_be_rerun_in_its_directory(tmp_path):
    config = load_config(None, ["name=exp"])
    run_dir = create_run_dir(config, out=tmp_path / "run")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "generator_error.log").write_text("Traceback (most recent call last): ...\n")
    release_run_dir(run_dir)  # the failed run's process ended
    assert create_run_dir(config, out=run_dir) == run_dir
    assert not (run_dir / "generator_error.log").exists()  # the failed attempt's, gone with its config.yaml
