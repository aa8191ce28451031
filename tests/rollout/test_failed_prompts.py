"""Prompts the engine cannot serve never crash a run nor get trained on."""

from __future__ import annotations

import copy
import json

import pytest
from rollout_helpers import tiny_config

from tether.errors import ConfigError, DataError, RequestError
from tether.recipes.grpo import build_generator_worker, rl_prompt_data, rollout_kv_tokens, run_grpo

SHORT = ["12+3=", "4+5=", "7+1=", "2+2=", "9+9="]


def _prompts_file(tmp_path, prompts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def _config(path, *overrides):
    return tiny_config("data.task=null", f"data.train={path}", "trainer.max_steps=2", *overrides)


def test_prompts_longer_than_the_context_are_skipped_with_one_warning(tmp_path, tiny_policy, capsys):
    model, tokenizer = tiny_policy  # max_position_embeddings = 64
    path = _prompts_file(tmp_path, [SHORT[0], "1" * 100, *SHORT[1:], "2" * 63])
    config = _config(path)
    data, skipped, longest = rl_prompt_data(config, model, tokenizer)
    assert [r.index for r in skipped] == [1, 6]  # 100 and 63 characters (+ bos) leave no room
    assert longest == len("12+3=") + 1  # the longest kept, bos included
    assert len(data.train) == len(SHORT)
    result = run_grpo(config, tmp_path / "run", copy.deepcopy(model), tokenizer)
    assert len(result.history) == 2 and all(m["rollout/num_failed"] == 0 for m in result.history)
    assert all(m["throughput/step_tokens_per_s"] <= m["throughput/gen_tokens_per_s"] for m in result.history)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "skipped 2 of 7 training prompts" in warnings[0]
    assert warnings[0].endswith(f"the first is {path}:2")  # the file and line of the prompt


@pytest.mark.parametrize(("overrides", "num_groups"), [
    (["rollout.mode=sync"], 3),  # a step's prompts
    (["rollout.mode=async", "rollout.max_staleness=2", "rollout.oversample=1"], 3 * 3 + 1),  # window + extra
])
def test_the_rollout_engines_kv_pool_holds_what_the_run_can_use(tmp_path, tiny_policy, overrides, num_groups):
    """Sized from free memory alone, the pool took 3.2 GB of zeros for a run that needed 60 tokens of
    KV (and async mode builds two engines at start-up): it is capped at every sequence that may run
    at once at the longest prompt + max_new_tokens, in whole blocks."""
    model, tokenizer = tiny_policy
    config = _config(_prompts_file(tmp_path, SHORT), "engine.kv_cache_bytes=null", "rollout.max_new_tokens=12",
                     *overrides)
    engine = build_generator_worker(config, model, tokenizer).engine
    blocks_per_seq = -(-(len("12+3=") + 1 + 12) // 16)  # 2: the longest prompt with bos, then 12 tokens
    assert engine.block_manager.num_blocks == num_groups * 4 * blocks_per_seq
    assert rollout_kv_tokens(config, len("12+3=") + 1) == num_groups * 4 * blocks_per_seq * 16


def test_a_pool_too_small_for_the_rollouts_is_warned_about_once(tmp_path, tiny_policy, capsys):
    """Preemption keeps a short pool correct but slow, and nothing else shows it."""
    model, tokenizer = tiny_policy
    path = _prompts_file(tmp_path, SHORT)
    build_generator_worker(_config(path, "engine.kv_cache_bytes=30000"), model, tokenizer)
    [warning] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    # 12 sequences of 6 + 5 tokens: a block each
    assert "the rollouts may need up to 192 at once" in warning and "raise engine.kv_cache_bytes" in warning
    build_generator_worker(_config(path), model, tokenizer)  # 2 MB: room for all 12 sequences
    assert "warning" not in capsys.readouterr().err
    # 6 blocks hold the 4 sequences engine.max_num_seqs lets run at once: nothing is preempted
    build_generator_worker(_config(path, "engine.kv_cache_bytes=30000", "engine.max_num_seqs=4"), model, tokenizer)
    assert "warning" not in capsys.readouterr().err


def test_no_prompt_that_fits_is_a_one_line_data_error(tmp_path, tiny_policy):
    model, tokenizer = tiny_policy
    config = _config(_prompts_file(tmp_path, ["1" * 100]))
    with pytest.raises(DataError, match="none of the 1 training prompts leaves room"):
        run_grpo(config, tmp_path / "run", copy.deepcopy(model), tokenizer)


def test_a_completion_budget_as_long_as_the_context_is_a_config_error(tmp_path, tiny_policy):
    model, tokenizer = tiny_policy  # max_position_embeddings = 64: every sample would be cut short
    config = _config(_prompts_file(tmp_path, SHORT), "rollout.max_new_tokens=500")
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=500 leaves no room for a prompt in the "
                                          "engine's context of 64 tokens"):
        rl_prompt_data(config, model, tokenizer)


@pytest.mark.parametrize("mode", ["sync", "async_worker"])
def test_a_group_the_engine_fails_is_left_out_and_counted(tmp_path, tiny_policy, capsys, mode):
    """A prompt inside the context that can never fit the KV pool (3 blocks of 16 tokens) fails in
    the engine: its group is dropped, counted, reported once; the other groups train."""
    model, tokenizer = tiny_policy
    path = _prompts_file(tmp_path, [*SHORT, "3" * 55])  # 56 tokens + 5 new: 4 blocks > 3
    config = _config(path, "engine.kv_cache_bytes=14336",
                     "rollout.prompts_per_step=6", "rollout.max_new_tokens=5")
    if mode == "sync":
        result = run_grpo(config, tmp_path / "run", copy.deepcopy(model), tokenizer)
        assert [m["rollout/num_failed"] for m in result.history] == [1, 2]  # once per epoch of 6 prompts
        err = capsys.readouterr().err
        assert err.count("warning: a sample failed in the engine") == 1 and "KV blocks" in err
    else:
        worker = build_generator_worker(config, copy.deepcopy(model), tokenizer)
        groups = []
        for _ in range(200):
            groups.extend(worker.step())
            if worker.counters.num_failed and len(groups) == len(SHORT):
                break
        assert worker.counters.num_failed == 1 and "KV blocks" in worker.counters.first_failure
        assert sorted(g.record.index for g in groups) == list(range(len(SHORT)))
        assert all(c.finish_reason != "error" for g in groups for c in g.completions)


@pytest.mark.parametrize(("driver", "message"), [
    ("rollout.oversample=0", r"failed every prompt of 3 batches in a row.*KV blocks"),  # rl_step
    ("rollout.oversample=1", r"failed the first \d+ groups and finished none.*KV blocks"),  # the async driver
])
def test_a_run_whose_every_prompt_fails_stops_with_one_line(tmp_path, tiny_policy, driver, message):
    """Nothing to train on, batch after batch: an error naming the failure, not a run of no-ops
    (nor, in the async driver, a 10-minute wait for a group that never comes)."""
    model, tokenizer = tiny_policy
    path = _prompts_file(tmp_path, ["3" * 55, "4" * 55])  # inside the context, never in a 3-block pool
    config = _config(path, "engine.kv_cache_bytes=14336", "rollout.prompts_per_step=2", driver)
    with pytest.raises(RequestError, match=message):
        run_grpo(config, tmp_path / "run", copy.deepcopy(model), tokenizer)


def test_reward_modules_are_imported_once_in_a_sync_run(tmp_path, tiny_policy):
    """The up-front check and the loop share one RewardComputer: a module that loads a judge or
    binds a port at import does it once."""
    model, tokenizer = tiny_policy
    log = tmp_path / "imports.log"
    reward = tmp_path / "counting_reward.py"
    reward.write_text(f"open({str(log)!r}, 'a').write('x')\n\ndef score(prompt, completion, **fields):\n"
                      "    return float(len(completion) % 2)\n")
    config = tiny_config("trainer.max_steps=1", f"rewards=[{{fn: '{reward}:score'}}]")
    run_grpo(config, tmp_path / "run", copy.deepcopy(model), tokenizer)
    assert log.read_text() == "x"


def test_an_async_run_whose_groups_start_failing_mid_run_stops_with_one_line(tiny_policy):
    """Groups that fail after some finished (the policy diverged to NaN weights) stop the run after 3
    batches' worth, as in the sync loop, instead of spinning until ``max_wait_s`` (10 minutes)."""
    import time

    import torch

    from tether.algorithms.registry import ADVANTAGES
    from tether.recipes.grpo import build_trainer
    from tether.rollout.async_loop import AsyncRLComponents, async_rl_step
    from tether.rollout.buffer import RolloutBuffer
    from tether.rollout.local_backend import InProcessTransport
    from tether.rollout.sync_loop import LoopState

    model, tokenizer = tiny_policy
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=1")
    policy = copy.deepcopy(model)
    r = config.rollout
    components = AsyncRLComponents(
        InProcessTransport(build_generator_worker(config, copy.deepcopy(model), tokenizer)),
        build_trainer(config, policy), RolloutBuffer(r.max_staleness), ADVANTAGES.get("grpo"),
        r.prompts_per_step, r.group_size)
    state = LoopState()
    async_rl_step(components, state)
    with torch.no_grad():
        policy.model.embed_tokens.weight.fill_(float("nan"))
    components.transport.publish_weights(policy.named_parameters(), state.policy_version)
    start = time.monotonic()
    with pytest.raises(RequestError, match="groups in a row since the last one finished.*not finite"):
        for _ in range(10):
            async_rl_step(components, state)
    assert time.monotonic() - start < 120


def test_each_failing_reward_function_is_reported_once(tmp_path, tiny_policy, capsys):
    """Two reward functions that fail: both are named on stderr, once each (the first one's warning
    used to stand for every reward function of the run)."""
    from rollout_helpers import REWARDS

    model, tokenizer = tiny_policy
    config = tiny_config("trainer.max_steps=2", f"rewards=[{{fn: '{REWARDS}:flaky'}}, {{fn: '{REWARDS}:broken'}}]")
    result = run_grpo(config, tmp_path / "run", copy.deepcopy(model), tokenizer)
    assert all(m["reward/reward_fns:broken/errors"] == 12 for m in result.history)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2
    assert "reward_fns:flaky: RuntimeError: flaky reward failed" in warnings[0]
    assert "reward_fns:broken: ValueError: broken reward" in warnings[1]
