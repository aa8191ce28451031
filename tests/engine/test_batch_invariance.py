"""Batch invariance (``engine.batch_invariant``): a request's tokens and log-probs are the same bits
however the engine schedules it -- alone or among others, its prompt in one prefill chunk or many,
from the prefix cache or recomputed after a preemption, plainly or in speculative spans.

Log-probs are compared bit for bit, which shows any difference in the logits: without invariance
(``batch_invariant: false``) every comparison below fails, by 5e-7 to 1e-6. A difference that size
flips a sampled token when a uniform lands within it of a CDF boundary: 3 in 32 seeded samples of 64
tokens on the benchmark's random 32k-vocabulary model.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.hf_tiny import make_hf_checkpoint
from tether.engine import Completion, EngineConfig, LLMEngine, SamplingParams
from tether.errors import ConfigError
from tether.models import load_model

VOCAB = 4096
NUM_PROMPTS = 8
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def model(request, tmp_path_factory):
    # mistral: windowed prefill rows; qwen2: an MLP width whose SiLU has a scalar tail in torch's kernel
    extra = {"sliding_window": 24} if request.param == "mistral" else {"intermediate_size": 100}
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, vocab_size=VOCAB, seed=11,
                              with_tokenizer=False, **extra)
    return load_model(path)


@pytest.fixture(scope="module")
def alone(model) -> list[Completion]:
    """Each seeded request of ``_sampled`` generated on its own: what every schedule must reproduce."""
    return _alone(_engine(model), _prompts(), _sampled())


def _engine(model, **overrides) -> LLMEngine:
    config = {"block_size": 8, "num_kv_blocks": 400, "max_num_batched_tokens": 512, "max_model_len": 160,
              "batch_invariant": True, **overrides}
    engine = LLMEngine(model, config=EngineConfig(**config))
    assert engine.is_batch_invariant
    return engine


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(20, 70))] for _ in range(NUM_PROMPTS)]
    return [p + p[:12] for p in prompts]  # a repeat for prompt lookup to find


def _sampled() -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, top_p=0.9 if i % 3 == 0 else 1.0, top_k=40 if i % 4 == 1 else 0,
                           max_new_tokens=MAX_NEW_TOKENS, seed=100 + i) for i in range(NUM_PROMPTS)]


def _alone(engine: LLMEngine, prompts, params) -> list[Completion]:
    return [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]


def _assert_same_bits(got: list[Completion], want: list[Completion]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.token_ids == b.token_ids, f"request {i}: tokens differ"
        assert a.logprobs == b.logprobs, f"request {i}: log-probs differ (max {max_diff(a, b):.3g})"


def max_diff(a: Completion, b: Completion) -> float:
    return max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # all prompts in one step, decoded together
        {"max_num_batched_tokens": 37},  # prompts cut into chunks at odd places, mixed with decodes
        {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
        {"num_kv_blocks": 40},  # the pool holds a few sequences: preemption and recompute
    ],
    ids=["batch", "chunked", "no-prefix-cache", "preemption"],
)
def test_seeded_samples_are_the_same_bits_in_any_schedule(model, alone, overrides):
    engine = _engine(model, **overrides)
    _assert_same_bits(engine.generate(_prompts(), _sampled()), alone)
    if "num_kv_blocks" in overrides:
        assert engine.stats.num_preemptions > 0


def test_a_group_samples_the_same_bits_among_other_requests(model):
    """n samples of one prompt (a GRPO group, its prompt prefilled once) alone, and beside other groups
    whose prompts share the steps' chunks."""
    prompts = _prompts()
    group = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, n=6, seed=9)
    alone = _engine(model).generate([prompts[0]], group)
    crowd = _engine(model, max_num_batched_tokens=29).generate(
        [prompts[1], prompts[0], prompts[2]],
        [SamplingParams(temperature=0.7, max_new_tokens=9, seed=1), group,
         SamplingParams(temperature=1.0, max_new_tokens=5, n=3, seed=2)],
    )
    _assert_same_bits(crowd[1:7], alone)


def test_speculative_greedy_is_plain_greedy_bit_for_bit(model):
    prompts = _prompts()
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)] * NUM_PROMPTS
    plain = _alone(_engine(model), prompts, greedy)
    speculative = _engine(model, speculative="ngram", num_speculative_tokens=3)
    _assert_same_bits(speculative.generate(prompts, greedy), plain)
    assert speculative.stats.num_accepted_tokens > 0  # some spans were verified, not only decoded


def test_speculative_samples_are_the_same_bits_in_any_batch(model, alone):
    """Prompt lookup's coupled test samples what plain decoding samples: the same bits again."""
    engine = _engine(model, speculative="ngram", max_num_batched_tokens=45)
    _assert_same_bits(engine.generate(_prompts(), _sampled()), alone)
    assert engine.stats.num_draft_tokens > 0  # spans were verified (a random model accepts few drafts)


