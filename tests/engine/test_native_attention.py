"""The compiled CPU decode attention (``tether.engine.native``) against the PyTorch path it replaces."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers.hf_tiny import make_hf_checkpoint
from helpers.native import built_kernels, needs_toolchain
from tether.engine import EngineConfig, LLMEngine, SamplingParams, native
from tether.engine.attention import AttentionGroup, _attend_decode, _attend_decode_native
from tether.models import load_model


@pytest.fixture(scope="module")
def kernel():
    return built_kernels().decode_attention


def _decode_group(lengths: list[int], num_keys: int, window: int | None) -> AttentionGroup:
    """The decode group ``build_step_metadata`` makes for rows with these context lengths."""
    num_rows = len(lengths)
    lens = torch.tensor(lengths)
    k_pos = torch.arange(num_keys)
    is_visible = k_pos[None, :] < lens[:, None]
    if window is not None:
        is_visible &= (lens[:, None] - 1 - k_pos[None, :]) < window
    mask = torch.zeros(num_rows, 1, 1, num_keys).masked_fill_(~is_visible[:, None, None, :], float("-inf"))
    index = torch.arange(num_rows)
    return AttentionGroup(index[:, None], index, mask, None, index, None, context_lens=lens, window=window)


@needs_toolchain
@pytest.mark.parametrize("keys_by_token", [True, False])  # keys [C, D] or held transposed [D, C]
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (1, 128), (4, 24), (8, 64)])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_the_matmul_path(kernel, keys_by_token, group, head_dim, window):
    torch.manual_seed(group * head_dim)
    num_rows, num_kv_heads, capacity, num_keys = 7, 2, 48, 40
    lengths = [1, 40, 17, 5, 33, 2, 39]
    # Slots longer than the step reads (DecodeKV's capacity), so k and v are strided views.
    values = torch.randn(num_rows, num_kv_heads, capacity, head_dim)[:, :, :num_keys]
    if keys_by_token:
        keys_t = (torch.randn(num_rows, num_kv_heads, capacity, head_dim) * 3)[:, :, :num_keys].transpose(-1, -2)
    else:
        keys_t = (torch.randn(num_rows, num_kv_heads, head_dim, capacity) * 3)[..., :num_keys]
    q = torch.randn(num_rows, num_kv_heads * group, head_dim)
    g = _decode_group(lengths, num_keys, window)
    expected = _attend_decode(q, keys_t, values, g, g.mask, is_matmul=True)
    out = _attend_decode_native(kernel, q, keys_t, values, g, window or 0)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@needs_toolchain
def test_kernel_edges_no_rows_and_a_nan_confined_to_its_row(kernel):
    assert kernel(*(torch.randn(0, 2, 3, 8),) * 3, torch.zeros(0, dtype=torch.long), 0.3, 0).shape == (0, 2, 3, 8)
    q, k, v = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    k[1, 0, 2, 5] = float("nan")
    out = kernel(q, k, v, torch.tensor([6, 6, 6]), 0.3, 0)
    assert out[1, 0].isnan().all() and not out[1, 1].isnan().any()  # that row and KV head only
    assert not out[[0, 2]].isnan().any()
    assert not kernel(q, k, v, torch.tensor([6, 6, 6]), 0.3, 3)[1].isnan().any()  # the window leaves it out


@needs_toolchain
def test_query_rows_read_the_keys_they_name(kernel):
    """Prefill queries (batch invariance): row s attends over k[kv_rows[s]] up to lengths[s] keys, the
    same bits as a decode row with those keys, and the softmax attention within rounding."""
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 2, 3, 64), torch.randn(2, 2, 30, 64), torch.randn(2, 2, 30, 64)
    rows, lengths = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1, 30, 7, 8, 20])
    out = kernel(q, k, v, lengths, 0.125, 0, rows)
    assert torch.equal(out, kernel(q, k[rows], v[rows], lengths, 0.125, 0))  # a decode row per query
    for s in range(5):
        n = int(lengths[s])
        weights = torch.softmax(q[s] @ k[rows[s], :, :n].transpose(-1, -2) * 0.125, dim=-1)  # [H, G, n]
        torch.testing.assert_close(out[s], weights @ v[rows[s], :, :n], atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match=r"kv_rows\[1\] = 2 outside \[0, 2\)"):
        kernel(q[:2], k, v, lengths[:2], 0.125, 0, torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="kv_rows must be None or"):
        kernel(q, k, v, lengths, 0.125, 0, torch.tensor([0, 1]))


@needs_toolchain
@pytest.mark.parametrize("head_dim", [64, 24, 128])
@pytest.mark.parametrize("window", [0, 5])
def test_query_rows_in_blocks_give_each_rows_own_bits(kernel, head_dim, window):
    """Runs of rows reading one sequence (a prefill chunk: 37 and 20 queries, so blocks of 16 and a
    remainder) share their passes over the keys, and every row still gets the bits it gets alone, in
    any order of lengths, with a window or not."""
    torch.manual_seed(head_dim + window)
    q, k, v = torch.randn(60, 2, 3, head_dim), torch.randn(3, 2, 50, head_dim), torch.randn(3, 2, 50, head_dim)
    rows = torch.tensor([0] * 37 + [2] * 20 + [1] * 3)
    lengths = torch.cat([torch.arange(14, 51), torch.randint(1, 51, (20,)), torch.tensor([50, 9, 1])])
    out = kernel(q, k, v, lengths, 0.2, window, rows)
    assert torch.equal(out, kernel(q, k[rows], v[rows], lengths, 0.2, window))  # each row alone
    for s in (0, 36, 40, 59):
        first = max(0, int(lengths[s]) - window) if window else 0
        keys, values = k[rows[s], :, first : lengths[s]], v[rows[s], :, first : lengths[s]]
        weights = torch.softmax(q[s] @ keys.transpose(-1, -2) * 0.2, dim=-1)  # [H, G, n]
        torch.testing.assert_close(out[s], weights @ values, atol=2e-6, rtol=1e-5)


@needs_toolchain
def test_query_rows_over_a_long_context_split_their_block_and_keep_their_bits(kernel):
    """16 rows x 8 query heads x 33,000 keys of scores pass the kernel's 16 MB per block: the rows
    go in smaller blocks, each still with the bits it gets alone."""
    torch.manual_seed(5)
    num_keys = 33_000
    q, k, v = torch.randn(16, 1, 8, 16), torch.randn(1, 1, num_keys, 16), torch.randn(1, 1, num_keys, 16)
    rows, lengths = torch.zeros(16, dtype=torch.long), torch.arange(num_keys - 15, num_keys + 1)
    out = kernel(q, k, v, lengths, 0.25, 0, rows)
    assert torch.equal(out, kernel(q, k.expand(16, -1, -1, -1), v.expand(16, -1, -1, -1), lengths, 0.25, 0))


@needs_toolchain
@pytest.mark.parametrize("head_dim", [64, 24])
def test_a_rows_output_depends_on_its_own_inputs_only(kernel, head_dim):
    """The same query, keys, values and length give the same bits at any row, beside any other rows,
    in a buffer of any capacity (alignment) and on any thread: the sums run in a fixed order."""
    torch.manual_seed(1)
    q, keys, values = torch.randn(1, 2, 4, head_dim), torch.randn(1, 2, 37, head_dim), torch.randn(1, 2, 37, head_dim)
    alone = kernel(q, keys, values, torch.tensor([37]), 0.2, 0)
    for num_rows, at, capacity, offset in [(9, 4, 40, 3), (3, 2, 128, 1), (17, 0, 37, 0), (2, 1, 61, 5)]:
        q_batch = torch.randn(num_rows, 2, 4, head_dim)
        k_batch, v_batch = torch.randn(num_rows, 2, capacity + offset, head_dim), torch.randn(
            num_rows, 2, capacity + offset, head_dim)
        q_batch[at], k_batch[at, :, offset:offset + 37], v_batch[at, :, offset:offset + 37] = q[0], keys[0], values[0]
        lengths = torch.randint(1, capacity + 1, (num_rows,))
        lengths[at] = 37
        out = kernel(q_batch, k_batch[:, :, offset:], v_batch[:, :, offset:], lengths, 0.2, 0)
        assert torch.equal(out[at], alone[0])


@needs_toolchain
def test_kernel_rejects_what_it_cannot_read(kernel):
    q, k = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 5, 8)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(q.double(), k.double(), k.double(), torch.tensor([5, 5]), 0.3, 0)
    with pytest.raises(RuntimeError, match="do not match"):
        kernel(q, k, k[:, :, :4], torch.tensor([5, 5]), 0.3, 0)


@needs_toolchain
def test_engine_generates_the_same_with_and_without_the_kernel(tmp_path, kernel):
    """Greedy tokens equal, sampled ones too (same seeds), log-probs within 1e-5; with a pool small
    enough to preempt, and contexts past 128 keys (the pool-gather path took SDPA there)."""
    path = make_hf_checkpoint(tmp_path / "qwen2", "qwen2", seed=3)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 150, 9)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=12), SamplingParams(temperature=1.0, max_new_tokens=30,
                                                                                 seed=4, n=3)]
    results = []
    for is_native in (True, False):
        config = EngineConfig(num_kv_blocks=60, block_size=4, max_num_batched_tokens=64,
                              cpu_native_attention=is_native)
        engine = LLMEngine(load_model(path), config=config)
        assert (engine.runner.decode_kernel is not None) == is_native
        results.append([engine.generate(prompts, p) for p in params])
    for with_kernel, without in zip(*results):
        for a, b in zip(with_kernel, without):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_kernel_that_cannot_be_built_leaves_the_pytorch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    broken = tmp_path / "decode_attention.cpp"
    broken.write_text("int main() { return undeclared; }\n")
    monkeypatch.setattr(native, "SOURCES", (broken,))
    if native.compiler_target():  # a compiler is here: the warning carries its error, not the command
        with pytest.warns(RuntimeWarning, match="native CPU decode attention unavailable.*undeclared"):
            assert native.compiled_kernels.__wrapped__() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the flag off: nothing is built, nothing warned
        engine = LLMEngine(load_model(make_hf_checkpoint(tmp_path / "m", "qwen2", seed=1)),
                           config=EngineConfig(num_kv_blocks=16, cpu_native_attention=False))
    assert engine.runner.decode_kernel is None
    assert engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3))[0].num_tokens == 3


_LOAD = """
import sys, warnings
warnings.simplefilter("error")
from tether.engine import native
sys.exit(0 if native.decode_attention_kernel() is not None else 3)
"""
_LOAD_OR_FALL_BACK = """
import sys
from tether.engine import native
sys.exit(0 if native.decode_attention_kernel() is None else 4)
"""


def _cache_without_ninja(tmp_path: Path, library: bytes) -> tuple[Path, dict[str, str]]:
    """A fresh extension cache holding ``library`` where the kernel's build goes, and an environment
    that uses that cache with a ninja that fails ahead of any other (building would need it):
    (the library's path there, the environment)."""

    name = native.build_name()
    copy = tmp_path / "extensions" / name / f"{name}.so"  # where cpp_extension builds under TORCH_EXTENSIONS_DIR
    copy.parent.mkdir(parents=True)
    copy.write_bytes(library)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (tools / "ninja").chmod(0o755)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
           "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    return copy, env


def _built_library() -> bytes:
    from torch.utils import cpp_extension

    name = native.build_name()
    return (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").read_bytes()


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], env=env, timeout=120, capture_output=True, text=True)


