"""End-to-end engine tests on tiny random checkpoints, against transformers and full forwards."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.hf_tiny import FAMILIES, make_hf_checkpoint
from helpers.reference import assert_same_completions, full_forward_logprobs
from tether.engine import Completion, EngineConfig, LLMEngine, SamplingParams
from tether.errors import CheckpointError, ConfigError, RequestError
from tether.models import build_char_tokenizer, load_model
from tether.training.optim import build_optimizer

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], [44]]
SAMPLED = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, max_new_tokens=10, seed=1234, n=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: make_hf_checkpoint(root / family, family, seed=3) for family in FAMILIES}


@pytest.fixture(scope="module")
def qwen2_path(checkpoints):
    return checkpoints["qwen2"]


def make_engine(path, **overrides) -> LLMEngine:
    config = EngineConfig(**{"num_kv_blocks": 128, "block_size": 4, **overrides})
    return LLMEngine(load_model(path), config=config)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(checkpoints, family):
    path = checkpoints[family]
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    engine = make_engine(path, max_num_batched_tokens=12)  # small budget: chunks and decodes mixed
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    completions = engine.generate(PROMPTS, params)
    for prompt, completion in zip(PROMPTS, completions):
        expected = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert completion.token_ids == expected
        assert completion.finish_reason == "length" and completion.versions == [0] * 12
        reference = full_forward_logprobs(hf, completion, params)
        assert torch.allclose(torch.tensor(completion.logprobs), reference, atol=1e-4)


def test_sampled_logprobs_equal_a_full_forward(qwen2_path):
    hf = AutoModelForCausalLM.from_pretrained(qwen2_path, attn_implementation="eager").float().eval()
    completions = make_engine(qwen2_path).generate(PROMPTS, SAMPLED)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [
        (i, j) for i in range(4) for j in range(2)
    ]
    assert completions[0].token_ids != completions[1].token_ids  # two samples of one prompt differ
    for completion in completions:
        reference = full_forward_logprobs(hf, completion, SAMPLED)
        assert torch.allclose(torch.tensor(completion.logprobs), reference, atol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 3},  # tiny budget: every prompt is chunked
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 512},
        {"num_kv_blocks": 8, "block_size": 4},  # tiny pool: preemption and recompute
    ],
    ids=["no-prefix-cache", "chunked", "no-chunking", "preemption"],
)
def test_results_do_not_depend_on_scheduling(qwen2_path, overrides):
    reference = make_engine(qwen2_path).generate(PROMPTS, SAMPLED)
    engine = make_engine(qwen2_path, **overrides)
    completions = engine.generate(PROMPTS, SAMPLED)
    assert_same_completions(completions, reference)
    if "num_kv_blocks" in overrides:
        assert engine.stats.num_preemptions > 0


def test_group_prefills_its_prompt_once(qwen2_path):
    for is_caching in (True, False):
        engine = make_engine(qwen2_path, enable_prefix_caching=is_caching)
        prompt = list(range(3, 25))  # 22 tokens: 5 full blocks and a partial one
        params = SamplingParams(temperature=1.0, max_new_tokens=6, n=8, seed=7)
        completions = engine.generate([prompt], params)
        assert engine.stats.num_prefill_tokens == len(prompt)
        assert len(completions) == 8 and len({tuple(c.token_ids) for c in completions}) > 1
        assert engine.stats.num_preemptions == 0


def test_second_request_hits_the_prefix_cache(qwen2_path):
    engine = make_engine(qwen2_path)
    prompt = list(range(3, 25))
    first = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4))
    second = engine.generate([prompt + [50]], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert engine.stats.num_prefix_hit_tokens == 20  # five full blocks of the shared prompt
    assert engine.stats.num_prefill_tokens == len(prompt) + 3  # only the tail block was recomputed
    fresh = make_engine(qwen2_path).generate(
        [prompt + [50]], SamplingParams(temperature=0.0, max_new_tokens=4)
    )
    assert second[0].token_ids == fresh[0].token_ids and first[0].finish_reason == "length"


def test_same_seed_same_sample_in_any_batch(qwen2_path):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=99)
    alone = make_engine(qwen2_path).generate([PROMPTS[1]], params)[0]
    others = SamplingParams(temperature=0.7, max_new_tokens=5, seed=5)
    batch = make_engine(qwen2_path).generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others, params, others])
    assert batch[1].token_ids == alone.token_ids


def test_incremental_api_and_abort(qwen2_path):
    engine = make_engine(qwen2_path)
    keep = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=6))
    drop = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=50, n=3))
    engine.step()
    engine.step()
    for bad in (True, "2", 2.0, [drop, "2"]):  # nothing aborted by a value that is no request id
        with pytest.raises(TypeError, match="abort"):
            engine.abort(bad)
    engine.abort([drop])
    finished: list[Completion] = []
    while engine.has_unfinished():
        finished.extend(engine.step())
    by_reason = sorted((c.request_id, c.finish_reason) for c in finished)
    assert by_reason == [(keep, "length"), (drop, "abort"), (drop, "abort"), (drop, "abort")]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_token_and_stop_string(qwen2_path):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    tokens = make_engine(qwen2_path).generate([PROMPTS[0]], greedy)[0].token_ids
    stop_at = tokens[4]
    first_index = tokens.index(stop_at)
    stopped = make_engine(qwen2_path).generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.token_ids == tokens[: first_index + 1] and stopped.finish_reason == "stop"
    tokenizer = build_char_tokenizer()
    text = tokenizer.decode(tokens[2:4])
    engine = LLMEngine(load_model(qwen2_path), tokenizer=tokenizer, config=EngineConfig(num_kv_blocks=64))
    by_string = engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=12, stop_strings=(text,))
    )
    assert by_string[0].finish_reason == "stop"
    assert text in tokenizer.decode(by_string[0].token_ids) and len(by_string[0].token_ids) <= 4


def test_weight_update_changes_outputs_and_stamps_versions(qwen2_path):
    engine = make_engine(qwen2_path)
    model = engine.model
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate([PROMPTS[0]], params)[0]
    request = engine.add_request(PROMPTS[2], params)
    engine.step()  # prompt computed, first token sampled under version 0
    engine.step()  # second token
    head = model.lm_head.weight
    update = [("lm_head.weight", head.flip(0).clone()), ("model.norm.weight", model.model.norm.weight * 1.5)]
    storage = head.data_ptr()
    assert engine.block_manager.num_cached_blocks > 0
    engine.update_weights(update, version=3)
    assert engine.block_manager.num_cached_blocks == 0  # flushed: no new request reuses stale KV
    assert model.lm_head.weight.data_ptr() == storage  # copied in place, not rebuilt
    finished = []
    while engine.has_unfinished():
        finished.extend(engine.step())
    assert finished[0].request_id == request
    assert finished[0].versions == [0, 0] + [3] * 6
    after = engine.generate([PROMPTS[0]], params)[0]
    assert after.versions == [3] * 8 and after.token_ids != before.token_ids
    assert engine.block_manager.num_cached_blocks > 0  # the flushed cache refills under the new weights
    with pytest.raises(CheckpointError, match="no parameter named 'nope'"):
        engine.update_weights([("nope", head)], version=4)


def test_logits_follow_an_lm_head_changed_in_place(qwen2_path):
    """On CPU the engine re-lays out its linear weights (``use_transposed_weight_layout``): a model
    changed in place afterwards (an optimizer on the model the engine was built on) is still what
    the engine runs, and the layout keeps every shape and value."""
    engine = make_engine(qwen2_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine.generate([PROMPTS[0]], params)
    with torch.no_grad():
        engine.model.lm_head.weight.mul_(-1.0)  # in place: no update_weights call
    after = engine.generate([PROMPTS[0]], params)[0]
    assert not engine.model.lm_head.weight.is_contiguous()  # [V, H] as a view of a contiguous [H, V]
    torch.testing.assert_close(engine.model.lm_head.weight, -load_model(qwen2_path).lm_head.weight)
    fresh = make_engine(qwen2_path)
    fresh.update_weights([("lm_head.weight", -fresh.model.lm_head.weight)], version=0)
    expected = fresh.generate([PROMPTS[0]], params)[0]
    assert after.token_ids == expected.token_ids
    assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


@pytest.mark.parametrize("change", ["load_state_dict", "optimizer_step", "optimizer_step_on_attention"])
def test_weights_changed_outside_update_weights_are_not_served_from_the_prefix_cache(qwen2_path, change):
    """``load_state_dict``, or a step of tether's optimizer (torch's fused AdamW, which leaves the
    parameters' version counters alone) over all or a few of its parameters, on the engine's model
    between steps: the prompt's cached KV
    was computed under the old weights, so the next request must recompute it, as after
    ``update_weights``."""
    engine = make_engine(qwen2_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine.generate([PROMPTS[2]], params)
    assert engine.block_manager.num_cached_blocks > 0
    if change == "load_state_dict":
        state = {name: p * 1.3 if ".layers." in name else p for name, p in load_model(qwen2_path).state_dict().items()}
        engine.model.load_state_dict(state)
    else:  # every parameter, or a few small ones (none of the largest, whose bits are sampled)
        trained = [p for name, p in engine.model.named_parameters()
                   if change == "optimizer_step" or "self_attn.k_proj" in name]
        optimizer = build_optimizer(trained, lr=0.05)
        generator = torch.Generator().manual_seed(0)
        for p in trained:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    hits = engine.stats.num_prefix_hit_tokens
    after = engine.generate([PROMPTS[2]], params)[0]
    assert engine.stats.num_prefix_hit_tokens == hits  # nothing computed under the old weights reused
    fresh = make_engine(qwen2_path)
    fresh.update_weights([(name, p.detach().clone()) for name, p in engine.model.named_parameters()], version=0)
    expected = fresh.generate([PROMPTS[2]], params)[0]
    assert after.token_ids == expected.token_ids
    assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert after.versions == [0] * 6  # no update_weights: the version stays


def test_a_prompt_mid_prefill_at_a_weight_update_samples_from_the_new_weights_alone(qwen2_path):
    """With the default policy (keep the KV of sequences in flight), a sequence that has sampled
    nothing yet recomputes its prompt: its tokens all carry the new version, so their context must
    be the new weights' too (the loop's S = 0 counts such a group as on-policy)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = list(range(20, 32))
    engine = make_engine(qwen2_path, max_num_batched_tokens=4)
    engine.add_request(prompt, params)
    assert engine.step() == []  # the first 4 prompt tokens' KV, under version 0
    new_weights = [(name, p.detach() * 1.1) for name, p in engine.model.named_parameters()]
    engine.update_weights(new_weights, version=1)
    finished = []
    while engine.has_unfinished():
        finished.extend(engine.step())
    fresh = make_engine(qwen2_path)
    fresh.update_weights(new_weights, version=1)
    expected = fresh.generate([prompt], params)[0]
    assert finished[0].versions == [1] * 6
    assert_same_completions(finished, [expected])


