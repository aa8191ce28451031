"""Speculative decoding: exact greedy output, the target's distribution and log-probs, under any scheduling."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.hf_tiny import make_hf_checkpoint
from helpers.reference import assert_same_completions, full_forward_logprobs
from tether.engine import Completion, EngineConfig, LLMEngine, SamplingParams
from tether.engine.proposers import NgramProposer, Proposal, ngram_lookup
from tether.engine.rng import SampleRNG, draw_uniforms
from tether.engine.sampler import Sampler, _sample_general, inverse_cdf
from tether.engine.sequence import Sequence
from tether.engine.speculative import accept_coupled, accept_drafts, accept_greedy, verify
from tether.errors import ConfigError
from tether.models import load_model

# Repetitive prompts give prompt lookup something to find; lengths differ so spans differ.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [20, 21, 22], list(range(30, 43)) + [30, 31], [44]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
SAMPLED = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, max_new_tokens=10, seed=1234, n=2)
# Upper 0.1% points of the chi-square distribution, by degrees of freedom (scipy is not installed).
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
                       9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": make_hf_checkpoint(root / "target", "qwen2", seed=3),
        "draft": make_hf_checkpoint(root / "draft", "qwen2", seed=5, num_layers=1, hidden_size=32),
        "tiny_target": make_hf_checkpoint(root / "tt", "llama", vocab_size=10, hidden_size=32, seed=11,
                                          with_tokenizer=False),
        "tiny_draft": make_hf_checkpoint(root / "td", "llama", vocab_size=10, hidden_size=32, seed=12,
                                         num_layers=1, with_tokenizer=False),
    }  # fmt: skip


@pytest.fixture(scope="module")
def hf(paths):
    return AutoModelForCausalLM.from_pretrained(paths["target"], attn_implementation="eager").float().eval()


@pytest.fixture(scope="module")
def plain_greedy(paths) -> list[Completion]:
    """Non-speculative greedy completions of PROMPTS, 20 tokens, two samples each."""
    return make_engine(paths["target"]).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20, n=2))


@pytest.fixture(scope="module")
def hf_greedy(hf) -> list[list[int]]:
    """transformers' own greedy continuations of PROMPTS, 16 tokens."""
    return [
        hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]


def make_engine(path, speculative=None, draft_path=None, **overrides) -> LLMEngine:
    config = EngineConfig(
        **{"num_kv_blocks": 128, "block_size": 4, "speculative": speculative, "num_speculative_tokens": 3,
           **overrides}
    )  # fmt: skip
    draft = load_model(draft_path) if draft_path is not None else None
    return LLMEngine(load_model(path), config=config, draft_model=draft)


# Three proposers: prompt lookup; a different (weaker) draft model, mostly rejected; the target as its
# own draft, always accepted for greedy (exercises the bonus token).
PROPOSERS = {"ngram": ("ngram", None), "draft": ("draft", "draft"), "self-draft": ("draft", "target")}


def spec_engine(paths, proposer: str, path_key: str = "target", **overrides) -> LLMEngine:
    method, draft_key = PROPOSERS[proposer]
    draft_path = paths[draft_key] if draft_key is not None else None
    return make_engine(paths[path_key], method, draft_path, **overrides)


# ---------------------------------------------------------------------------- proposers


def test_ngram_lookup_finds_the_most_recent_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # last 2 tokens (2, 3) occur at 1..2 (then 9) and 5..6 (then 4, 5, 7): the most recent wins.
    assert ngram_lookup(tokens, n_max=4, n_min=1, num_tokens=3) == [4, 5, 7]
    assert ngram_lookup([1, 2, 3, 1, 2, 4, 2], n_max=3, n_min=1, num_tokens=2) == [4, 2]  # only n=1 hits
    assert ngram_lookup([1, 2, 3, 4], n_max=3, n_min=1, num_tokens=2) == []
    assert ngram_lookup([5, 5, 5], n_max=2, n_min=2, num_tokens=4) == [5]  # the follower may be the tail
    assert ngram_lookup([3, 1, 3, 2], n_max=2, n_min=2, num_tokens=4) == []  # n_min respected


