"""The ``tether`` command as users run it: a real subprocess, exit codes, one-line errors, run outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY_SFT = [
    "recipe=sft", "trainer.max_steps=3", "trainer.batch_size=8", "data.task=arith", "data.num_train=64",
    "data.num_eval=16", "logging.progress=plain", "model.scratch.hidden_size=32",
    "model.scratch.intermediate_size=64", "model.scratch.num_layers=1", "model.scratch.num_heads=2",
    "model.scratch.num_kv_heads=1", "model.scratch.max_position_embeddings=64",
]


def tether(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tether.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess[str], fragment: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert fragment in lines[0]
    return lines[0]


def test_console_script_lists_the_commands():
    script = Path(sys.executable).parent / "tether"
    if not script.exists():
        pytest.fail(f"console script not installed next to {sys.executable}; run `pip install -e .`")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("train", "generate", "demo"):
        assert command in result.stdout


def test_train_help_shows_overrides_and_out(tmp_path):
    result = tether("train", "--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "overrides" in result.stdout and "--out" in result.stdout
    # Every config key with its default and help, generated from the schema.
    from tether.config.loader import all_keys

    listed = {line.split(" = ")[0].strip() for line in result.stdout.splitlines() if " = " in line}
    sections = {key.rsplit(".", 1)[0] for key in all_keys() if "." in key}
    assert {key for key in all_keys() if key not in sections} <= listed
    assert "  trainer.lr = 0.0001" in result.stdout and "      Peak learning rate (AdamW)." in result.stdout
    assert "  rewards.N.weight = 1.0" in result.stdout


def test_missing_command_is_a_usage_error(tmp_path):
    result = tether(cwd=tmp_path)
    assert result.returncode == 2 and "usage: tether" in result.stderr


def test_missing_config_file(tmp_path):
    result = tether("train", "nope.yaml", cwd=tmp_path)
    assert_one_line_error(result, "config file not found: nope.yaml")
    assert not list(tmp_path.iterdir())  # nothing is created for a run that cannot start


def test_bad_override_names_the_closest_key(tmp_path):
    (tmp_path / "c.yaml").write_text("recipe: sft\n")
    result = tether("train", "c.yaml", "trainer.max_step=3", cwd=tmp_path)
    assert_one_line_error(result, "did you mean 'trainer.max_steps'")


def test_invalid_yaml(tmp_path):
    (tmp_path / "c.yaml").write_text("trainer: [1, 2\n")
    assert_one_line_error(tether("train", "c.yaml", cwd=tmp_path), "c.yaml:2:")


@pytest.mark.slow
def test_train_tiny_sft_writes_a_self_describing_run(tmp_path):
    (tmp_path / "c.yaml").write_text("name: tiny\nseed: 3\n")
    out = tmp_path / "run"
    result = tether("train", "c.yaml", *TINY_SFT, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert [line for line in result.stdout.splitlines() if "step 3/3" in line]  # plain progress

    from tether.config import load_config

    saved = load_config(out / "config.yaml")
    assert saved == load_config(tmp_path / "c.yaml", TINY_SFT)
    assert (saved.name, saved.seed, saved.recipe) == ("tiny", 3, "sft")

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: the held-out loss before training
    assert set(records[0]) == {"step", "eval/loss"} and records[0]["eval/loss"] > records[-1]["eval/loss"]
    assert all(isinstance(r["loss/sft"], float) and r["loss/sft"] > 0 for r in records[1:])
    assert "eval/loss" in records[-1]

    final = out / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    assert list(final.glob("*.safetensors"))
    assert json.loads((final / "config.json").read_text())["hidden_size"] == 32

    again = tether("train", "c.yaml", *TINY_SFT, "--out", str(out), cwd=tmp_path)
    assert_one_line_error(again, "already holds a run")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4  # the old run is untouched


TINY_ASYNC_GRPO = [
    "recipe=grpo", "rollout.mode=async", "rollout.max_staleness=1", "trainer.max_steps=100000", "data.task=arith",
    "data.num_train=64", "data.num_eval=16", "logging.progress=plain", "model.scratch.hidden_size=32",
    "model.scratch.intermediate_size=64", "model.scratch.num_layers=1", "model.scratch.num_heads=2",
    "model.scratch.num_kv_heads=1", "model.scratch.max_position_embeddings=64", "rollout.group_size=4",
    "rollout.prompts_per_step=2", "rollout.max_new_tokens=4", "trainer.num_threads=1",
]


@pytest.mark.slow
def test_ctrl_c_stops_an_async_run_with_one_line_and_no_process_left(tmp_path):
    """Ctrl-C reaches the whole process group (the trainer, its generator process and the process server
    they fork from): a line saying what the run directory keeps, then "interrupted"; no traceback from
    any of them, every process gone."""
    run = tmp_path / "run"
    (tmp_path / "c.yaml").write_text("name: interrupted\n")
    process = subprocess.Popen([sys.executable, "-m", "tether.cli", "train", "c.yaml", *TINY_ASYNC_GRPO, "--out",
                                str(run)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.monotonic() + 90
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)  # two steps logged: the generator process is running
    assert process.poll() is None, process.communicate()
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    *_, stopped, last = stderr.strip().splitlines()
    assert last == "interrupted"  # after a line saying what the run directory keeps
    assert stopped.startswith(f"{run}: stopped after step ") and "no checkpoint" in stopped, stderr
    deadline = time.monotonic() + 10
    while _live_processes_of_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _live_processes_of_group(process.pid)  # the generator and the process server are gone


def _live_processes_of_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that have not exited (zombies wait for init to reap them)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_overrides_after_out_are_overrides(tmp_path):
    """`tether train c.yaml --out run key=value`: argparse alone rejected the override after the option."""
    (tmp_path / "c.yaml").write_text("name: tiny\n")
    result = tether("train", "c.yaml", "--out", str(tmp_path / "run"), "trainer.max_step=3", cwd=tmp_path)
    assert_one_line_error(result, "trainer.max_step")  # read as an override: the config names the bad key
    result = tether("train", "c.yaml", "--out", str(tmp_path / "run"), "--bogus", cwd=tmp_path)
    assert result.returncode == 2 and "unrecognized arguments: --bogus" in result.stderr


def test_sigterm_stops_a_run_in_one_line(tmp_path):
    """scancel, docker stop and timeout send SIGTERM: the run stops as on Ctrl-C, one line, 143."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "train", str(examples / "sft_arith.yaml"),
                             "--out", str(tmp_path / "run"), "trainer.max_steps=100000", "logging.progress=plain"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not metrics.exists() or not metrics.stat().st_size:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "terminated", err
    assert "Traceback" not in err


def test_a_run_that_fails_to_start_leaves_no_directory_on_the_default_path(tmp_path):
    """Three typos made three debris directories beside the real run (`ls runs/x-*` and "the latest"
    broke); a directory given with --out is the user's and stays, reusable."""
    (tmp_path / "c.yaml").write_text("name: typo\n")
    bad = [*TINY_SFT, "recipe=grpo", "init_from=runs/nope/final", f"logging.run_root={tmp_path / 'runs'}"]
    bad = [o for o in bad if not o.startswith(("model.scratch", "recipe=sft", "trainer.batch_size", "trainer.eval"))]
    result = tether("train", "c.yaml", *bad, cwd=tmp_path)
    assert_one_line_error(result, "init_from: checkpoint directory runs/nope/final does not exist")
    assert "removed: the run stopped before its first step" in result.stdout
    assert not list((tmp_path / "runs").iterdir())
    result = tether("train", "c.yaml", *bad, "--out", str(tmp_path / "mine"), cwd=tmp_path)
    assert_one_line_error(result, "does not exist")
    assert (tmp_path / "mine" / "config.yaml").exists()
