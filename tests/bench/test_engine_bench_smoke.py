"""Smoke test of ``bench/engine_throughput.py``: the real benchmark, ``--quick`` settings, in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine_throughput.py"
RATE_LINE = re.compile(r"^(.+?) +(\d+) useful tokens in +(\d+\.\d+) s = +(\d+\.\d+) tokens/s$", re.MULTILINE)
RATIO_LINE = re.compile(r"^ratio tether / (generate \(mixed budgets\)|generate_batch|generate \(uniform "
                        r"budgets\)): (\d+\.\d+|n/a)$", re.MULTILINE)


def test_engine_bench_prints_rates_and_ratios() -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--threads", "1"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    rates = {m.group(1).strip(): (int(m.group(2)), float(m.group(4))) for m in RATE_LINE.finditer(out)}
    ratios = {m.group(1): m.group(2) for m in RATIO_LINE.finditer(out)}
    assert set(ratios) == {"generate (mixed budgets)", "generate_batch", "generate (uniform budgets)"}, out
    # Useful tokens are the same budgets for every system: tether and generate report the same count.
    mixed = rates["tether LLMEngine (mixed budgets)"][0]
    assert rates["transformers generate (mixed budgets)"][0] == mixed
    uniform = rates["tether LLMEngine (uniform budgets)"][0]
    assert rates["transformers generate (uniform budgets)"][0] == uniform
    assert uniform > mixed  # --quick: 2 x 2 samples of 12 tokens beat budgets drawn from [4, 12]
    assert uniform == 2 * 2 * 12
    # The printed ratio is the quotient of the printed rates (rounding aside).
    tether_rate = rates["tether LLMEngine (mixed budgets)"][1]
    expected = tether_rate / rates["transformers generate (mixed budgets)"][1]
    assert abs(float(ratios["generate (mixed budgets)"]) - expected) <= 0.01 * expected + 0.01
    flops = re.search(r"decode achieved (\d+\.\d+) GFLOP/s vs fp32 matmul (\d+\.\d+) GFLOP/s: "
                      r"ratio (\d+\.\d+)", out)
    assert flops is not None, out
    assert float(flops.group(2)) > 0
    assert len(re.findall(r"^decode at batch \d+", out, re.MULTILINE)) == 2  # the bench's batch and twice it
    # The roofline is a bound no engine beats, and the 10x line is ten transformers' rate over it.
    roof = re.search(r"^roofline \(mixed budgets\): at most (\d+\.\d+) tokens/s .*; tether reaches "
                     r"(\d+\.\d+) of it$", out, re.MULTILINE)
    assert roof is not None, out
    assert tether_rate < float(roof.group(1))
    assert abs(float(roof.group(2)) - tether_rate / float(roof.group(1))) <= 0.01
    paged = rates.get("transformers continuous batching (paged|sdpa)")
    if paged is not None:
        need = re.search(r"^10x generate_batch would need (\d+\.\d+) tokens/s = (\d+\.\d+) of the roofline$",
                         out, re.MULTILINE)
        assert need is not None, out
        assert abs(float(need.group(1)) - 10 * paged[1]) <= 0.01 * 10 * paged[1] + 0.1
    assert "with 1 threads" in out