def test_ngram_proposer_caps_at_the_slots_given():
    from tether.engine.sequence import Sequence

    seq = Sequence(0, 0, 0, [1, 2, 3, 4, 1, 2], 6, GREEDY, frozenset(), SampleRNG(0))
    proposals = NgramProposer(n_max=3, n_min=1, num_tokens=4).propose([seq, seq], [4, 1], [])
    assert [p.token_ids for p in proposals] == [[3, 4, 1, 2], [3]] and proposals[0].draft_probs is None


def test_config_checks():
    with pytest.raises(ConfigError, match="engine.speculative must be one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ConfigError, match="num_speculative_tokens must be >= 1"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="ngram_min"):
        EngineConfig(speculative="ngram", ngram_min=3, ngram_max=2)


def test_draft_model_must_match(paths):
    with pytest.raises(ConfigError, match="needs a draft model"):
        make_engine(paths["target"], "draft")
    with pytest.raises(ConfigError, match="set it to 'draft'"):
        make_engine(paths["target"], None, paths["draft"])
    with pytest.raises(ConfigError, match="vocab_size 10 differs"):
        make_engine(paths["target"], "draft", paths["tiny_draft"])
    # A draft on another device than the target (a CPU draft for a CUDA target) is refused up front,
    # not a device mismatch inside the first sampled step.
    config = EngineConfig(num_kv_blocks=128, block_size=4, speculative="draft")
    with pytest.raises(ConfigError, match="draft model is on meta but the target model on cpu"):
        LLMEngine(load_model(paths["target"]), config=config, draft_model=load_model(paths["draft"]).to("meta"))


# ---------------------------------------------------------------------------- the acceptance test


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of integer ``samples`` against ``probs`` [V]; cells expecting < 5 are pooled."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    is_small = expected < 5
    if is_small.any():
        counts = torch.cat([counts[~is_small], counts[is_small].sum()[None]])
        expected = torch.cat([expected[~is_small], expected[is_small].sum()[None]])
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return statistic, int(keep.sum()) - 1


def assert_distributed_as(samples: torch.Tensor, probs: torch.Tensor) -> None:
    statistic, dof = chi_square(samples, probs)
    assert statistic < CHI2_CRITICAL_0_001[dof], f"chi2={statistic:.1f} with {dof} dof"


@pytest.mark.parametrize("kind", ["draft-q", "draft-q-tail", "ngram-point-mass"])
def test_accepted_tokens_follow_the_target_distribution(kind):
    num_samples, vocab_size, k = 20_000, 8, 2
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(k + 1, vocab_size, generator=gen) * 1.5, dim=-1)  # [K + 1, V]
    q = torch.softmax(torch.randn(k + 1, vocab_size, generator=gen) * 1.5, dim=-1)  # [K + 1, V], q_K: the tail's
    p[0, 3] = 0.0  # a token the target never emits (top-k filtered), even if drafted
    p = p / p.sum(-1, keepdim=True)
    logprobs, num_drafts = p.log().expand(num_samples, k + 1, vocab_size), torch.full((num_samples,), k)
    is_greedy, uniforms = torch.zeros(num_samples, dtype=torch.bool), torch.rand(num_samples, k + 1, 2, generator=gen)
    if kind == "ngram-point-mass":  # prompt lookup: always the same draft tokens, the coupled test
        draft_ids = torch.tensor([[2, 5]]).expand(num_samples, k)
        plain_ids = inverse_cdf(p.repeat(num_samples, 1), uniforms[..., 0].reshape(-1)).view(num_samples, k + 1)
        verdict = accept_coupled(draft_ids, num_drafts, plain_ids, logprobs.gather(-1, plain_ids[..., None])[..., 0])
    else:  # each row drafts its own tokens from q; the last column is a tail (tested, never fed) or padding
        draft_ids = torch.stack([torch.multinomial(q[i], num_samples, True, generator=gen) for i in range(k + 1)], 1)
        has_tail = torch.full((num_samples,), kind == "draft-q-tail")
        verdict = accept_drafts(logprobs, draft_ids, num_drafts, q.expand(num_samples, k + 1, vocab_size), is_greedy,
                                uniforms, has_tail)
    first = verdict.token_ids[:, 0]
    assert_distributed_as(first, p[0])
    # The next token, given the previous was an accepted draft, follows the target at its position
    # (which in this test does not depend on the drafts): token 1 after d_1, token 2 after d_2, the
    # bonus draw or, with a tail, the tail or the residual.
    for position in (1,) if kind == "ngram-point-mass" else (1, 2):  # both fixed drafts pass too rarely
        is_reached = verdict.num_accepted >= position
        assert is_reached.sum() > 1000
        assert_distributed_as(verdict.token_ids[is_reached, position], p[position])
    # A naive "always accept" would put all mass on the drafts: make sure rejections happened.
    assert 0 < (verdict.num_accepted == 0).float().mean() < 1
    assert torch.allclose(verdict.logprobs[:, 0], p[0].log()[first])
    if kind == "draft-q-tail":  # the tail stands as the last token as often as the test passes it
        is_all = verdict.num_accepted == k
        kept = (verdict.token_ids[is_all, k] == draft_ids[is_all, k]).float()
        rate = torch.minimum(p[k], q[k]).sum().item()  # the rejection test's acceptance, sum min(p, q)
        assert abs(kept.mean().item() - rate) < 4 * (rate * (1 - rate) / kept.numel()) ** 0.5


