"""tether's rollout engine against transformers' generation, on a GRPO-shaped workload, in one run.

    python bench/engine_throughput.py [--threads 2] [--repeats 2] [--dtype float32] [--device cpu] [--quick]

Workload: ``num_prompts`` random prompts of 32-128 tokens, ``num_samples`` samples each, every sample
with its own length budget drawn uniformly from [16, 256] (the same budgets for every system). Every
sample generates exactly its budget (no EOS stop: ``ignore_eos``), so a system's *useful tokens* are
the sum of the budgets, whatever it computes beyond them. One random Qwen2-shaped checkpoint (~38M
parameters, vocabulary 32000) is written by transformers; tether loads that checkpoint. fp32 (or
``--dtype bfloat16`` on every side: weights, activations and KV; the matmul yardstick in that dtype
too), on the CPU (or ``--device cuda``: every side on the GPU, the yardstick there too), multinomial
sampling at temperature 1.0, top_p 1.0, no top-k on every side.

Systems, each timed ``repeats`` times (best kept: other processes only ever slow a run down):

* tether ``LLMEngine.generate``: continuous batching over a paged KV pool (fp32 decode attention by
  its compiled CPU kernel where it builds: the run prints which);
* transformers ``model.generate`` (sdpa): one static batch of all rows, left-padded, running to the
  longest budget; tokens past a row's budget are computed but not useful;
* transformers continuous batching (``attn_implementation="paged|sdpa"``, the machinery behind
  ``generate_batch``), driven through its manager so each request carries its own ``max_new_tokens``
  (the two peers: ``hf_peers.py``).

In that order: tether and ``generate`` on the mixed budgets, then with uniform budgets (every sample
256 tokens); tether's decode throughput in FLOP/s against the machine's matmul rate in the model's
dtype (``decode_flops_per_token``) at the bench's batch and twice it; then transformers' continuous
batching on the mixed budgets, and the workload's compute roofline (``workload_flops`` at the
measured matmul rate: no engine that multiplies at that rate runs it faster) with the shares of it
that tether reaches and that 10x ``generate_batch`` would need.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import DEVICES, check_device, machine_info, measure_matmul_gflops, set_threads, synchronize  # noqa: E402
from helpers.hf_tiny import make_hf_model  # noqa: E402
from hf_peers import run_hf_generate, run_hf_paged  # noqa: E402
from tether.builders import DTYPES  # noqa: E402
from tether.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tether.models.checkpoint import load_model  # noqa: E402


@dataclass(frozen=True, slots=True)
class BenchSettings:
    num_prompts: int = 16
    num_samples: int = 8  # per prompt (a GRPO group)
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 128
    min_budget: int = 16
    max_budget: int = 256
    vocab_size: int = 32000
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1536
    decode_batch: int = 128  # rows of the FLOP/s measurement
    decode_steps: int = 32
    threads: int = 2
    repeats: int = 2
    seed: int = 0
    skip_hf_paged: bool = False
    dtype: str = "float32"  # of the model on every side: "float32" or "bfloat16"
    device: str = "cpu"  # where every side runs: "cpu" or "cuda"

    @property
    def num_rows(self) -> int:
        return self.num_prompts * self.num_samples

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_name(self) -> str:
        return "fp32" if self.dtype == "float32" else "bf16"

    def matmul_gflops(self) -> float:
        """The machine's matmul rate now, in the model's dtype on the run's device (``measure_matmul_gflops``)."""
        return measure_matmul_gflops(dtype=self.torch_dtype, device=self.device)


BENCH_DTYPES = ("float32", "bfloat16")  # of tether.builders.DTYPES


