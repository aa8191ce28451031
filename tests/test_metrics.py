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