def test_prompt_lookup_draws_each_token_as_a_plain_step_does():
    """The coupled test emits, at each position, the token a plain step would sample with the same
    uniform, by the same sampling path: at a 32k vocabulary the plain (unfiltered) path and the
    general one round their CDFs differently and disagree on ~1 draw in 1,600, and a verifier on
    the general path made a seeded sample depend on whether prompt lookup found a draft."""
    vocab_size, num_rows = 32000, 64
    params = SamplingParams(temperature=1.0)  # the RL default: the plain path
    for trial in range(100):
        logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(trial)) * 3
        seeds = range(trial * num_rows, (trial + 1) * num_rows)
        plain = Sampler().sample(logits.clone(), [params] * num_rows, [SampleRNG(s) for s in seeds]).token_ids
        general = _sample_general(logits.clone(), [params] * num_rows,
                                  draw_uniforms([SampleRNG(s) for s in seeds])[:, 0]).token_ids
        seqs = [Sequence(i, i, 0, [5], 1, params, frozenset(), SampleRNG(s)) for i, s in enumerate(seeds)]
        drafts = [Proposal([(token + 1) % vocab_size]) for token in plain]  # rejected: column 0 is the draw
        verdict = verify(torch.stack([logits, logits], dim=1).view(2 * num_rows, vocab_size), seqs, drafts)
        assert verdict.token_ids[:, 0].tolist() == plain
        if plain != general:
            break
    else:
        pytest.fail("no draw where the plain and general paths disagree: the test has no data")


def test_greedy_acceptance_is_argmax_match():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]]] * 3)  # [3, K + 1 = 3, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    draft_ids = torch.tensor([[1, 0], [1, 2], [2, 0]])  # all right; second wrong; first wrong
    best = logprobs.argmax(dim=-1)
    verdict = accept_coupled(draft_ids, torch.tensor([2, 2, 2]), best, logprobs.gather(-1, best[..., None])[..., 0])
    assert verdict.num_accepted.tolist() == [2, 1, 0]
    assert [row[: n + 1] for row, n in zip(verdict.token_ids.tolist(), verdict.num_accepted.tolist())] == [
        [1, 0, 2],  # bonus token argmax p_2
        [1, 0],  # argmax p_1 replaces the wrong draft
        [1],
    ]
    fast = accept_greedy(logprobs, draft_ids, torch.tensor([2, 2, 2]))  # the all-greedy fast path
    assert fast.num_accepted.tolist() == verdict.num_accepted.tolist()
    for row, n in enumerate(verdict.num_accepted.tolist()):
        assert fast.token_ids[row, : n + 1].tolist() == verdict.token_ids[row, : n + 1].tolist()