QUICK = dict(num_prompts=2, num_samples=2, min_prompt_tokens=8, max_prompt_tokens=16, min_budget=4,
             max_budget=12, vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
             decode_batch=8, decode_steps=4, repeats=1)


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]  # [P] prompts of random ids
    budgets: list[int]  # [P * S] new tokens of each sample, prompt-major

    @property
    def num_useful_tokens(self) -> int:
        return sum(self.budgets)

    def with_budget(self, budget: int) -> Workload:
        return Workload(self.prompts, [budget] * len(self.budgets))

    def rows(self) -> list[list[int]]:
        """Each sample's prompt, in the budgets' order."""
        num_samples = len(self.budgets) // len(self.prompts)
        return [prompt for prompt in self.prompts for _ in range(num_samples)]


def make_workload(s: BenchSettings) -> Workload:
    rng = random.Random(s.seed)
    lengths = [rng.randint(s.min_prompt_tokens, s.max_prompt_tokens) for _ in range(s.num_prompts)]
    prompts = [[rng.randrange(3, s.vocab_size) for _ in range(length)] for length in lengths]
    budgets = [rng.randint(s.min_budget, s.max_budget) for _ in range(s.num_rows)]
    return Workload(prompts, budgets)


def best_time(run: Callable[[], int], repeats: int, device: str) -> tuple[float, int]:
    """(fastest wall time of ``repeats`` runs, tokens the run generated), each run's work on
    ``device`` finished inside its time."""
    best_s, num_tokens = float("inf"), 0
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        num_tokens = run()
        synchronize(device)
        best_s = min(best_s, time.perf_counter() - start)
    return best_s, num_tokens


# ---------------------------------------------------------------------------------------------- tether


STEP_TOKENS = 4096  # tether's per-step token budget (max_num_batched_tokens)


