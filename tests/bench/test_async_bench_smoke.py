"""Smoke test of ``bench/async_rl.py``: the real benchmark, tiny settings, in a subprocess."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "async_rl.py"
RUN_LINE = re.compile(r"^(\w+) \(seed (\d+)\): (\d+\.\d\d)s, final reward (\d\.\d{3})", re.MULTILINE)
ROW = re.compile(r"^\| (\w+) \| `[^`]*` \| (\d+\.\d) \| (\d+\.\d\d)x \| ([\d. ]+) \|", re.MULTILINE)
PAIRED = re.compile(r"^\| (\w+) \| .* \| ([+-]\d\.\d{3}) ± (\d\.\d{3}) \| [\d.]+% \|", re.MULTILINE)


@pytest.mark.slow
def test_async_bench_reports_per_repeat_speed_ups_against_sync(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--sft-steps", "2", "--rl-steps", "3", "--variants", "sync,s1",
         "--repeats", "2", "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    runs: dict[str, list[float]] = {}
    rewards: dict[str, list[float]] = {}
    for name, seed, wall, reward in RUN_LINE.findall(result.stdout):
        runs.setdefault(name, []).append(float(wall))
        rewards.setdefault(name, []).append(float(reward))
        assert int(seed) == len(runs[name]) - 1  # repeat r runs RL seed r
    assert {n: len(w) for n, w in runs.items()} == {"sync": 2, "s1": 2}, result.stdout
    rows = {m[0]: m for m in ROW.findall(result.stdout)}
    assert set(rows) == {"sync", "s1"}, result.stdout
    for name, (_, median_wall, median_ratio, per_repeat) in rows.items():
        ratios = [float(x) for x in per_repeat.split()]
        expected = [b / w for b, w in zip(runs["sync"], runs[name])]  # within a repeat
        assert ratios == pytest.approx(expected, rel=0.03, abs=0.01)
        assert float(median_ratio) == pytest.approx(statistics.median(ratios), abs=0.011)
        assert float(median_wall) == pytest.approx(statistics.median(runs[name]), abs=0.051)
    # the final reward against the same seed's sync run, mean over repeats (sync against itself: 0)
    paired = {m[0]: (float(m[1]), float(m[2])) for m in PAIRED.findall(result.stdout)}
    assert paired["sync"] == (0.0, 0.0), result.stdout
    differences = [r - b for b, r in zip(rewards["sync"], rewards["s1"])]
    assert paired["s1"][0] == pytest.approx(statistics.fmean(differences), abs=0.0015)
    assert (tmp_path / "out.json").exists()
