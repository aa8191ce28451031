"""Smoke test of ``bench/engine_throughput.py``: the real benchmark, ``--quick`` settings, in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.gpu import GPU

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine_throughput.py"
RATE_LINE = re.compile(r"^(.+?) +(\d+) useful tokens in +(\d+\.\d+) s = +(\d+\.\d+) tokens/s$", re.MULTILINE)
RATIO_LINE = re.compile(r"^ratio tether / (generate \(mixed budgets\)|generate_batch|generate \(uniform "
                        r"budgets\)): (\d+\.\d+|n/a)$", re.MULTILINE)


@pytest.mark.parametrize("dtype, device", [("float32", "cpu"), ("bfloat16", "cpu"),
                                           pytest.param("float32", "cuda", marks=GPU),
                                           pytest.param("bfloat16", "cuda", marks=GPU)])
def test_engine_bench_prints_rates_and_ratios(dtype: str, device: str) -> None:
    # ~40 s in bf16 on a CPU without native bf16 matmuls; the limit only catches a hang (two suite
    # runs on a host loaded 5x by other work took 120 s).
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--threads", "1", "--dtype", dtype,
                             "--device", device], capture_output=True, text=True, timeout=400, check=False)
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
    name = {"float32": "fp32", "bfloat16": "bf16"}[dtype]  # the yardstick is a matmul in the model's dtype
    flops = re.search(rf"decode achieved (\d+\.\d+) GFLOP/s vs {name} matmul (\d+\.\d+) GFLOP/s \(the highest "
                      r"of (\d+\.\d+) at the start, (\d+\.\d+) before and (\d+\.\d+) after these steps\): "
                      r"ratio (\d+\.\d+)", out)
    assert flops is not None, out
    reference = float(flops.group(2))
    assert reference > 0 and reference == max(float(flops.group(i)) for i in (3, 4, 5))
    # The ratio comes from unrounded rates; each printed rate is within 0.05 of its own (a host with
    # no native bf16 matmul printed 0.7 vs 1.0 GFLOP/s with ratio 0.68).
    achieved = float(flops.group(1))
    rounding = 0.05 / reference + 0.05 * achieved / (reference - 0.05) ** 2
    assert abs(float(flops.group(6)) - achieved / reference) <= 0.01 + rounding
    assert len(re.findall(r"^decode at batch \d+", out, re.MULTILINE)) == 2  # the bench's batch and twice it
    # The roofline is a bound no engine beats, and the 10x line is ten transformers' rate over it.
    roof = re.search(r"^roofline \(mixed budgets\): (\d+\.\d+) GFLOP at (\d+\.\d+) GFLOP/s allow at most "
                     r"(\d+\.\d+) tokens/s; tether reaches (\d+\.\d+) of it$", out, re.MULTILINE)
    assert roof is not None, out
    best_rate = float(roof.group(3))
    assert tether_rate < best_rate
    assert abs(float(roof.group(4)) - tether_rate / best_rate) <= 0.01
    paged = rates.get("transformers continuous batching (paged|sdpa)")
    if paged is not None:
        need = re.search(r"^10x generate_batch would need (\d+\.\d+) tokens/s = (\d+\.\d+) of the roofline$",
                         out, re.MULTILINE)
        assert need is not None, out
        assert abs(float(need.group(1)) - 10 * paged[1]) <= 0.01 * 10 * paged[1] + 0.1
    assert "with 1 threads" in out
    assert f"vocab 1024, {name};" in out
    assert ("; host: " in out) == (device == "cuda"), out  # a GPU's run names the GPU and its host
    if "tether decode attention: compiled kernel" in out:  # fp32 where a compiler is: the default is invariant
        assert ("tether batch invariance (engine.batch_invariant: auto): on" in out) == (dtype == "float32"), out
        assert rates["tether, without batch invariance"][0] == mixed
        cost = re.search(r"^ratio batch-invariant / not \(mixed budgets\): (\d+\.\d+)$", out, re.MULTILINE)
        assert (cost is not None) == (dtype == "float32"), out


def test_workload_flops_by_hand() -> None:
    """One group of two samples on a 1-layer model: the prompt once, then each sample's later tokens."""
    sys.path.insert(0, str(BENCH.parent))
    import engine_throughput as bench  # the bench is a script, not a package
    from helpers.hf_tiny import make_hf_model
    from tether.models import Decoder
    from tether.models.config import ModelConfig

    hf = make_hf_model("qwen2", seed=0, vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                       num_kv_heads=1, intermediate_size=32)
    model = Decoder(ModelConfig.from_hf(hf.config.to_dict()))
    settings = bench.BenchSettings(num_prompts=1, num_samples=2)
    workload = bench.Workload(prompts=[[3, 4, 5]], budgets=[1, 3])
    layer_params = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    token = 2 * layer_params + 2 * 16 * 50  # a decoder pass and the vocabulary projection
    keys_flops = 4 * 1 * 2 * 8  # per key: q.k and the weighted value, 2 heads of 8
    # prefill: 3 prompt tokens' passes + one projection; sample 1 is done; sample 2 decodes two more
    # tokens, attending to 3 + 1 and 3 + 2 keys
    expected = 3 * 2 * layer_params + 2 * 16 * 50 + 2 * token + keys_flops * (4 + 5)
    assert bench.workload_flops(model, workload, settings) == expected


def test_engine_bench_takes_another_model_shape() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_throughput_args", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    s = module.parse_args(["--num-layers", "10", "--intermediate-size", "2048"])
    assert (s.num_layers, s.intermediate_size, s.hidden_size) == (10, 2048, 384)
    result = subprocess.run([sys.executable, str(BENCH), "--num-heads", "5"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2 and "must divide by --num-heads (5)" in result.stderr
    assert module.parse_args(["--device", "cpu"]).device == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            module.parse_args(["--device", "cuda"])
