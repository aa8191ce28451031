"""Smoke test of ``bench/long_prompt_prefill.py``: the real benchmark, ``--quick`` settings, in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "long_prompt_prefill.py"
RATE_LINE = re.compile(r"^L= *(\d+) (.+?) +(\d+\.\d+) s = +(\d+\.\d+) prompt tokens/s$", re.MULTILINE)
RATIO_LINE = re.compile(r"^L= *(\d+) ratio (tether / transformers \(tokens/s\)|invariant / not \(time\)): "
                        r"(\d+\.\d+)$", re.MULTILINE)


def test_long_prompt_bench_prints_rates_and_ratios() -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--threads", "1", "--repeats", "1"],
                            capture_output=True, text=True, timeout=400, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    rates: dict[tuple[int, str], tuple[float, float]] = {
        (int(m.group(1)), m.group(2).strip()): (float(m.group(3)), float(m.group(4))) for m in RATE_LINE.finditer(out)}
    ratios = {(int(m.group(1)), m.group(2)): float(m.group(3)) for m in RATIO_LINE.finditer(out)}
    assert {length for length, _ in rates} == {64, 128} and len(rates) == 6, out
    assert len(ratios) == 4, out
    for length in (64, 128):
        names = {name: value for (at, name), value in rates.items() if at == length}
        [invariant] = [value for name, value in names.items() if name.startswith("tether (batch invariant:")]
        plain, peer = names["tether (batch_invariant: false)"], names["transformers forward (sdpa)"]
        for seconds, rate in (invariant, plain, peer):  # 2 prompts of `length` tokens each, per second
            assert 2 * length / rate == pytest.approx(seconds, abs=6e-4)  # seconds printed to 1 ms
        # the printed ratios are the quotients of the printed rates (rounding aside)
        assert ratios[(length, "tether / transformers (tokens/s)")] == pytest.approx(invariant[1] / peer[1], abs=0.01)
        assert ratios[(length, "invariant / not (time)")] == pytest.approx(plain[1] / invariant[1], abs=0.01)
    assert "with 1 threads" in out and re.search(r"fp32 matmul \d+\.\d GFLOP/s", out)