def test_draft_model_samples_are_the_same_bits_in_any_batch(model, tmp_path):
    """A draft model's proposals depend on its own forward, invariant too: rejection sampling then
    accepts and resamples the same tokens whatever the batch and the drafts the budget allowed."""
    draft = load_model(make_hf_checkpoint(tmp_path / "draft", "qwen2", vocab_size=VOCAB, seed=12, num_layers=1,
                                          hidden_size=32, with_tokenizer=False))

    def engine(**overrides) -> LLMEngine:
        config = EngineConfig(block_size=8, num_kv_blocks=400, max_model_len=160, speculative="draft",
                              batch_invariant=True, **overrides)
        return LLMEngine(model, config=config, draft_model=draft)

    assert engine().is_batch_invariant  # the draft runner too
    prompts, params = _prompts(), _sampled()
    alone = _alone(engine(), prompts, params)
    batched = engine(max_num_batched_tokens=45)
    _assert_same_bits(batched.generate(prompts, params), alone)
    assert batched.stats.num_accepted_tokens > 0


def test_a_wide_mlp_is_invariant_when_a_sequence_decodes_alone(tmp_path):
    """An MLP of 1536 (the engine benchmark's): oneDNN multiplied one row (a sequence decoding alone,
    the last of a batch) by a kernel whose sums over 1536 inputs round otherwise than with company, so
    invariance turned itself off on such CPUs (Zen 4); a lone row now takes the batch's kernel."""
    path = make_hf_checkpoint(tmp_path / "wide", "qwen2", vocab_size=VOCAB, seed=13, intermediate_size=1536,
                              with_tokenizer=False)
    model = load_model(path)
    prompts, params = _prompts()[:3], _sampled()[:3]
    alone = _alone(_engine(model), prompts, params)
    _assert_same_bits(_engine(model, max_num_batched_tokens=37).generate(prompts, params), alone)


def test_an_engine_without_invariance_on_the_same_model_leaves_it_invariant(model, alone):
    """Per-engine choices (which rows a packed linear serves, the SiLU) are installed for each step by
    the engine that serves it, not left on the shared modules by the last engine built."""
    invariant = _engine(model)
    LLMEngine(model, config=EngineConfig(num_kv_blocks=64, batch_invariant=False)).generate(
        [_prompts()[0]], SamplingParams(max_new_tokens=3))
    _assert_same_bits(invariant.generate(_prompts(), _sampled()), alone)


def test_batch_invariant_true_is_an_error_where_it_cannot_hold(model):
    with pytest.raises(ConfigError, match="engine.batch_invariant: true needs an fp32 model on the CPU"):
        LLMEngine(model, config=EngineConfig(num_kv_blocks=64, batch_invariant=True, cpu_native_attention=False))
    auto = LLMEngine(model, config=EngineConfig(num_kv_blocks=64, cpu_native_attention=False))
    assert not auto.is_batch_invariant  # "auto" runs without it, as before
    assert LLMEngine(model, config=EngineConfig(num_kv_blocks=64)).is_batch_invariant
    with pytest.raises(ConfigError, match="engine.batch_invariant must be true, false or auto, got 'yes'"):
        EngineConfig(batch_invariant="yes")


def test_a_kernel_whose_query_blocks_differ_turns_invariance_off(model, monkeypatch):
    """The engine checks at start that the compiled kernel gives a prefill chunk's query rows the bits
    they get alone (true by construction; the check guards the compiler's part). Where it fails:
    "auto" warns and runs without invariance, true is a one-line error."""
    from tether.engine import native, runner

    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    assert native.are_query_rows_invariant(native.decode_attention_kernel(), groups, model.config.head_dim)
    monkeypatch.setattr(runner, "are_query_rows_invariant", lambda *args: False)
    with pytest.warns(RuntimeWarning, match="batch invariance is off: the compiled attention kernel gives"):
        assert not LLMEngine(model, config=EngineConfig(num_kv_blocks=64)).is_batch_invariant
    with pytest.raises(ConfigError, match="batch_invariant: true is unavailable: the compiled attention kernel"):
        LLMEngine(model, config=EngineConfig(num_kv_blocks=64, batch_invariant=True))


def test_bf16_runs_without_batch_invariance(tmp_path):
    path = make_hf_checkpoint(tmp_path / "m", "qwen2", seed=1, with_tokenizer=False)
    bf16 = load_model(path).to(torch.bfloat16)
    assert not LLMEngine(bf16, config=EngineConfig(num_kv_blocks=64)).is_batch_invariant
    with pytest.raises(ConfigError, match="engine.batch_invariant: true needs an fp32 model on the CPU"):
        LLMEngine(bf16, config=EngineConfig(num_kv_blocks=64, batch_invariant=True))
