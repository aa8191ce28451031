"""Smoke test of ``bench/grpo_step.py``: the real benchmark, tiny settings, in a subprocess."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "grpo_step.py"
RATIO_LINE = re.compile(r"^ratio trl_s_per_step / tether_s_per_step: (\d+\.\d+)$", re.MULTILINE)
STEP_LINE = re.compile(r"^(tether|trl): +(\d+\.\d+) s/step .*mean completion (\d+\.\d+) tokens$",
                       re.MULTILINE)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="trl is not installed (optional extra: pip install -e '.[bench]')")
def test_grpo_step_bench_prints_the_ratio() -> None:
    max_new_tokens = 6
    result = subprocess.run(
        [sys.executable, str(BENCH), "--steps", "1", "--warmup", "1", "--threads", "1",
         "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", str(max_new_tokens),
         "--hidden-size", "32", "--num-layers", "1"],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    ratio = RATIO_LINE.search(result.stdout)
    assert ratio is not None, result.stdout
    steps = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in STEP_LINE.finditer(result.stdout)}
    assert set(steps) == {"tether", "trl"}, result.stdout
    for seconds, mean_tokens in steps.values():
        assert seconds > 0
        assert 1.0 <= mean_tokens <= max_new_tokens  # both sides generated within the same limit
    # the printed ratio is the quotient of the printed step times (rounding aside)
    expected = steps["trl"][0] / steps["tether"][0]
    assert float(ratio.group(1)) == pytest.approx(expected, rel=0.05, abs=0.02)
    assert "with 1 threads" in result.stdout
    assert re.search(r"fp32 matmul \d+\.\d GFLOP/s", result.stdout)