def test_greedy_rows_verified_beside_sampled_rows_take_the_log_prob_argmax():
    """Logits one float step apart: exp rounds both to one probability, the log-probs still differ.
    A greedy row of a draft-model verification picks what plain greedy decoding picks."""
    logits = torch.tensor([0.6995997428894043, 0.6995998024940491, -0.7301396727561951, -0.150410458445549])
    plain = Sampler().sample(logits[None].clone(), [SamplingParams(temperature=0.0)], [SampleRNG(0)])
    logprobs = torch.log_softmax(logits, dim=-1)[None, None].expand(2, 2, 4).clone()  # [greedy, sampled], K=1
    verdict = accept_drafts(logprobs, torch.tensor([[3, 0], [3, 0]]), torch.tensor([1, 1]),
                            torch.full((2, 2, 4), 0.25), torch.tensor([True, False]),
                            torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(0)),
                            torch.tensor([False, True]))
    assert plain.token_ids == [1]
    assert verdict.num_accepted[0] == 0 and verdict.token_ids[0, 0] == 1


# ---------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_is_identical_to_plain_and_transformers(paths, hf, hf_greedy, plain_greedy, proposer):
    engine = spec_engine(paths, proposer, max_num_batched_tokens=10)  # drafts share the budget with chunks
    completions = engine.generate(PROMPTS, GREEDY)
    for got, expected, reference in zip(completions, plain_greedy[::2], hf_greedy):
        assert got.token_ids == expected.token_ids[:16] and got.finish_reason == "length"
        assert got.token_ids == reference
        assert torch.allclose(torch.tensor(got.logprobs), full_forward_logprobs(hf, got, GREEDY), atol=1e-4)
        assert got.versions == [0] * 16
    stats = engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert stats.num_generated_tokens == 16 * len(PROMPTS)
    if proposer == "self-draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.num_steps < 16  # several tokens per step
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_sampled_logprobs_equal_a_full_forward(paths, hf, proposer):
    engine = spec_engine(paths, proposer)
    completions = engine.generate(PROMPTS, SAMPLED)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [(i, j) for i in range(4) for j in range(2)]
    for completion in completions:
        assert completion.num_tokens == 10 and completion.versions == [0] * 10
        reference = full_forward_logprobs(hf, completion, SAMPLED)
        assert torch.allclose(torch.tensor(completion.logprobs), reference, atol=1e-4)
    assert engine.stats.num_draft_tokens > 0
    again = spec_engine(paths, proposer).generate(PROMPTS, SAMPLED)  # per-request seeds: reproducible
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]


@pytest.mark.parametrize(
    "overrides",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 3},  # chunked prompts; lookahead capped by the budget
        {"num_kv_blocks": 10, "block_size": 4},  # tiny pool: preemption and recompute
    ],
    ids=["no-prefix-cache", "tiny-budget", "preemption"],
)
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_does_not_depend_on_scheduling(paths, plain_greedy, proposer, overrides):
    params = SamplingParams(temperature=0.0, max_new_tokens=20, n=2)
    engine = spec_engine(paths, proposer, **overrides)
    completions = engine.generate(PROMPTS, params)
    assert_same_completions(completions, plain_greedy)
    if "num_kv_blocks" in overrides:
        assert engine.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("proposer", ["ngram", "self-draft"])