@needs_toolchain
def test_a_built_kernel_loads_past_a_dead_builders_lock_without_ninja(kernel, tmp_path):
    """A builder killed mid-compile (a generator process stopped while it starts) leaves
    cpp_extension's lock file behind, which made every later load wait forever; and a cached build
    needs no ninja to load (it is imported, not checked by a build)."""
    copy, env = _cache_without_ninja(tmp_path, _built_library())
    (copy.parent / native.MARKER).write_text(str(copy.stat().st_size))  # a finished build
    (copy.parent / "lock").write_text("")  # the dead builder's
    done = _run(_LOAD, env)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_toolchain
def test_a_half_written_library_is_rebuilt_not_imported(kernel, tmp_path):
    """A builder killed while linking leaves a truncated library; importing one killed the process
    (SIGBUS, past any except). Without its finished-build marker it is removed and built again:
    here that build fails (ninja fails), so the engine falls back with a warning, alive."""
    library = _built_library()
    partial, env = _cache_without_ninja(tmp_path, library[: len(library) // 2])
    done = _run(_LOAD_OR_FALL_BACK, env)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "native CPU decode attention unavailable" in done.stderr
    assert not partial.exists()  # the partial library is gone


@needs_toolchain
def test_more_query_heads_per_kv_head_than_the_kernel_takes_attend_by_pytorch(tmp_path):
    """72 query heads on one KV head: past the kernel's group limit, the engine attends with PyTorch
    ops (batch invariance, which needs the kernel, turns itself off) and matches transformers."""
    from transformers import AutoModelForCausalLM

    path = make_hf_checkpoint(tmp_path / "wide", "llama", hidden_size=288, num_heads=72, num_kv_heads=1, seed=2)
    engine = LLMEngine(load_model(path), config=EngineConfig(num_kv_blocks=32, block_size=4))
    assert engine.runner.decode_kernel is None and not engine.runner.is_batch_invariant
    prompt = list(range(5, 14))
    completion = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert completion.token_ids == expected
