"""The engine keeps every tensor on its model's device: on CUDA nothing may mix with CPU tensors.

CI has no GPU, so the model sits on a CUDA device played by CPU tensors (``helpers.fake_cuda``): the
engine sees ``cuda:0`` and takes its GPU paths (no compiled kernel, no oneDNN copies, free memory
from ``torch.cuda``), and every op that real CUDA would refuse for its devices is recorded with
where in tether it happened. Each case runs the engine through one feature on that device, and
again on a real GPU where there is one (``bench/device_check.sh`` runs this module on a lent GPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.fake_cuda import FakeCuda, RealCuda, on_device
from helpers.gpu import GPU, on_gpu
from helpers.hf_tiny import make_hf_checkpoint
from helpers.reference import full_forward_logprobs
from tether.engine import EngineConfig, LLMEngine, SamplingParams
from tether.models import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [20, 21, 22], list(range(30, 50)), [44]]
MIXED = [
    SamplingParams(temperature=0.9, top_k=30, top_p=0.95, max_new_tokens=12, seed=1, n=2),
    SamplingParams(temperature=0.0, max_new_tokens=12),
    SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, n=3),  # the plain sampler's path
    SamplingParams(temperature=0.7, min_p=0.05, max_new_tokens=12, seed=4),
]
BASE = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=8, max_model_len=128, num_kv_blocks=200)
CASES = {
    "fp32": ("qwen2", {}, torch.float32),
    "bf16": ("qwen2", {}, torch.bfloat16),
    "memory fraction": ("qwen2", {"num_kv_blocks": None, "kv_cache_memory_fraction": 0.3}, torch.float32),
    # Decode copies at the pool's size cap: some decode rows read their KV from the pool.
    "pool reads": ("qwen2", {"num_kv_blocks": 24}, torch.float32),
    "recompute on update": ("qwen2", {"recompute_kv_on_update": True}, torch.float32),
    "sliding window": ("mistral", {}, torch.float32),
    "ngram": ("qwen2", {"speculative": "ngram", "num_speculative_tokens": 3}, torch.float32),
    "draft": ("qwen2", {"speculative": "draft", "num_speculative_tokens": 3}, torch.float32),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_cuda")
    return {
        "qwen2": make_hf_checkpoint(root / "qwen2", "qwen2", seed=3, vocab_size=300),
        "mistral": make_hf_checkpoint(root / "mistral", "mistral", seed=5, vocab_size=300, sliding_window=6),
        "draft": make_hf_checkpoint(root / "draft", "qwen2", seed=4, vocab_size=300, num_layers=1),
    }


DEVICES = ["fake-cuda", pytest.param("cuda", marks=GPU)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_engine_keeps_its_tensors_on_the_model_device(paths, case, device):
    family, overrides, dtype = CASES[case]
    fake = FakeCuda() if device == "fake-cuda" else RealCuda()
    model = fake.put(load_model(paths[family]).to(dtype).eval())
    draft = fake.put(load_model(paths["draft"]).to(dtype).eval()) if overrides.get("speculative") == "draft" else None
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    with fake:
        engine = LLMEngine(model, config=EngineConfig(**{**BASE, **overrides}), draft_model=draft)
        assert engine.runner.device.type == "cuda" and engine.runner.decode_kernel is None
        assert len(engine.runner.packed) == 0 and not engine.is_batch_invariant
        assert on_device(engine.runner.cache.k)
        # The decode copies are allocated at their cap from the start, as the pool is.
        num_layers, _, _, num_kv_heads, head_dim = engine.runner.cache.v.shape
        decode_kv = engine.runner.decode_kv
        cap_numel = decode_kv.max_tokens * num_layers * num_kv_heads * head_dim
        assert on_device(decode_kv._storage["k"]) and decode_kv._storage["v"].numel() == cap_numel
        first = engine.generate(PROMPTS, MIXED)
        # The asynchronous loop's use: requests in flight across weight updates, from host tensors
        # (the trainer's shared buffers) and from device tensors.
        for prompt, params in zip(PROMPTS, MIXED):
            engine.add_request(prompt, params)
        for _ in range(3):
            engine.step()
        host_state = {name: fake.to_host(t) for name, t in state.items()}
        engine.update_weights(host_state, 1)
        for _ in range(3):
            engine.step()
        engine.update_weights(state, 2)
        while engine.has_unfinished():
            engine.step()
        with torch.no_grad():  # a change outside update_weights (an optimizer step on the model)
            next(iter(model.parameters())).mul_(1.0)
        engine.generate(PROMPTS[:2], MIXED[:2])
        # Non-finite KV: the pool is scrubbed and the requests fail alone.
        broken = dict(state)
        name = next(n for n in broken if n.endswith("layers.0.self_attn.k_proj.weight"))
        broken[name] = torch.full_like(state[name], float("inf"))
        assert {c.finish_reason for c in engine.generate(PROMPTS[:2], MIXED[:2])} <= {"length", "stop"}
        engine.update_weights(broken, 3)
        assert {c.finish_reason for c in engine.generate(PROMPTS[:2], MIXED[:2])} == {"error"}
        engine.update_weights(state, 4)
        last = engine.generate(PROMPTS, MIXED)
    assert fake.errors == {}, "\n".join(fake.errors)
    assert [c.finish_reason for c in first] == [c.finish_reason for c in last] != []
    greedy = [c.token_ids for c in first if c.prompt_index == 1]
    assert greedy == [c.token_ids for c in last if c.prompt_index == 1]  # the same weights again
    if dtype == torch.float32:  # the GPU paths compute what a full forward does (SDPA decode, layered fills)
        hf = AutoModelForCausalLM.from_pretrained(paths[family], attn_implementation="eager").float().eval()
        for completion in first:
            expected = full_forward_logprobs(hf, completion, MIXED[completion.prompt_index])
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0.0), case


@on_gpu
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_greedy_matches_transformers_generate_on_cuda(paths, family):
    """The issue's parity check on a real GPU: transformers on the same device, fp32."""
    hf = AutoModelForCausalLM.from_pretrained(paths[family], attn_implementation="sdpa").float().to("cuda").eval()
    hf.generation_config.eos_token_id = None  # no stop: generate fills a None eos_token_id in from it
    engine = LLMEngine(load_model(paths[family]).to("cuda").eval(), config=EngineConfig(**BASE))
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    for prompt, completion in zip(PROMPTS, engine.generate(PROMPTS, params)):
        expected = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=12,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert completion.token_ids == expected
        reference = full_forward_logprobs(hf, completion, params)
        assert torch.allclose(torch.tensor(completion.logprobs), reference, atol=1e-4, rtol=0.0)


