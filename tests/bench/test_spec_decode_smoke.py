"""Smoke test of ``bench/spec_decode.py``: the real benchmark with a few training steps, in a subprocess
(the script itself asserts that the three greedy outputs are identical)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.gpu import GPU

BENCH = Path(__file__).resolve().parents[2] / "bench" / "spec_decode.py"
ROW = re.compile(r"^(plain|ngram|draft) +(\d+\.\d+) +(\d+\.\d+)x +(-|\d+\.\d+%)$", re.MULTILINE)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_spec_decode_bench_prints_the_three_methods(device: str) -> None:
    result = subprocess.run([sys.executable, str(BENCH), "--steps", "20", "--draft-steps", "20", "--num-prompts", "2",
                             "--device", device], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "outputs identical across the three runs" in result.stdout, result.stdout
    rows = {m.group(1): m for m in ROW.finditer(result.stdout)}
    assert set(rows) == {"plain", "ngram", "draft"}, result.stdout
    assert rows["plain"].group(3) == "1.00" and rows["plain"].group(4) == "-"
    assert ("; host: " in result.stdout) == (device == "cuda")


def test_spec_decode_bench_refuses_a_missing_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, str(BENCH), "--device", "cuda"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2 and "torch sees no CUDA device here" in result.stderr