def num_prefill_steps(num_rows: int, s: BenchSettings) -> int:
    """Steps measure_decode's prompts take to prefill under the step budget."""
    return -(-num_rows * s.max_prompt_tokens // STEP_TOKENS)


def tether_engine(model: torch.nn.Module, s: BenchSettings, native_attention: bool = True,
                  batch_invariant: bool | str = "auto") -> LLMEngine:
    max_len = s.max_prompt_tokens + s.max_budget
    block_size = 16
    num_blocks = s.num_rows * -(-max_len // block_size) + s.num_prompts  # every row at full length
    num_decode_rows = 2 * s.decode_batch  # measure_decode's largest batch fits too
    decode_len = s.max_prompt_tokens + s.decode_steps + num_prefill_steps(num_decode_rows, s) + 2
    num_blocks = max(num_blocks, num_decode_rows * -(-decode_len // block_size))
    config = EngineConfig(block_size=block_size, max_num_seqs=max(s.num_rows, num_decode_rows),
                          max_num_batched_tokens=STEP_TOKENS, num_kv_blocks=num_blocks, max_model_len=max_len + 1,
                          cpu_native_attention=native_attention, batch_invariant=batch_invariant)
    return LLMEngine(model, config=config)


def run_tether(engine: LLMEngine, w: Workload, s: BenchSettings) -> int:
    """Generate every sample to exactly its budget; returns the tokens generated."""
    engine.block_manager.flush_prefix_cache()  # every run prefills its prompts, as the first one did
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=s.max_budget, n=s.num_samples)
    request_ids = [engine.add_request(prompt, params) for prompt in w.prompts]
    # A sample's own budget: the group shares a prompt (one prefill) but each sample stops on its own,
    # the way GRPO samples end at different EOS positions.
    for index, request_id in enumerate(request_ids):
        for seq in engine._requests[request_id]:
            budget = w.budgets[index * s.num_samples + seq.sample_index]
            seq.params = dataclasses.replace(params, max_new_tokens=budget, n=1)
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(c.num_tokens for c in engine.step())
    return num_tokens


def decode_flops_per_token(model: torch.nn.Module, context_len: float) -> float:
    """FLOPs to decode one token: 2 x (non-embedding parameters) for the matmuls of the layers,
    2 x hidden x vocab for the LM head, and 4 x layers x context x (heads x head_dim) for attention
    (q.k scores plus the weighted sum of values over ``context_len`` keys)."""
    cfg = model.config
    layer_params = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    attention = 4 * cfg.num_hidden_layers * context_len * cfg.num_attention_heads * cfg.head_dim
    return 2 * layer_params + 2 * cfg.hidden_size * cfg.vocab_size + attention


def workload_flops(model: torch.nn.Module, w: Workload, s: BenchSettings) -> float:
    """FLOPs the workload needs whatever the engine and its schedule: each group's prompt once
    (a decoder pass per prompt token and one vocabulary projection for the group's first tokens;
    its attention left out), then every later token of every sample, a full decoder pass plus the
    vocabulary projection plus attention over its context. The token after j generated ones sits at
    position p + j - 1 and attends to p + j keys."""
    cfg = model.config
    layer_params = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    head_flops = 2 * cfg.hidden_size * cfg.vocab_size
    attention_flops_per_key = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    flops = 0.0
    for index, prompt in enumerate(w.prompts):
        num_prompt = len(prompt)
        flops += num_prompt * 2 * layer_params + head_flops
        for budget in w.budgets[index * s.num_samples : (index + 1) * s.num_samples]:
            num_keys = (budget - 1) * num_prompt + (budget - 1) * budget // 2  # sum of p + j, j = 1..b-1
            flops += (budget - 1) * (2 * layer_params + head_flops) + attention_flops_per_key * num_keys
    return flops


def measure_decode(engine: LLMEngine, s: BenchSettings, num_rows: int) -> tuple[float, float, int]:
    """Decode-only steps at batch ``num_rows``: (seconds per step, mean context length, rows)."""
    rng = random.Random(s.seed + 1)
    params = SamplingParams(max_new_tokens=s.decode_steps + num_prefill_steps(num_rows, s) + 2)
    for _ in range(num_rows):
        engine.add_request([rng.randrange(3, s.vocab_size) for _ in range(s.max_prompt_tokens)], params)
    # The prefill (chunked under the step's token budget) until every row has its first token.
    while engine.scheduler.waiting or any(seq.num_output_tokens == 0 for seq in engine.scheduler.running):
        engine.step()
    assert len(engine.scheduler.running) == num_rows
    times_s, contexts = [], []
    for _ in range(s.decode_steps):
        contexts.append(sum(seq.num_tokens for seq in engine.scheduler.running) / num_rows)
        synchronize(s.device)
        start = time.perf_counter()
        engine.step()
        synchronize(s.device)
        times_s.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    best = sorted(times_s)[: max(1, len(times_s) // 2)]  # the faster half: steps hit by other load drop out
    return sum(best) / len(best), sum(contexts) / len(contexts), num_rows


# ------------------------------------------------------------------------------------------------ main


def build_models(s: BenchSettings, directory: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(tether ``Decoder``, transformers model with sdpa attention), the same weights."""
    from transformers import AutoModelForCausalLM

    hf = make_hf_model("qwen2", seed=s.seed, vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                       num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                       intermediate_size=s.intermediate_size)
    hf.save_pretrained(directory)
    tether = load_model(directory).to(device=s.device, dtype=s.torch_dtype).eval()
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=s.torch_dtype, attn_implementation="sdpa")
    hf = hf.to(s.device).eval()
    # No row of `generate` stops at EOS (ignore_eos, as tether's rows): a GenerationConfig's eos_token_id
    # None is "not given", and generate fills it in from the model's generation_config.
    hf.generation_config.eos_token_id = None
    return tether, hf


def line(name: str, seconds: float, useful: int) -> str:
    return f"{name:42} {useful:7d} useful tokens in {seconds:7.2f} s = {useful / seconds:8.1f} tokens/s"


class Printer:
    """Prints each result line as soon as it is known (a long run shows progress)."""

    def append(self, text: str) -> None:
        print(text, flush=True)

    def extend(self, texts: list[str]) -> None:
        for text in texts:
            self.append(text)


def compare(s: BenchSettings, tether: torch.nn.Module, hf: torch.nn.Module, w: Workload) -> float:
    """tether against ``generate``, mixed then uniform budgets; returns tether's mixed-budget rate."""
    out = Printer()
    engine = tether_engine(tether, s)
    kernel = "compiled kernel (tether.engine.native)" if engine.runner.decode_kernel else "PyTorch ops"
    out.append(f"tether decode attention: {kernel}")
    out.append(f"tether batch invariance (engine.batch_invariant: auto): "
               f"{'on' if engine.is_batch_invariant else 'off'}")
    run_tether(engine, w.with_budget(s.min_budget), s)  # warm-up: allocator, thread pool
    t_s, t_tokens = best_time(lambda: run_tether(engine, w, s), s.repeats, s.device)
    assert t_tokens == w.num_useful_tokens, (t_tokens, w.num_useful_tokens)
    out.append(line("tether LLMEngine (mixed budgets)", t_s, t_tokens))
    if engine.runner.decode_kernel is not None:
        out.extend(compare_tether_paths(s, tether, w, t_tokens / t_s, engine.is_batch_invariant))
    warm_up = w.with_budget(s.min_budget)
    run_hf_generate(hf, warm_up.rows(), warm_up.budgets)  # the same warm-up
    g_s, g_tokens = best_time(lambda: run_hf_generate(hf, w.rows(), w.budgets), s.repeats, s.device)
    assert g_tokens == w.num_useful_tokens, (g_tokens, w.num_useful_tokens)
    out.append(line("transformers generate (mixed budgets)", g_s, g_tokens))
    out.append(f"ratio tether / generate (mixed budgets): {(t_tokens / t_s) / (g_tokens / g_s):.2f}")
    uniform = w.with_budget(s.max_budget)
    u_s, u_tokens = best_time(lambda: run_tether(engine, uniform, s), s.repeats, s.device)
    out.append(line("tether LLMEngine (uniform budgets)", u_s, u_tokens))
    h_s, h_tokens = best_time(lambda: run_hf_generate(hf, uniform.rows(), uniform.budgets), s.repeats, s.device)
    assert u_tokens == h_tokens == uniform.num_useful_tokens, (u_tokens, h_tokens, uniform.num_useful_tokens)
    out.append(line("transformers generate (uniform budgets)", h_s, h_tokens))
    out.append(f"ratio tether / generate (uniform budgets): {(u_tokens / u_s) / (h_tokens / h_s):.2f}")
    return t_tokens / t_s


def compare_paged_and_roofline(s: BenchSettings, tether: torch.nn.Module, hf: torch.nn.Module, w: Workload,
                               gflops: float, tether_rate: float) -> None:
    """transformers' continuous batching (last: on a GPU its start-up is the least predictable part,
    so a run cut short there has printed everything of tether's), then the mixed run's roofline."""
    out = Printer()
    paged_rate = None
    if s.skip_hf_paged:
        out.append("transformers continuous batching: skipped (--skip-hf-paged)")
    else:
        lines, paged_rate = compare_hf_paged(s, hf, w, tether_rate)
        out.extend(lines)
    gflops = max(gflops, s.matmul_gflops())  # the start's figure may come from a busy moment
    out.extend(roofline_report(tether, w, s, gflops, tether_rate, paged_rate))


def compare_tether_paths(s: BenchSettings, tether: torch.nn.Module, w: Workload, rate: float,
                         is_invariant: bool) -> list[str]:
    """What batch invariance costs (the default engine against one without it) and what the compiled
    decode attention gives (without invariance, against PyTorch ops), on the mixed workload."""
    rates, lines = {}, []
    for name, native, invariant in [("without batch invariance", True, False),
                                    ("decode attention by PyTorch ops", False, False)]:
        engine = tether_engine(tether, s, native_attention=native, batch_invariant=invariant)
        run_tether(engine, w.with_budget(s.min_budget), s)
        seconds, tokens = best_time(lambda: run_tether(engine, w, s), s.repeats, s.device)  # noqa: B023 (called here)
        rates[name] = tokens / seconds
        lines.append(line(f"tether, {name}", seconds, tokens))
    if is_invariant:
        lines.append(f"ratio batch-invariant / not (mixed budgets): {rate / rates['without batch invariance']:.2f}")
    ratio = rates["without batch invariance"] / rates["decode attention by PyTorch ops"]
    lines.append(f"ratio compiled / PyTorch decode attention (mixed budgets, both without invariance): {ratio:.2f}")
    return lines


def compare_hf_paged(s: BenchSettings, hf: torch.nn.Module, w: Workload,
                     tether_rate: float) -> tuple[list[str], float | None]:
    """(result lines, transformers' continuous-batching tokens/s or None when it cannot run)."""
    from transformers import AutoModelForCausalLM

    try:
        paged = AutoModelForCausalLM.from_pretrained(hf.name_or_path, dtype=s.torch_dtype,
                                                     attn_implementation="paged|sdpa").to(s.device).eval()
        max_len, warm_up = s.max_prompt_tokens + s.max_budget, w.with_budget(s.min_budget)
        run_hf_paged(paged, warm_up.rows(), warm_up.budgets, max_len, s.seed)  # the same warm-up as the others
        p_s, p_tokens = min(run_hf_paged(paged, w.rows(), w.budgets, max_len, s.seed) for _ in range(s.repeats))
        assert p_tokens == w.num_useful_tokens, (p_tokens, w.num_useful_tokens)
    except Exception as error:  # report why it cannot run here, and go on with the rest
        message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        return [f"transformers continuous batching: cannot run: {message}",
                "ratio tether / generate_batch: n/a"], None
    return [line("transformers continuous batching (paged|sdpa)", p_s, p_tokens),
            f"ratio tether / generate_batch: {tether_rate / (p_tokens / p_s):.2f}"], p_tokens / p_s


def roofline_report(tether: torch.nn.Module, w: Workload, s: BenchSettings, gflops: float,
                    tether_rate: float, paged_rate: float | None) -> list[str]:
    """The mixed run's compute roofline: its FLOPs (``workload_flops``) at the matmul rate in its dtype
    (the higher of the run's start and a measurement after the mixed comparisons). A lower bound on
    its time for any engine that multiplies no faster than that yardstick (memory traffic only adds
    to it), and the shares of the resulting rate that tether reaches and that 10x transformers'
    continuous batching would need."""
    flops = workload_flops(tether, w, s)
    best_rate = w.num_useful_tokens / (flops / (gflops * 1e9))
    lines = [f"roofline (mixed budgets): {flops / 1e9:.1f} GFLOP at {gflops:.1f} GFLOP/s allow at most "
             f"{best_rate:.1f} tokens/s; tether reaches {tether_rate / best_rate:.2f} of it"]
    if paged_rate is not None:
        lines.append(f"10x generate_batch would need {10 * paged_rate:.1f} tokens/s = "
                     f"{10 * paged_rate / best_rate:.2f} of the roofline")
    return lines


def decode_flops_report(s: BenchSettings, tether: torch.nn.Module, matmul_gflops: float,
                        num_rows: int) -> list[str]:
    """Decode FLOP/s at ``num_rows`` against the matmul rate in the model's dtype: the highest of the run's start
    (``matmul_gflops``) and two measurements just before and after the decode steps, so a host that
    was busy at the start cannot inflate the ratio, nor one busy only during the decode deflate it
    unseen (both adjacent figures are printed)."""
    engine = tether_engine(tether, s)
    before = s.matmul_gflops()
    step_s, context_len, rows = measure_decode(engine, s, num_rows)
    after = s.matmul_gflops()
    reference = max(matmul_gflops, before, after)
    flops = decode_flops_per_token(tether, context_len)
    gflops = flops * rows / step_s / 1e9
    return [f"decode at batch {rows}, mean context {context_len:.0f}: {step_s * 1e3:.1f} ms/step, "
            f"{flops / 1e6:.1f} MFLOP/token (2 x layer params + 2 x hidden x vocab + "
            f"4 x layers x context x heads x head_dim)",
            f"decode achieved {gflops:.1f} GFLOP/s vs {s.dtype_name} matmul {reference:.1f} GFLOP/s (the highest "
            f"of {matmul_gflops:.1f} at the start, {before:.1f} before and {after:.1f} after these steps): "
            f"ratio {gflops / reference:.2f}"]


def parse_args(argv: Sequence[str] | None = None) -> BenchSettings:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = BenchSettings()
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: torch default)")
    p.add_argument("--repeats", type=int, default=None, help=f"runs per system, best kept ({d.repeats})")
    p.add_argument("--quick", action="store_true", help="a tiny model and workload: a smoke test")
    p.add_argument("--skip-hf-paged", action="store_true", help="leave out transformers' continuous batching")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", choices=BENCH_DTYPES, default=d.dtype,
                   help="the model's dtype on every side (the matmul yardstick's too)")
    p.add_argument("--device", choices=DEVICES, default=d.device,
                   help="where every side runs, the matmul yardstick too (auto: the GPU where torch sees one)")
    shape = p.add_argument_group("model shape (Qwen2; default: the issue's 25-50M parameters, vocabulary 32k)")
    for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads"):
        shape.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"({getattr(d, name)})")
    a = p.parse_args(argv)
    s = BenchSettings(**QUICK) if a.quick else d
    sizes = {name: getattr(a, name) for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads",
                                                  "num_kv_heads") if getattr(a, name) is not None}
    if any(value < 1 for value in sizes.values()):
        p.error(f"model sizes must be >= 1, got {sizes}")
    s = dataclasses.replace(s, **sizes)
    if s.hidden_size % s.num_heads or s.num_heads % s.num_kv_heads:
        p.error(f"--hidden-size ({s.hidden_size}) must divide by --num-heads ({s.num_heads}), and that by "
                f"--num-kv-heads ({s.num_kv_heads})")
    repeats = a.repeats if a.repeats is not None else s.repeats
    if repeats < 1 or a.threads < 0:
        p.error(f"--repeats must be >= 1 and --threads >= 0, got {repeats}, {a.threads}")
    device = check_device(p, a.device)
    return dataclasses.replace(s, threads=a.threads, repeats=repeats, seed=a.seed,
                               skip_hf_paged=a.skip_hf_paged, dtype=a.dtype, device=device)


def main(argv: Sequence[str] | None = None) -> None:
    s = parse_args(argv)
    set_threads(s.threads)
    torch.manual_seed(s.seed)
    machine = machine_info(device=s.device)
    w = make_workload(s)
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        tether, hf = build_models(s, Path(tmp) / "ckpt")
        num_params = sum(p.numel() for p in tether.parameters())
        print(f"machine: {machine.describe()}", flush=True)
        print(f"date: {machine.date_utc}; load average (1 min) at start: {machine.load_average:.2f}",
              flush=True)
        print(f"model: qwen2 {num_params / 1e6:.1f}M parameters, hidden {s.hidden_size} x {s.num_layers} "
              f"layers, "
              f"vocab {s.vocab_size}, {s.dtype_name}; workload: {s.num_prompts} prompts x {s.num_samples} samples, "
              f"prompts {s.min_prompt_tokens}-{s.max_prompt_tokens} tokens, budgets {s.min_budget}-"
              f"{s.max_budget} ({w.num_useful_tokens} useful tokens); best of {s.repeats}", flush=True)
        gflops = machine.matmul_gflops  # fp32
        if s.torch_dtype != torch.float32:
            gflops = s.matmul_gflops()
            print(f"{s.dtype_name} matmul {gflops:.1f} GFLOP/s (the yardstick of this run)", flush=True)
        with torch.inference_mode():
            tether_rate = compare(s, tether, hf, w)
            # The bench's batch and twice it (a GRPO step of 16 prompts x 16 samples decodes 256 rows).
            for num_rows in (s.decode_batch, 2 * s.decode_batch):
                Printer().extend(decode_flops_report(s, tether, gflops, num_rows))
            compare_paged_and_roofline(s, tether, hf, w, gflops, tether_rate)
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
