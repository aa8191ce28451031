"""metrics.jsonl and terminal progress: what a run writes for every step."""

from __future__ import annotations

import io
import json
import math

from tether.metrics import MetricsWriter, read_metrics
from tether.progress import NullProgress, PlainProgress, RichProgress, make_progress


def test_one_json_object_per_log_call_with_step(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.log(1, {"loss/sft": 2.5, "lr": 1e-4})
        writer.log(2, {"loss/sft": 2.0, "reward/mean": 0.25})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss/sft": 2.5, "lr": 1e-4},
        {"step": 2, "loss/sft": 2.0, "reward/mean": 0.25},
    ]
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["reward/mean"] == 0.25


def test_each_line_is_on_disk_before_close(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.log(1, {"loss/sft": 1.0})
    assert read_metrics(writer.metrics_path) == [{"step": 1, "loss/sft": 1.0}]  # a killed run keeps it
    writer.close()


def test_non_finite_values_are_written_as_strings(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.log(3, {"loss/policy": float("nan"), "kl/ref": float("inf"), "grad_norm": -math.inf,
                       "nested": {"a": float("nan")}, "series": [1.0, float("nan")]})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON readers reject these
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record == {"step": 3, "loss/policy": "nan", "kl/ref": "inf", "grad_norm": "-inf",
                      "nested": {"a": "nan"}, "series": [1.0, "nan"]}
    assert math.isnan(float(record["loss/policy"]))


def test_tensor_and_numpy_scalars_become_numbers(tmp_path):
    import numpy as np
    import torch

    with MetricsWriter(tmp_path) as writer:
        writer.log(1, {"entropy": torch.tensor(0.5), "grad_norm": np.float32(2.0),
                       "bad": torch.tensor(float("nan"))})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "entropy": 0.5, "grad_norm": 2.0,
                                                         "bad": "nan"}]


def test_samples_and_appending_to_an_existing_file(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.log(1, {"x": 1.0})
        writer.log_samples(1, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    with MetricsWriter(tmp_path) as writer:  # a resumed run adds lines, never truncates
        writer.log(2, {"x": 2.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    samples = read_metrics(tmp_path / "samples.jsonl")
    assert samples == [{"step": 1, "prompt": "1+1=", "completion": "2", "reward": 1.0}]


def test_writer_forwards_steps_to_progress(tmp_path):
    stream = io.StringIO()
    with MetricsWriter(tmp_path, PlainProgress(2, "sft", stream=stream)) as writer:
        writer.log(1, {"loss/sft": 1.5})
        writer.log(2, {"loss/sft": 1.25})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[sft] step 1/2") and "loss/sft=1.5" in lines[0]
    assert lines[1].startswith("[sft] step 2/2") and "loss/sft=1.25" in lines[1]


def test_plain_progress_every_n_steps_and_always_the_last():
    stream = io.StringIO()
    progress = PlainProgress(total=7, description="grpo", log_every=3, stream=stream)
    for step in range(1, 8):
        progress.update(step, {"reward/mean": 0.5, "loss/policy": float("nan"), "other": 1.0})
    progress.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["3/7", "6/7", "7/7"]
    assert all("reward/mean=0.5" in line and " eta " in line for line in lines)
    assert "other" not in lines[0]  # only the key metrics reach the terminal


def test_plain_progress_eta_leaves_start_up_out_and_evaluations_always_print(monkeypatch):
    """Made at t=0, first reported at t=100 (loading), then 1 s a step: 8 s left at step 2 of 10 (the
    ETA counted the start-up as step time: 22x too high at step 1 in a real run)."""
    clock = iter([100.0, 101.0, 102.0, 104.0])
    monkeypatch.setattr("tether.progress.time.perf_counter", lambda: next(clock))
    stream = io.StringIO()
    progress = PlainProgress(total=10, description="sft", log_every=4, stream=stream)
    progress.update(0, {"eval/loss": 2.0})  # the evaluation before training, at t=100
    progress.update(1, {"loss/sft": 1.5})  # not on the cadence
    progress.update(2, {"loss/sft": 1.4, "eval/loss": 1.9})  # off the cadence, but an evaluation
    progress.update(4, {"loss/sft": 1.3})
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[sft] step 0/10 eval/loss=2"  # no ETA before a step has been timed
    assert lines[1].startswith("[sft] step 2/10 eta 8s ") and "eval/loss=1.9" in lines[1]
    assert lines[2].startswith("[sft] step 4/10 eta 6s ") and len(lines) == 3


def test_rich_progress_keeps_the_count_and_eta_on_an_80_column_terminal():
    from rich.console import Console

    screen = io.StringIO()
    progress = RichProgress(2000, "grpo", console=Console(file=screen, width=80, force_terminal=True))
    progress.update(5, {"reward/mean": 0.0625, "loss/policy": 0.01112, "kl/ref": 0.0, "entropy": 0.7166,
                        "time/step_s": 0.1027, "throughput/tokens_per_s": 1e4})
    progress.close()
    last = screen.getvalue().split("\r")[-1]
    assert "5/2000" in last and ("-:--:--" in last or "0:" in last)
    assert "reward/mean=0.0625" in last


def test_make_progress_is_plain_when_not_a_tty(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    progress = make_progress("auto", 10, "sft")
    assert isinstance(progress, PlainProgress)
    assert isinstance(make_progress("none", 10, "sft"), NullProgress)
    assert isinstance(make_progress("plain", 10, "sft", log_every=5), PlainProgress)


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_make_progress_is_rich_on_a_tty(monkeypatch):
    monkeypatch.setattr("sys.stdout", _FakeTerminal())
    progress = make_progress("auto", 4, "sft")
    assert isinstance(progress, RichProgress)
    progress.update(1, {"loss/sft": 1.0})
    progress.close()


def test_a_full_disk_or_a_deleted_run_directory_stops_the_run_in_one_line(tmp_path):
    import os
    import shutil

    import pytest

    from tether.errors import RunOutputError

    full = tmp_path / "full"
    full.mkdir()
    if os.path.exists("/dev/full"):  # every write to it fails with ENOSPC, as a full disk's
        (full / "metrics.jsonl").symlink_to("/dev/full")
        message = r"metrics.jsonl: cannot write \(No space left on device\)$"
        with pytest.raises(RunOutputError, match=message), MetricsWriter(full) as writer:
            writer.log(1, {"loss/sft": 1.0})
    run = tmp_path / "run"
    writer = MetricsWriter(run)
    writer.log(1, {"loss/sft": 1.0})
    shutil.rmtree(run)  # the user's `rm -rf` mid-run: later lines would go nowhere, silently
    with pytest.raises(RunOutputError, match="metrics.jsonl was deleted while the run wrote it"):
        writer.log(2, {"loss/sft": 0.5})
    writer.close()


def test_a_last_line_cut_short_is_left_out_when_read_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss/sft": 1.0}\n{"step": 2, "loss/s')
    assert read_metrics(path) == [{"step": 1, "loss/sft": 1.0}]