def test_prefix_cache_hits_with_speculation(paths, proposer):
    engine = spec_engine(paths, proposer)
    prompt = list(range(3, 25)) + list(range(3, 9))
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt + [50]], GREEDY)[0]
    assert engine.stats.num_prefix_hit_tokens >= 24
    fresh = make_engine(paths["target"]).generate([prompt + [50]], GREEDY)[0]
    assert second.token_ids == fresh.token_ids
    assert second.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)
    # The first request's blocks, committed only up to accepted tokens, serve a continuation.
    continued = engine.generate([prompt + first.token_ids[:8]], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert continued[0].token_ids == first.token_ids[8:]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_stop_token_and_length_inside_an_accepted_span(paths, plain_greedy, proposer):
    tokens = plain_greedy[0].token_ids[:16]
    stop_at = tokens[5]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop_at,))
    stopped = spec_engine(paths, proposer).generate([PROMPTS[0]], params)[0]
    assert stopped.token_ids == tokens[: tokens.index(stop_at) + 1] and stopped.finish_reason == "stop"
    for max_new in (1, 2, 5):
        short = spec_engine(paths, proposer).generate(
            [PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=max_new)
        )[0]
        assert short.token_ids == tokens[:max_new] and short.finish_reason == "length"
    capped = spec_engine(paths, proposer, max_model_len=len(PROMPTS[0]) + 7).generate([PROMPTS[0]], GREEDY)[0]
    assert capped.token_ids == tokens[:7] and capped.finish_reason == "length"


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_engine_samples_follow_the_target_distribution(paths, proposer):
    """Tokens 1-3 of 2000 seeded samples (where drafts are verified) against the exact marginals."""
    num_samples, prompt = 2000, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    params = SamplingParams(temperature=1.0, max_new_tokens=3, n=num_samples, seed=0)
    draft_path = paths["tiny_draft"] if proposer == "draft" else None
    engine = make_engine(
        paths["tiny_target"], proposer, draft_path, num_speculative_tokens=2, max_num_seqs=num_samples,
        num_kv_blocks=4 * num_samples, max_num_batched_tokens=4 * num_samples,
    )  # fmt: skip
    completions = engine.generate([prompt], params)
    assert engine.stats.num_accepted_tokens > 100 and engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    samples = torch.tensor([c.token_ids for c in completions])  # [N, 3]
    hf = AutoModelForCausalLM.from_pretrained(paths["tiny_target"], attn_implementation="eager").float().eval()
    vocab_size = 10
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)  # [V]
        firsts = torch.tensor([prompt + [t] for t in range(vocab_size)])
        p2 = torch.softmax(hf(firsts).logits[:, -1], -1)  # [V, V] p(t2 | t1)
        pairs = torch.tensor([prompt + [a, b] for a in range(vocab_size) for b in range(vocab_size)])
        p3 = torch.softmax(hf(pairs).logits[:, -1], -1).view(vocab_size, vocab_size, vocab_size)
    marginal2 = p1 @ p2  # [V]
    marginal3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    assert_distributed_as(samples[:, 0], p1)
    assert_distributed_as(samples[:, 1], marginal2)
    assert_distributed_as(samples[:, 2], marginal3)


def test_same_seed_same_sample_in_any_batch(paths, plain_greedy):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=99)
    alone = spec_engine(paths, "ngram").generate([PROMPTS[0]], params)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=9)  # greedy and sampled rows verified together
    batch = spec_engine(paths, "ngram").generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [greedy, params, greedy])
    assert batch[1].token_ids == alone.token_ids
    assert batch[0].token_ids == plain_greedy[4].token_ids[:9] and batch[2].token_ids == plain_greedy[2].token_ids[:9]


def test_prompt_lookup_samples_what_plain_decoding_samples_whatever_the_drafts(paths):
    # The coupled test draws each emitted token as a plain step would, one uniform per token: the same
    # seeded samples with prompt lookup as without, and with drafts cut short by a small step budget
    # next to another group (with the rejection test, every draft count shifted the random stream).
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=99)
    prompts = [PROMPTS[0], PROMPTS[2]]
    plain = make_engine(paths["target"]).generate(prompts, params)
    roomy = spec_engine(paths, "ngram")
    assert [c.token_ids for c in roomy.generate(prompts, params)] == [c.token_ids for c in plain]
    other = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5, n=3)
    tight = spec_engine(paths, "ngram", max_num_batched_tokens=6)
    crowded = tight.generate([PROMPTS[1], *prompts], [other, params, params])[other.n:]
    assert [c.token_ids for c in crowded] == [c.token_ids for c in plain]
    assert roomy.stats.num_draft_tokens > 0 and tight.stats.num_draft_tokens != roomy.stats.num_draft_tokens


@pytest.mark.parametrize("proposer", ["draft", "self-draft"])
def test_draft_model_samples_depend_on_the_seed_not_on_the_drafts_or_the_batch(paths, proposer):
    # Every token of a sampled row passes the rejection test, its draws keyed by (seed, output
    # position): the same seeded samples with 1 or 3 drafts a step, with prompts chunked and drafts
    # cut short by a small step budget next to another group and a greedy row, and when sequences
    # are preempted and recomputed (before tails, each draft count shifted the random stream).
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=99, n=2)
    prompts = [PROMPTS[0], PROMPTS[2]]
    roomy = spec_engine(paths, proposer)
    reference = [c.token_ids for c in roomy.generate(prompts, params)]
    one = spec_engine(paths, proposer, num_speculative_tokens=1)
    assert [c.token_ids for c in one.generate(prompts, params)] == reference
    other = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5, n=3)
    tight = spec_engine(paths, proposer, max_num_batched_tokens=6)
    crowded = tight.generate([PROMPTS[1], *prompts, PROMPTS[3]], [other, params, params, GREEDY])
    assert [c.token_ids for c in crowded[other.n : -1]] == reference
    preempting = spec_engine(paths, proposer, num_kv_blocks=12)
    assert [c.token_ids for c in preempting.generate(prompts, params)] == reference
    assert preempting.stats.num_preemptions > 0
    draft_counts = {e.stats.num_draft_tokens for e in (roomy, one, tight, preempting)}
    assert len(draft_counts) == 4 and 0 not in draft_counts


