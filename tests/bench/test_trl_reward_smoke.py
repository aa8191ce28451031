"""Smoke test of ``bench/trl_reward.py``: the real benchmark at ``--quick`` size, in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "trl_reward.py"
ROW = re.compile(r"^\| (sync_1t|s1|trl) \| (\d+\.\d|not reached) \| (\d+\.\d\dx|n/a|-) \| (\d+\.\d) \| "
                 r"(\d+\.\d\dx|-) \| (\d+\.\d) \| (\d+\.\d{3}) \| (\d\.\d{3}) \| (\d\.\d{3}) \| (\d\.\d\d) \|$",
                 re.MULTILINE)
QUICK_RL_STEPS = 3


def test_trl_reward_bench_prints_the_table(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    out = tmp_path / "curves.json"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(result.stdout)}
    assert set(rows) == {"sync_1t", "s1", "trl"}, result.stdout
    curves = {c["name"]: c for c in json.loads(out.read_text())["curves"]}
    for name, curve in curves.items():
        # every system ran the same number of steps, each with a reward in [0, 1], the clock increasing
        assert len(curve["rewards"]) == len(curve["ends_s"]) == QUICK_RL_STEPS, name
        assert all(0.0 <= r <= 1.0 for r in curve["rewards"]), name
        assert 0 <= curve["startup_s"] < curve["ends_s"][0], name
        assert curve["ends_s"] == sorted(curve["ends_s"]) and curve["ends_s"][-1] <= curve["total_s"], name
        assert float(rows[name][2]) == pytest.approx(curve["total_s"], abs=0.051)
        # both frameworks generate within the demo's limit of 6 new tokens
        assert all(1.0 <= n <= 6.0 for n in curve["completion_tokens"]), name
    # the printed total ratio is TRL's total over the variant's (rounding aside)
    for name in ("sync_1t", "s1"):
        expected = curves["trl"]["total_s"] / curves[name]["total_s"]
        assert float(rows[name][3].rstrip("x")) == pytest.approx(expected, rel=0.05, abs=0.02)
    target = re.search(r"target smoothed reward (\d+\.\d{3})", result.stdout)
    assert target is not None, result.stdout
    assert "with 1 threads" in result.stdout


def _bench_module(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import trl_reward

    return trl_reward


def test_time_to_target_uses_the_first_full_window(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_module(monkeypatch)
    curve = bench.Curve("x", rewards=[0.0, 1.0, 0.0, 1.0, 1.0], ends_s=[2.0, 3.0, 4.0, 5.0, 6.0], total_s=7.0,
                        startup_s=1.0, completion_tokens=[3.0] * 5)
    assert curve.smoothed(2) == [0.5, 0.5, 0.5, 1.0]
    # step 2 alone reaches 1.0, but a window is only judged once full: (0 + 1) / 2 at step 2's end
    assert curve.time_to(0.5, 2) == 3.0
    assert curve.time_to(0.75, 2) == 6.0  # the window of steps 4 and 5
    assert curve.time_to(1.01, 2) is None
    assert curve.mean_step_s == pytest.approx(1.0)  # (6 - 1) / 5 steps


def test_target_is_a_fraction_of_the_lowest_best_smoothed_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_module(monkeypatch)
    fast = bench.Curve("a", [0.2, 0.6, 0.8], [1.0, 2.0, 3.0], 3.0, 0.0, [3.0] * 3)  # best window mean 0.7
    slow = bench.Curve("b", [0.1, 0.3, 0.5], [2.0, 4.0, 6.0], 6.0, 0.0, [3.0] * 3)  # best window mean 0.4
    settings = bench.Settings(rl_steps=3, window=2)
    assert bench.target_reward(settings, [fast, slow]) == pytest.approx(0.95 * 0.4)
    assert bench.target_reward(bench.Settings(window=2, target=0.5), [fast, slow]) == 0.5


def test_mean_curve_averages_rewards_and_clocks_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_module(monkeypatch)
    a = bench.Curve("s2", [0.0, 1.0], [1.0, 2.0], 3.0, 0.5, [2.0, 4.0])
    b = bench.Curve("s2", [0.5, 0.5], [3.0, 6.0], 7.0, 1.5, [4.0, 4.0])
    mean = bench.mean_curve([a, b])
    assert (mean.name, mean.rewards, mean.ends_s) == ("s2", [0.25, 0.75], [2.0, 4.0])
    assert (mean.total_s, mean.startup_s, mean.completion_tokens) == (5.0, 1.0, [3.0, 4.0])
    with pytest.raises(ValueError):  # runs of different lengths are not one system's seeds
        bench.mean_curve([a, bench.Curve("s2", [0.0], [1.0], 1.0, 0.0, [1.0])])