def test_a_decode_step_waits_for_the_device_a_fixed_few_times(paths):
    """On a GPU each read of a device value on the host, and each copy from (pageable) host memory,
    waits for the device. A decode step of one sampling setting (plain or filtered) with no block
    copies and no decode-copy refill does a fixed few, however many rows decode:
    its integers go over in one copy for the step and one per attention group, the sampling draws in
    one, and the weights check, the sampled tokens with their log-probs and the finite check come
    back in one read each. A read per row (an ``.item()`` in a loop) would cost a GPU a sync per row."""
    cases = [(1, SamplingParams(temperature=1.0, max_new_tokens=40, seed=1, n=2)),
             (8, SamplingParams(temperature=1.0, max_new_tokens=40, seed=1, n=4)),
             (8, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=40, seed=1, n=4))]
    per_step = []
    for num_prompts, params in cases:
        fake = FakeCuda()
        model = fake.put(load_model(paths["qwen2"]).eval())
        with fake:
            config = EngineConfig(**{**BASE, "max_num_seqs": 64, "max_num_batched_tokens": 256})
            engine = LLMEngine(model, config=config)
            for i in range(num_prompts):
                engine.add_request([5 + i, 6, 7, 8, 9, 10, 5, 6, 7, 8], params)
            for _ in range(4):  # the prefill, the forks, the decode copies' first fill
                engine.step()
            for _ in range(5):  # decode steps between the decode copies' growths (at 12 and 24 tokens)
                fake.transfers.clear()
                engine.step()
                counts = {"to_device": 0, "to_host": 0}
                for (direction, _), count in fake.transfers.items():
                    counts[direction] += count
                per_step.append((counts, dict(fake.transfers)))
        assert fake.errors == {}, "\n".join(fake.errors)
        assert len(engine.scheduler.running) == num_prompts * params.n  # every row decoded throughout
    for counts, where in per_step:
        assert counts == {"to_device": 4, "to_host": 3}, where


def test_the_tracer_sees_a_cpu_tensor_meet_a_device_one():
    # The check itself: the mistakes the engine test looks for are recorded, not missed.
    fake, is_available = FakeCuda(), torch.cuda.is_available
    with fake:
        on_gpu = torch.ones(4, device="cuda")
        assert on_gpu.device.type == "cuda" and on_device(on_gpu + 1)
        on_gpu + torch.ones(4)  # noqa: B018
        on_gpu[torch.tensor([0, 1])] = torch.zeros(2)  # CPU values into a device tensor
        torch.ones(4)[torch.tensor([1], device="cuda")]  # noqa: B018
        on_gpu[:2] * on_gpu.cpu()[:2]  # noqa: B018
        on_gpu * torch.tensor(2.0)  # noqa: B018  (a 0-dim CPU tensor is a scalar to a pointwise op: fine)
        torch.stack([on_gpu.sum(), torch.tensor(1.0)])  # but not to others
        torch.rand(3, device="cuda", generator=torch.Generator().manual_seed(0))
    problems = list(fake.errors.values())
    assert len(problems) == 6, problems
    assert "mixed with CPU tensors" in problems[0] and "values on another device" in problems[1]
    assert "CPU tensor indexed by CUDA indices" in problems[2] and "aten.mul: CUDA tensors mixed" in problems[3]
    assert "aten.stack: CUDA tensors mixed with CPU tensors of shapes [()]" in problems[4]
    assert "a CUDA tensor drawn from a CPU generator" in problems[5]
    assert torch.cuda.is_available is is_available  # torch.cuda is itself again
