"""A catalogue of bad input and the one-line message each one gets.

Each row is something a user will get wrong sooner or later (a config typo, a malformed dataset row)
with the fragment of the message that tells them what and where. Rows go through the real loaders,
and a few through ``tether train`` as a subprocess: exit code 2, one stderr line, no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tether.config import load_config
from tether.data.loading import load_preferences, load_prompts, load_sft
from tether.errors import ConfigError, DataError, TetherError

LOADERS = {"prompts": load_prompts, "sft": load_sft, "preferences": load_preferences}
USER = '{"role": "user", "content": "2+2="}'
ASSISTANT = '{"role": "assistant", "content": "4"}'

# (YAML text, overrides, fragment of the message)
BAD_CONFIGS = [
    pytest.param("trainer:\n  max_step: 3\n", [], "did you mean 'trainer.max_steps'", id="misspelt-key"),
    pytest.param("", ["rolout.group_size=4"], "did you mean 'rollout'", id="misspelt-section"),
    pytest.param("trainer:\n  lr: fast\n", [], "trainer.lr: expected a number, got 'fast'",
                 id="not-a-number"),
    pytest.param("", ["trainer.max_steps=1.5"], "trainer.max_steps: expected an integer", id="float-for-int"),
    pytest.param("trainer:\n  max_steps: true\n", [], "trainer.max_steps: expected a number, not a boolean",
                 id="bool-for-int"),
    pytest.param("", ["trainer.lr=false"], "trainer.lr: expected a number, not a boolean", id="bool-for-float"),
    pytest.param("", ["trainer.betas=[true, 0.999]"], "trainer.betas: expected a number, not a boolean",
                 id="bool-in-a-tuple-of-floats"),
    pytest.param("rollout:\n  temperature: -1\n", [], "rollout.temperature: must be >= 0", id="below-bound"),
    pytest.param("", ["rollout.top_p=1.5"], "rollout.top_p: must be <= 1", id="above-bound"),
    pytest.param("recipe: ppo\n", [], "recipe: must be one of 'sft' or 'grpo', got 'ppo'", id="literal"),
    pytest.param("", ["logging.progress=fancy"], "'plain'", id="literal-lists-choices"),
    pytest.param("", ["model.scratch.num_kv_heads=3"], "num_heads must be a multiple of num_kv_heads",
                 id="heads-do-not-divide"),
    pytest.param("trainer: 5\n", [], "trainer: expected a mapping of keys, got 5", id="section-as-value"),
    pytest.param("trainer:\n  lr: 0.1\n", ["trainer.lr.peak=1"], "trainer.lr: is a value, not a section",
                 id="value-as-section"),
    pytest.param("", ["trainer.betas=[0.9]"], "trainer.betas.1", id="short-tuple"),
    pytest.param("rewards:\n  - weight: 2\n", [], "rewards.0.fn: required key is missing", id="reward-no-fn"),
    pytest.param("rewards: exact_match\n", [], "rewards: expected a list", id="rewards-not-a-list"),
    pytest.param("- recipe: sft\n", [], "top level must be a mapping of keys, got list", id="top-level-list"),
    pytest.param("recipe: sft\n  seed: 1\n", [], "config.yaml:2:", id="invalid-yaml"),
    pytest.param("", ["trainer.lr"], "override 'trainer.lr': expected KEY=VALUE", id="override-no-equals"),
    pytest.param("", ["data.eval=held_out.jsonl"], "data.eval='held_out.jsonl' is not read when "
                 "data.task='arith' is set", id="eval-file-with-a-task"),
    pytest.param("", ["trainer.eval_every=5"], "trainer.eval_every=5: the grpo recipe does not evaluate",
                 id="grpo-eval-every"),
    pytest.param("", ["name=../../elsewhere"], "name: must be a plain name (no '/'", id="name-with-a-path"),
    pytest.param("", ["rollout.group_size=1"], "command line: rollout.group_size=1 does not suit "
                 "algorithm.advantage='grpo': group_size must be >= 2", id="grpo-group-of-one"),
]

# (loader, JSONL text, fragment); the file is always bad.jsonl
BAD_JSONL = [
    pytest.param("prompts", '{"question": "2+2="}\n', "bad.jsonl:1: missing field 'prompt'", id="no-prompt"),
    pytest.param("prompts", '{"prompt": "a"}\n\n{"prompt": "b",}\n', "bad.jsonl:3: invalid JSON",
                 id="invalid-json-line-3"),
    pytest.param("prompts", '["2+2="]\n', "bad.jsonl:1: row must be a JSON object, got list",
                 id="not-object"),
    pytest.param("prompts", '{"prompt": ""}\n', "field 'prompt' is an empty string", id="empty-prompt"),
    pytest.param("prompts", '{"prompt": 5}\n', "field 'prompt' must be a string or a list of chat messages, "
                 "got int", id="prompt-int"),
    pytest.param("prompts", '{"prompt": null}\n', "missing field 'prompt'", id="prompt-null"),
    pytest.param("prompts", '{"prompt": []}\n', "field 'prompt' is an empty list of chat messages",
                 id="empty-chat"),
    pytest.param("prompts", '{"prompt": [{"role": "bot", "content": "hi"}]}\n',
                 "message 0 has role 'bot'; expected one of system, user, assistant, tool", id="bad-role"),
    pytest.param("prompts", '{"prompt": [{"role": "user"}]}\n',
                 "message 0 content must be a string, got missing", id="no-content"),
    pytest.param("prompts", '{"prompt": [{"role": "user", "content": "2+2?"}, '
                 '{"role": "assistant", "content": "<think>"}]}\n',
                 "field 'prompt' ends with a 'assistant' message; a prompt to generate from ends with a 'user' or "
                 "'tool' turn", id="prompt-ends-with-assistant"),
    pytest.param("prompts", '{"prompt": ["hi"]}\n', "message 0 must be an object, got str", id="message-str"),
    pytest.param("prompts", "\n\n", "bad.jsonl: dataset is empty", id="empty-file"),
    pytest.param("sft", '{"prompt": "2+2="}\n', "bad.jsonl:1: missing field 'completion' (SFT rows need",
                 id="sft-no-completion"),
    pytest.param("sft", '{"prompt": "a", "completion": "b"}\n{"input": "x"}\n', "bad.jsonl:2: missing field "
                 "'prompt'", id="sft-second-row"),
    pytest.param("sft", f'{{"messages": [{USER}]}}\n', "field 'messages' must end with an assistant message, "
                 "got role 'user'", id="sft-ends-with-user"),
    pytest.param("sft", f'{{"messages": [{ASSISTANT}]}}\n', "needs at least one message before the assistant",
                 id="sft-only-assistant"),
    pytest.param("sft", '{"messages": "hi"}\n', "field 'messages' must be a list of chat messages, got str",
                 id="sft-messages-str"),
    pytest.param("sft", f'{{"text": [{USER}]}}\n', "field 'text' must be a string, got list",
                 id="sft-text-list"),
    pytest.param("sft", f'{{"prompt": "2+2=", "completion": [{ASSISTANT}]}}\n',
                 "field 'completion' is a list of chat messages but 'prompt' is a string",
                 id="sft-mixed-kinds"),
    pytest.param("preferences", '{"prompt": "a", "chosen": "b"}\n', "bad.jsonl:1: missing field 'rejected'",
                 id="pref-no-rejected"),
    pytest.param("preferences", f'{{"prompt": [{USER}], "chosen": [{USER}], "rejected": "5"}}\n',
                 "field 'chosen' must end with an assistant message", id="pref-chosen-user"),
    pytest.param("preferences", f'{{"chosen": [{USER}, {ASSISTANT}], "rejected": '
                 '[{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "5"}]}\n',
                 "fields 'chosen' and 'rejected' must share every message but the last", id="pref-diverge"),
]

# (loader, columns, fragment); Parquet rows are named by 0-based row number
BAD_PARQUET = [
    pytest.param("prompts", {"prompt": ["a", None]}, "bad.parquet:row 1: missing field 'prompt'", id="null"),
    pytest.param("sft", {"prompt": ["a"], "completion": [3]}, "bad.parquet:row 0: field 'completion' must be "
                 "a string", id="int-completion"),
    pytest.param("preferences", {"prompt": ["a"], "chosen": ["b"]}, "bad.parquet:row 0: missing field "
                 "'rejected'", id="no-rejected"),
]


def message_of(error: pytest.ExceptionInfo[TetherError]) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(("yaml_text", "overrides", "fragment"), BAD_CONFIGS)
def test_bad_config(tmp_path, yaml_text, overrides, fragment):
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as error:
        load_config(path, overrides)
    assert fragment in message_of(error)


@pytest.mark.parametrize(("kind", "text", "fragment"), BAD_JSONL)
def test_bad_jsonl(tmp_path, kind, text, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DataError) as error:
        LOADERS[kind](path)
    message = message_of(error)
    assert message.startswith(str(path))  # the file comes first, so editors can jump to it
    assert fragment in message


@pytest.mark.parametrize(("kind", "columns", "fragment"), BAD_PARQUET)
def test_bad_parquet(tmp_path, kind, columns, fragment):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(DataError) as error:
        LOADERS[kind](path)
    assert fragment in message_of(error)


@pytest.mark.parametrize(("name", "content", "fragment"), [
    pytest.param("missing.jsonl", None, "data file not found", id="missing-file"),
    pytest.param("data.csv", b"prompt\nhi\n", "unsupported data file type '.csv'", id="csv"),
    pytest.param("garbage.parquet", b"not parquet at all", "cannot read Parquet file", id="garbage-parquet"),
])
def test_bad_data_source(tmp_path, name, content, fragment):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError) as error:
        load_prompts(path)
    message = message_of(error)
    assert fragment in message and str(path) in message


def test_jsonl_that_is_not_utf8(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError) as error:
        load_prompts(path)
    assert f"{path}:2" in message_of(error)


# --- the same mistakes through `tether train` -------------------------------------------------------

TINY_MODEL = ["model.scratch.hidden_size=32", "model.scratch.intermediate_size=64",
              "model.scratch.num_layers=1", "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1"]


def tether_train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    (cwd / "c.yaml").write_text("logging:\n  progress: none\n")
    return subprocess.run([sys.executable, "-m", "tether.cli", "train", "c.yaml", *overrides,
                           "--out", str(cwd / "run")], cwd=cwd, capture_output=True, text=True, timeout=120)


def assert_cli_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and fragment in line


def test_cli_bad_config_value(tmp_path):
    assert_cli_error(tether_train(tmp_path, "rollout.top_p=1.5"), "rollout.top_p: must be <= 1")


def test_cli_bad_data_row(tmp_path):
    # One data case only: each run imports torch and builds the model first (~5 s on 2 cores).
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n')
    result = tether_train(tmp_path, "recipe=sft", "data.task=null", "data.train=bad.jsonl", *TINY_MODEL)
    assert_cli_error(result, "bad.jsonl:2: missing field 'completion'")


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_train_needs_data_train_without_a_task(tmp_path, recipe):
    # In-process (same path as the CLI below its error handler) to spare another torch start-up.
    from tether.recipes import run_train

    (tmp_path / "c.yaml").write_text("logging:\n  progress: none\n")
    with pytest.raises(ConfigError) as error:
        run_train(str(tmp_path / "c.yaml"), [f"recipe={recipe}", "data.task=null", *TINY_MODEL],
                  out=str(tmp_path / "run"))
    assert "data.train: required when data.task is null" in message_of(error)


def test_init_from_a_run_directory_points_at_its_checkpoint(tmp_path):
    from helpers.hf_tiny import make_hf_checkpoint
    from tether.builders import build_model_and_tokenizer

    run_dir = tmp_path / "sft-run"
    make_hf_checkpoint(run_dir / "final", "qwen2")
    config = load_config(None, [f"init_from={run_dir}"])
    with pytest.raises(ConfigError, match=r"is a run directory; its checkpoint is .*sft-run/final"):
        build_model_and_tokenizer(config.model, config.init_from, config.seed)