def test_recompute_kv_on_update_matches_a_fresh_run(qwen2_path):
    engine = make_engine(qwen2_path, recompute_kv_on_update=True)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine.add_request(PROMPTS[0], params)
    engine.step()
    new_weights = [(name, p.detach() * 1.1) for name, p in engine.model.named_parameters()]
    engine.update_weights(new_weights, version=1)
    assert engine.stats.num_preemptions == 1
    finished = []
    while engine.has_unfinished():
        finished.extend(engine.step())
    fresh = make_engine(qwen2_path)
    fresh.update_weights(new_weights, version=1)
    continuation = fresh.generate(
        [PROMPTS[0] + finished[0].token_ids[:1]], SamplingParams(temperature=0.0, max_new_tokens=5)
    )
    assert finished[0].token_ids[1:] == continuation[0].token_ids
    assert finished[0].logprobs[1:] == pytest.approx(continuation[0].logprobs, abs=1e-4)


def test_bad_requests_fail_alone(qwen2_path):
    engine = make_engine(qwen2_path, num_kv_blocks=16, max_model_len=40)
    prompts = [[], [5, 6, 1000], list(range(3, 45)), [5, 6, 7], [5, 6, 7]]
    params = [
        SamplingParams(max_new_tokens=4),
        SamplingParams(max_new_tokens=4),
        SamplingParams(max_new_tokens=4),
        SamplingParams(max_new_tokens=4, stop_strings=("x",)),  # no tokenizer given
        SamplingParams(temperature=0.0, max_new_tokens=4),
    ]
    completions = engine.generate(prompts, params)
    assert [c.finish_reason for c in completions] == ["error"] * 4 + ["length"]
    errors = [c.error for c in completions[:4]]
    assert (
        "empty" in errors[0]
        and "1000" in errors[1]
        and "max_model_len" in errors[2]
        and "tokenizer" in errors[3]
    )
    assert all("\n" not in e for e in errors) and completions[4].num_tokens == 4
    assert completions[0].prompt_ids == [] and completions[1].prompt_ids == [5, 6, 1000]
    # a prompt element that is no integer: an error completion, not a raise (6.9 is not truncated)
    odd = engine.generate([[5, None], [5, 6.9, 7], [5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert [c.finish_reason for c in odd] == ["error", "error", "length"]
    assert "position 1 is None" in odd[0].error and "position 1 is 6.9" in odd[1].error
    assert odd[2].token_ids == completions[4].token_ids and not engine.has_unfinished()
    # no sequence at all: an error completion for that prompt, not a TypeError for the whole batch
    shapeless = engine.generate([[5, 6, 7], None, 7], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert [c.finish_reason for c in shapeless] == ["length", "error", "error"]
    assert "the prompt is NoneType, not a sequence of token ids" in shapeless[1].error
    small = make_engine(qwen2_path, num_kv_blocks=2, block_size=4)
    too_big = small.generate([[5, 6, 7], [5]], SamplingParams(temperature=0.0, max_new_tokens=20))
    assert too_big[0].finish_reason == "error" and "KV blocks" in too_big[0].error
    vocab_size = engine.model.config.vocab_size
    stops = engine.generate([[5, 6, 7]] * 2, [SamplingParams(max_new_tokens=4, stop_token_ids=(vocab_size,)),
                                              SamplingParams(temperature=0.0, max_new_tokens=4)])
    assert stops[0].finish_reason == "error"
    assert f"stop token id {vocab_size} is not in the vocabulary" in stops[0].error
    assert stops[1].token_ids == completions[4].token_ids


def test_api_misuse_gets_one_line_errors_and_conveniences_work(qwen2_path):
    engine = make_engine(qwen2_path)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    expected = engine.generate([[5, 6, 7]], greedy)[0].token_ids
    assert engine.generate(iter([[5, 6, 7]]), greedy)[0].token_ids == expected  # any iterable of prompts
    assert [c.num_tokens for c in engine.generate([[5, 6, 7]])] == [SamplingParams().max_new_tokens]  # defaults
    with pytest.raises(RequestError, match="params must be a SamplingParams"):
        engine.generate([[5, 6, 7]], {"temperature": 0.0})
    with pytest.raises(RequestError, match="add_request: params must be a SamplingParams, got dict"):
        engine.add_request([5, 6, 7], {"temperature": 0.0})
    request_id = engine.add_request([5, 6, 7], greedy)
    engine.abort(np.int64(request_id))  # one id (a numpy integer too), not only an iterable of them
    [aborted] = engine.step()
    assert aborted.finish_reason == "abort" and not engine.has_unfinished()
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=10**11)  # refused before 10**11 samples are made


def test_a_numpy_integer_seed_samples_as_its_int(qwen2_path):
    import numpy as np

    engine = make_engine(qwen2_path)
    as_int, as_numpy = engine.generate([[5, 6, 7]] * 2, [SamplingParams(max_new_tokens=6, seed=seed)
                                                          for seed in (2**62 + 5, np.int64(2**62 + 5))])
    assert as_numpy.token_ids == as_int.token_ids and as_numpy.finish_reason == "length"
    assert type(SamplingParams(seed=np.int64(3)).seed) is int
    with pytest.raises(ValueError, match="seed must be an integer or None, got 1.5"):
        SamplingParams(seed=1.5)


def test_sampling_params_are_checked_and_normalised():
    """Wrong types fail where the settings are made, one line naming the field, not inside a step
    (a float top_k sampled differently alone and in a mixed batch; a top_k past int64 broke every
    later call)."""
    for bad, field in [({"n": 1.5}, "n"), ({"top_k": 2.5}, "top_k"), ({"top_k": 2**64}, "top_k"),
                       ({"temperature": "1"}, "temperature"), ({"max_new_tokens": True}, "max_new_tokens"),
                       ({"stop_token_ids": 2}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop token ids"),
                       ({"stop_strings": ("a", 5)}, "stop_strings"), ({"stop_strings": ("",)}, "stop_strings")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    made = SamplingParams(temperature=1, top_k=np.int64(3), stop_strings="</s>", stop_token_ids=[2, np.int64(7)])
    assert (made.temperature, made.top_k, made.stop_strings, made.stop_token_ids) == (1.0, 3, ("</s>",), (2, 7))
    assert type(made.top_k) is int and type(made.stop_token_ids[1]) is int


def test_a_step_that_raises_leaves_no_request_of_its_call_behind(qwen2_path):
    engine = make_engine(qwen2_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    expected = engine.generate(PROMPTS[:2], params)
    run = engine.runner.run
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first step of the call, which also hands out the queued completion
            raise RuntimeError("out of memory")
        return run(*args, **kwargs)

    engine.runner.run = failing_once
    queued = engine.add_request([], params)  # fails at once: its completion waits for the next step
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate(PROMPTS[:2], params)
    # The queued completion survives the raising step; the call's own requests are gone.
    assert [(c.request_id, c.finish_reason) for c in engine.step()] == [(queued, "error")]
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert_same_completions(engine.generate(PROMPTS[:2], params), expected)


@pytest.mark.parametrize("where", ["forward", "sampler", "draft forward"])
def test_stepping_on_after_a_step_that_raised_gives_the_same_completions(qwen2_path, where):
    """The incremental API (an async loop's) steps on after a step raised (an OOM, an interrupt):
    a step that stopped after forking a group (its copy-on-write copies taken, never made), after
    marking its tokens computed (the sampler raised), or in a draft model's forward left sequences
    with wrong or no KV to run on. Every completion comes out as in an undisturbed run, the pool
    empties, and the prefix cache serves no KV the failed step left half-made."""
    def engine() -> LLMEngine:
        if where != "draft forward":
            return make_engine(qwen2_path)
        return LLMEngine(load_model(qwen2_path), config=EngineConfig(num_kv_blocks=128, block_size=4,
                         speculative="draft", num_speculative_tokens=2), draft_model=load_model(qwen2_path))

    prompt = [5, 6, 7, 8, 9, 10]  # its partly filled second block is shared by the group after the fork
    params = [SamplingParams(temperature=0.0, max_new_tokens=6, n=3), SamplingParams(max_new_tokens=6, seed=9)]
    expected = engine().generate([prompt, PROMPTS[2]], params)
    flaky = engine()
    target = {"forward": (flaky.runner, "run"), "sampler": (flaky.sampler, "sample"),
              "draft forward": (flaky._draft_runner, "run")}[where]
    real, calls = getattr(*target), []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the step after the prompts' (the group forked), or the first sampling
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    setattr(*target, failing_once)
    for prompt_ids, sampling in zip([prompt, PROMPTS[2]], params):
        flaky.add_request(prompt_ids, sampling)
    done: list[Completion] = []
    with pytest.raises(RuntimeError, match="out of memory"):
        while flaky.has_unfinished():
            done.extend(flaky.step())
    while flaky.has_unfinished():
        done.extend(flaky.step())
    assert_same_completions(sorted(done, key=lambda c: (c.request_id, c.sample_index)), expected)
    assert flaky.block_manager.num_free_blocks == flaky.block_manager.num_blocks
    probe = prompt + expected[0].token_ids[:3]  # its blocks are in the cache now
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    assert flaky.generate([probe], greedy)[0].token_ids == engine().generate([probe], greedy)[0].token_ids


class _Detokenizer:
    """Letters for ids; raises ``error`` at its ``fail_at``-th decode (the stop-string check's)."""

    def __init__(self, fail_at: int = 0, error: BaseException | None = None) -> None:
        self.num_calls, self.fail_at, self.error = 0, fail_at, error

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.num_calls += 1
        if self.num_calls == self.fail_at:
            raise self.error
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("fail_at", [1, 4, 7, 10])
def test_an_interrupt_in_the_stop_check_loses_nothing_and_changes_nothing(qwen2_path, fail_at):
    """Ctrl-C lands in a step's stop-string check (the detokenizer), and the caller steps on: the
    completions that finished earlier in that step still come out, the token whose check was cut
    short is sampled again (no request runs past max_new_tokens or max_model_len), and seeded
    samples equal an undisturbed run's (the step's unused draws are given back)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15, 16]]
    stop = ("#",)  # never matched: every new token of these requests is checked by decoding
    params = [SamplingParams(temperature=0.0, max_new_tokens=1),
              SamplingParams(max_new_tokens=3, seed=5, stop_strings=stop),
              SamplingParams(max_new_tokens=20, seed=6, stop_strings=stop),  # to max_model_len (8 tokens)
              SamplingParams(max_new_tokens=4, seed=7, n=2, stop_strings=stop)]

    def run(detokenizer):
        engine = LLMEngine(load_model(qwen2_path), tokenizer=detokenizer,
                           config=EngineConfig(num_kv_blocks=128, block_size=1, max_model_len=8))
        for prompt, sampling in zip(prompts, params):
            engine.add_request(prompt, sampling)
        done, num_interrupts = [], 0
        while engine.has_unfinished():
            try:
                done.extend(engine.step())
            except KeyboardInterrupt:
                num_interrupts += 1
        return sorted(done, key=lambda c: (c.request_id, c.sample_index)), num_interrupts

    expected, _ = run(_Detokenizer())
    got, num_interrupts = run(_Detokenizer(fail_at, KeyboardInterrupt()))
    assert num_interrupts == 1
    assert_same_completions(got, expected)
    assert [c.num_tokens for c in got] == [1, 3, 3, 4, 4]


def test_a_detokenizer_that_fails_on_a_text_fails_that_request_alone(qwen2_path):
    detokenizer = _Detokenizer(fail_at=3, error=ValueError("no text for id 999"))
    engine = LLMEngine(load_model(qwen2_path), tokenizer=detokenizer,
                       config=EngineConfig(num_kv_blocks=128, block_size=4))
    done = engine.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=4, seed=1, stop_strings=("#",)),
                                                 SamplingParams(temperature=0.0, max_new_tokens=4)])
    assert [c.finish_reason for c in done] == ["error", "length"]
    assert done[0].error == "request 0: checking its stop strings failed: ValueError: no text for id 999"
    assert done[1].num_tokens == 4


def test_a_request_whose_kv_fills_the_pool_exactly_is_served(qwen2_path):
    # 12 prompt tokens + 5 new: the last new token is sampled, never run, so the KV of 16 tokens
    # fills 4 blocks of 4 exactly; one more new token would not fit.
    prompt, params = list(range(5, 17)), SamplingParams(temperature=0.0, max_new_tokens=5)
    expected = make_engine(qwen2_path).generate([prompt], params)[0]
    exact = make_engine(qwen2_path, num_kv_blocks=4, block_size=4)
    served = exact.generate([prompt, prompt], [params, dataclasses.replace(params, max_new_tokens=6)])
    assert served[0].finish_reason == "length" and served[0].token_ids == expected.token_ids
    assert served[1].finish_reason == "error" and "needs 5 KV blocks, the pool has 4" in served[1].error
    assert exact.block_manager.num_free_blocks == 4


def test_bad_config_is_a_config_error(qwen2_path):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make_engine(qwen2_path, enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    for bad in (2, "2", [2, -1], [2.0], [True]):
        with pytest.raises(ConfigError, match="engine.stop_token_ids must be token ids"):
            EngineConfig(stop_token_ids=bad)
    assert EngineConfig(stop_token_ids=[np.int64(2), 7]).stop_token_ids == (2, 7)
    # Values of the wrong type are named (the API has no YAML schema to convert them).
    for field, value, needle in [("block_size", "16", "an integer"), ("max_num_seqs", 2.5, "an integer"),
                                 ("seed", None, "an integer"), ("num_kv_blocks", True, "an integer or null"),
                                 ("enable_prefix_caching", "no", "true or false"),
                                 ("kv_cache_memory_fraction", "0.3", "a number"), ("block_size", 10**9, "<= 1024")]:
        with pytest.raises(ConfigError, match=f"engine.{field} must be {needle}"):
            EngineConfig(**{field: value})


def test_a_yarn_scaled_model_serves_its_extended_context(tmp_path):
    """Qwen2.5's long-context recipe: yarn factor 4 on a config of 64 positions serves 256, as vLLM
    derives it; the log-probs past position 64 equal transformers'."""
    path = make_hf_checkpoint(tmp_path / "yarn", "qwen2", seed=3, max_position_embeddings=64, with_tokenizer=False,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    engine = make_engine(path)
    assert engine.max_model_len == 256
    prompt = [(7 * i) % 90 + 5 for i in range(80)]
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    [completion] = engine.generate([prompt], params)
    assert completion.num_tokens == 20
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    expected = full_forward_logprobs(hf, completion, params)
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def test_sliding_window_matches_transformers(tmp_path):
    path = make_hf_checkpoint(tmp_path / "mistral", "mistral", seed=5, sliding_window=4)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    engine = make_engine(path, max_num_batched_tokens=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    for prompt, completion in zip(PROMPTS, engine.generate(PROMPTS, params)):
        expected = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert completion.token_ids == expected


def test_pool_sized_from_a_byte_budget(qwen2_path):
    model = load_model(qwen2_path)
    # 2 layers x 2 KV heads x head_dim 16 x fp32, k and v: 512 bytes per token, 2 KiB per block of 4
    # in the pool, and as much again for the contiguous decode copies: 4 KiB of budget per block,
    # and 2 KiB for the pool's pad block.
    engine = LLMEngine(model, config=EngineConfig(block_size=4, kv_cache_bytes=10 * 4096 + 2048 + 100))
    assert engine.block_manager.num_blocks == 10
    assert tuple(engine.runner.cache.k.shape) == (2, 10 + 1, 4, 2, 16)  # + the pad block
    assert engine.runner.decode_kv.max_tokens == 10 * 4  # the copies never outgrow the pool
    short = LLMEngine(model, config=EngineConfig(block_size=4, kv_cache_bytes=10 * 4096 + 2047))
    assert short.block_manager.num_blocks == 9
    # A draft model's KV (same number of blocks) comes out of the same budget.
    drafted = LLMEngine(model, config=EngineConfig(block_size=4, kv_cache_bytes=10 * 8192 + 4096 + 100,
                                                   speculative="draft"), draft_model=load_model(qwen2_path))
    assert drafted.block_manager.num_blocks == 10
    with pytest.raises(ConfigError, match="engine.kv_cache_bytes=4000 holds no KV block: one takes 6144 bytes"):
        LLMEngine(model, config=EngineConfig(block_size=4, kv_cache_bytes=4000))


def test_gpu_free_memory_counts_what_torch_caches_unused(monkeypatch):
    # No GPU here: a GPU shared with a trainer in the same process is played by its figures. The
    # driver sees 2 GB free while torch's allocator holds 2 GB it no longer uses; empty_cache hands
    # those back.
    from tether.engine.runner import free_memory_bytes

    gb, cached = 1 << 30, [2 << 30]

    def empty_cache():
        cached[0] = 0

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * gb - cached[0], 80 * gb))
    assert free_memory_bytes(torch.device("cuda", 0)) == 4 * gb


@pytest.mark.parametrize(("cgroup", "files", "left"), [
    ("0::/job.slice/run\n", {"job.slice/run/memory.max": "8589934592", "job.slice/run/memory.current": "1073741824"},
     7 << 30),  # cgroup v2, a Slurm job's --mem
    ("0::/\n", {"memory.max": "4294967296", "memory.current": "0"}, 4 << 30),  # inside a container: the root
    ("0::/\n", {"memory.max": "max", "memory.current": "5"}, None),  # no limit
    ("4:memory:/docker/abc\n3:cpu:/\n", {"memory/memory.limit_in_bytes": "2147483648",
                                          "memory/memory.usage_in_bytes": "1073741824"}, 1 << 30),  # v1, root
    ("4:memory:/x\n", {"memory/x/memory.limit_in_bytes": "9223372036854771712",
                        "memory/x/memory.usage_in_bytes": "1"}, None),  # v1 "no limit"
])
def test_host_memory_for_the_pool_is_what_the_cgroup_leaves(tmp_path, cgroup, files, left):
    """In a container (--memory) or a Slurm job (--mem) the host's free memory is not the process's:
    the pool was sized from the host's and the run killed."""
    from tether.engine.runner import cgroup_memory_left, meminfo_available

    (tmp_path / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    assert cgroup_memory_left(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == left
    (tmp_path / "meminfo").write_text("MemTotal:  100 kB\nMemFree:  10 kB\nMemAvailable:  60 kB\n")
    assert meminfo_available(str(tmp_path / "meminfo")) == 60 * 1024  # the reclaimable cache counts


def test_greedy_and_sampled_requests_share_a_batch(qwen2_path):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    alone = make_engine(qwen2_path).generate([PROMPTS[0]], greedy)[0]
    mixed = make_engine(qwen2_path).generate([PROMPTS[0], PROMPTS[1]], [greedy, SAMPLED])
    assert mixed[0].token_ids == alone.token_ids and len(mixed) == 3


def test_group_finishing_at_its_first_token_frees_everything(qwen2_path):
    engine = make_engine(qwen2_path)
    completions = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=1, n=4, seed=3))
    assert [c.num_tokens for c in completions] == [1] * 4 and [c.sample_index for c in completions] == [
        0,
        1,
        2,
        3,
    ]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()


def test_many_requests_through_a_tiny_pool_and_budget(qwen2_path):
    prompts = [[(7 * i + j) % 90 + 3 for j in range(1 + (5 * i) % 17)] for i in range(12)]
    params = [
        SamplingParams(temperature=0.8, max_new_tokens=4 + i % 5, n=1 + i % 3, seed=i) for i in range(12)
    ]
    reference = make_engine(qwen2_path).generate(prompts, params)
    engine = make_engine(qwen2_path, num_kv_blocks=12, max_num_batched_tokens=7, max_num_seqs=5)
    completions = engine.generate(prompts, params)
    assert [c.token_ids for c in completions] == [c.token_ids for c in reference]
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 12 and not engine.has_unfinished()


def test_an_engine_built_in_inference_mode_leaves_the_model_trainable(qwen2_path):
    """The layout change runs outside inference mode: the caller's model must still train."""
    model = load_model(qwen2_path)
    with torch.inference_mode():
        engine = LLMEngine(model, config=EngineConfig(num_kv_blocks=64, block_size=4))
        engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert not any(p.is_inference() for p in model.parameters())
    loss = model.compute_logits(model(torch.tensor([PROMPTS[0]]))).logsumexp(-1).mean()
    loss.backward()  # raised "Inference tensors cannot be saved for backward" before the fix
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_temperature_that_would_overflow_the_logits_is_refused():
    for temperature in (float("nan"), float("inf"), 1e-39, 1e-6):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=temperature)
    assert SamplingParams(temperature=1e-5).temperature == 1e-5 and SamplingParams(temperature=0.0).is_greedy


def test_a_failed_update_leaves_weights_version_and_prefix_cache_as_they_were(qwen2_path):
    engine = make_engine(qwen2_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate([PROMPTS[0]], params)[0]
    num_cached = engine.block_manager.num_cached_blocks
    layer = engine.model.model.layers[0].self_attn.v_proj.weight
    saved = layer.detach().clone()
    update = [("model.layers.0.self_attn.v_proj.weight", torch.zeros_like(layer)),
              ("model.norm.weight", torch.ones(3))]  # the second is bad: nothing may land
    with pytest.raises(CheckpointError, match="model.norm.weight has shape"):
        engine.update_weights(update, version=1)
    assert torch.equal(layer, saved) and engine.policy_version == 0
    assert engine.block_manager.num_cached_blocks == num_cached
    # Wrong kinds of values, checked before anything is copied (a numpy array passed the shape check
    # and failed inside copy_, after the first tensors had landed).
    zeros = ("model.layers.0.self_attn.v_proj.weight", torch.zeros_like(layer))
    for bad, needle in [([zeros, ("model.norm.weight", np.ones(saved.shape[1], dtype=np.float32))], "is ndarray"),
                        ([zeros, ("model.norm.weight", torch.empty(saved.shape[1], device="meta"))], "meta tensor"),
                        ([zeros, ("model.norm.weight", torch.ones(saved.shape[1], dtype=torch.long))], "torch.int64"),
                        ([zeros, ("model.norm.weight", torch.ones(saved.shape[1]).to_sparse())], "sparse_coo"),
                        ([zeros, torch.ones(3)], r"item 1 is Tensor, not a \(name, tensor\) pair")]:
        with pytest.raises(CheckpointError, match=needle):
            engine.update_weights(bad, version=1)
        assert torch.equal(layer, saved) and engine.policy_version == 0
    for version in ("v2", -1, True):
        with pytest.raises(CheckpointError, match="version must be an int >= 0"):
            engine.update_weights([zeros], version=version)
    with pytest.raises(CheckpointError, match=r"give \(name, tensor\) pairs or a state dict, got NoneType"):
        engine.update_weights(None, version=1)
    again = engine.generate([PROMPTS[0]], params)[0]
    assert again.token_ids == before.token_ids and again.versions == [0] * 6
    engine.update_weights(dict([zeros]), version=1)  # a state dict is taken as its items
    assert not layer.any() and engine.policy_version == 1


@pytest.mark.parametrize("native_attention", [True, False])
def test_a_sequence_whose_kv_turns_non_finite_fails_alone(qwen2_path, native_attention):
    """Weights that overflow on one token only (its embedding is inf): the prompts holding it fail,
    and the others finish as on a clean engine, in the same steps (padded reads never touch its
    blocks) and afterwards, on blocks and decode copies it used (zeroed once its logits failed)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, n=3)
    bad = [5, 6, 7, 8, 99, 9, 10, 11, 12, 13]  # its first block is finite and shared with `healthy`
    healthy = [[5, 6, 7, 8, 20, 21], PROMPTS[1], PROMPTS[2]]

    def engine(**overrides) -> LLMEngine:
        model = load_model(qwen2_path)
        with torch.no_grad():
            model.model.embed_tokens.weight[99] = float("inf")
        config = EngineConfig(num_kv_blocks=16, block_size=4, cpu_native_attention=native_attention, **overrides)
        return LLMEngine(model, config=config)

    reference = engine().generate(healthy, [params, params, sampled])
    mixed = engine().generate([healthy[0], bad, healthy[1], bad, healthy[2]],
                              [params, params, params, sampled, sampled])
    assert [c.finish_reason for c in mixed[1:2] + mixed[3:6]] == ["error"] * 4
    assert all("not finite" in c.error for c in mixed[1:2] + mixed[3:6])
    assert_same_completions([mixed[0], mixed[2], *mixed[6:]], reference)
    for prefix_caching in (True, False):
        reused = engine(enable_prefix_caching=prefix_caching)
        assert [c.finish_reason for c in reused.generate([bad], sampled)] == ["error"] * 3
        assert reused.block_manager.num_free_blocks == reused.block_manager.num_blocks
        assert reused.runner.cache.nonfinite_blocks() == []
        assert_same_completions(reused.generate(healthy, [params, params, sampled]), reference)


def _overflowing_engine(path, **overrides) -> LLMEngine:
    """An engine whose weights overflow on token 99 only (its embedding is inf)."""
    model = load_model(path)
    with torch.no_grad():
        model.model.embed_tokens.weight[99] = float("inf")
    return LLMEngine(model, config=EngineConfig(**{"num_kv_blocks": 16, "block_size": 4, **overrides}))


def test_a_prompt_whose_kv_turns_non_finite_in_a_prefill_chunk_fails_at_that_step(qwen2_path):
    """No logits are sampled in a prefill chunk, yet its KV may already be NaN: the step that wrote it
    fails the request, before an abort or a preemption could free its blocks unseen (a healthy
    prompt reusing them, or hitting its first block in the prefix cache, then failed too)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    healthy = [5, 6, 7, 8, 20, 21]  # its first block is the bad prompt's, finite
    reference = _overflowing_engine(qwen2_path).generate([healthy], params)
    engine = _overflowing_engine(qwen2_path, max_num_batched_tokens=8)
    bad = engine.add_request([5, 6, 7, 8, 99, 9, 10, 11, 12, 13, 14, 15, 16, 17], params)  # 2 chunks
    first = engine.step()
    assert [(c.request_id, c.finish_reason) for c in first] == [(bad, "error")]
    assert "KV cache holds non-finite values" in first[0].error and not engine.has_unfinished()
    assert engine.runner.cache.nonfinite_blocks() == []
    assert_same_completions(engine.generate([healthy], params), reference)
    # Preemption in a small pool: the overflowing prompt is recomputed and fails; the others finish
    # as they do alone.
    prompts = [[78, 41, 85, 24, 68, 45, 64, 32, 46, 75, 44, 83], [69, 57, 99, 84, 83, 63, 74, 47, 54, 32, 68],
               [61, 71, 56], [40, 45, 61]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    config = {"num_kv_blocks": 5, "max_num_batched_tokens": 8, "enable_prefix_caching": False}
    crowded = _overflowing_engine(qwen2_path, **config)
    out = crowded.generate(prompts, params)
    assert crowded.stats.num_preemptions > 0
    assert [c.finish_reason == "error" for c in out] == [False, True, False, False]
    alone = [_overflowing_engine(qwen2_path, **config).generate([prompt], params)[0] for prompt in prompts]
    assert_same_completions([out[0], *out[2:]], [alone[0], *alone[2:]])


def test_non_finite_logits_fail_their_sequences_and_a_good_update_recovers(qwen2_path):
    """Weights gone NaN (a diverged run) fail the sequences they produce logits for, one line each,
    instead of raising out of the step; the NaN KV they leave is zeroed, and a good update recovers."""
    engine = make_engine(qwen2_path, num_kv_blocks=4)  # every block is reused, NaN KV or not
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5, n=2)
    reference = engine.generate(PROMPTS[:2], params)
    good = [(name, p.detach().clone()) for name, p in engine.model.named_parameters()]
    norm = engine.model.model.norm.weight
    engine.update_weights([("model.norm.weight", torch.full_like(norm, float("nan")))], version=1)
    failed = engine.generate(PROMPTS[:2], params) + engine.generate(PROMPTS[1:2], sampled)
    assert [c.finish_reason for c in failed] == ["error"] * 4
    assert all("not finite" in c.error and "\n" not in c.error and c.num_tokens == 0 for c in failed)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    layers = engine.model.model.layers
    layers[0].mlp.up_proj.weight.data.fill_(float("nan"))  # NaN KV in the pool from here on
    in_flight = engine.add_request(PROMPTS[2][:10], params)  # its KV fills 3 of the 4 blocks
    first = engine.step()  # its prompt's KV is NaN in every layer past the first, its token fails
    assert [(c.request_id, c.finish_reason) for c in first] == [(in_flight, "error")]
    engine.update_weights(good, version=2)
    recovered = engine.generate(PROMPTS[:2], params)
    assert [c.token_ids for c in recovered] == [c.token_ids for c in reference]
    assert all(c.versions == [2] * 6 for c in recovered) and not engine.has_unfinished()