def test_plain_steps_of_a_draft_model_engine_spend_no_draw_of_its_acceptance_tests(paths):
    """A draft that overflows on a context stops drafting for it: that sample's later tokens are plain
    steps. They draw by output position (the draw a bonus token at that position would take), never
    the stream's counter draws 0, 1, 2, ..., which are the draws that decided its earlier tokens."""
    models = {key: load_model(paths[key]) for key in ("target", "draft")}
    with torch.no_grad():
        models["draft"].model.embed_tokens.weight[99] = float("inf")
    config = EngineConfig(num_kv_blocks=32, block_size=4, speculative="draft", num_speculative_tokens=3)
    engine = LLMEngine(models["target"], config=config, draft_model=models["draft"])
    request_id = engine.add_request([5, 6, 99, 7, 8], SamplingParams(temperature=1.0, max_new_tokens=6, seed=2, n=2))
    seqs = list(engine._requests[request_id])
    completions = []
    while engine.has_unfinished():
        completions.extend(engine.step())
    assert [len(c.token_ids) for c in completions] == [6, 6]
    assert all(seq.is_draft_off for seq in seqs) and engine.stats.num_draft_tokens == 0
    assert [seq.rng.num_draws for seq in seqs] == [0, 0]


@pytest.mark.parametrize("overflowing", [("target", "draft"), ("draft",)])
def test_a_draft_model_that_overflows_leaves_no_trace(paths, overflowing):
    """Weights that overflow on token 99 (its embedding inf) in the draft model, and the target too:
    a seeded request after the prompt holding it samples exactly as on a fresh engine. The draft
    pool's NaN slots are zeroed like the target's, and a draft that overflows on a context stops
    drafting for it (plain steps), so NaN draft distributions never reach the acceptance test."""

    def engine() -> LLMEngine:
        models = {key: load_model(paths[key]) for key in ("target", "draft")}
        with torch.no_grad():
            for key in overflowing:
                models[key].model.embed_tokens.weight[99] = float("inf")
        config = EngineConfig(num_kv_blocks=6, block_size=4, speculative="draft", num_speculative_tokens=3,
                              enable_prefix_caching=False)
        return LLMEngine(models["target"], config=config, draft_model=models["draft"])

    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=4)
    healthy = [list(range(30, 40))]
    reference = engine().generate(healthy, params)
    used = engine()
    bad = used.generate([[5, 6, 99, *range(7, 20)]], params)
    assert [c.finish_reason for c in bad] == (["error"] if "target" in overflowing else ["length"])
    assert used.proposer.runner.cache.nonfinite_blocks() == [] and used.runner.cache.nonfinite_blocks() == []
    assert_same_completions(used.generate(healthy, params), reference)


def test_a_draft_of_a_shorter_context_drafts_up_to_it_then_plain_steps(paths, plain_greedy, tmp_path):
    """The target's weights as a draft of 12 positions beside the target's 512: the engine starts (vLLM's
    does too), the draft proposes while a sequence's proposal fits its context, and greedy output
    equals plain decoding."""
    short = make_hf_checkpoint(tmp_path / "short", "qwen2", seed=3, max_position_embeddings=12)
    engine = make_engine(paths["target"], "draft", short)
    assert engine.max_model_len > 12
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20, n=2))
    assert [c.token_ids for c in out] == [c.token_ids for c in plain_greedy]
    # The same weights with the target's context draft longer: the short draft stopped at its end.
    full = make_engine(paths["target"], "draft", paths["target"])
    full.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20, n=2))
    assert 0 < engine.stats.num_draft_tokens < full.stats.num_draft_tokens
