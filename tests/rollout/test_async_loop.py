"""The trainer-side driver over an in-process generator: the staleness guarantees, end to end."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from rollout_helpers import tiny_config

from tether.algorithms.registry import ADVANTAGES
from tether.config import ExperimentConfig
from tether.data.cursor import DataCursor
from tether.errors import RolloutStalledError
from tether.recipes.grpo import build_generator_worker, build_trainer
from tether.rollout.async_loop import AsyncRLComponents, async_rl_step
from tether.rollout.buffer import RolloutBuffer
from tether.rollout.local_backend import InProcessTransport
from tether.rollout.sync_loop import LoopState
from tether.training.batch import RolloutBatch


def in_process(config: ExperimentConfig, tiny_policy, run_ahead: bool) -> tuple[AsyncRLComponents, list]:
    """Components with the generator stepped in this thread; also a list that records every trained batch."""
    model, tokenizer = tiny_policy
    model = copy.deepcopy(model)
    trainer = build_trainer(config, model)
    worker = build_generator_worker(config, model, tokenizer)
    trained: list[tuple[int, RolloutBatch]] = []
    train_on = trainer.train_on

    def recording_train_on(batch: RolloutBatch, policy_version: int | None = None) -> dict[str, float]:
        trained.append((policy_version, batch))
        return train_on(batch, policy_version=policy_version)

    trainer.train_on = recording_train_on  # type: ignore[method-assign]
    r = config.rollout
    components = AsyncRLComponents(InProcessTransport(worker, run_ahead), trainer,
                                   RolloutBuffer(r.max_staleness), ADVANTAGES.get("grpo"),
                                   groups_per_batch=r.prompts_per_step, group_size=r.group_size)
    return components, trained


def run_steps(components: AsyncRLComponents, num_steps: int) -> list[dict]:
    state = LoopState()
    return [async_rl_step(components, state)[0] for _ in range(num_steps)]


def test_staleness_zero_is_exactly_on_policy(tiny_policy):
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=0")
    components, trained = in_process(config, tiny_policy, run_ahead=True)
    history = run_steps(components, 3)
    for version, batch in trained:
        assert (batch.versions[batch.mask] == version).all()  # every consumed token: current weights
    assert [m["staleness/max"] for m in history] == [0, 0, 0]
    assert history[-1]["staleness/hist"] == {0: 12}
    # the generator holds the trainer's exact weights after every step
    engine_params = dict(components.transport.worker.engine.model.named_parameters())
    for name, param in components.trainer.model.named_parameters():
        assert torch.equal(engine_params[name], param), name
    assert history[-1]["mismatch/abs_logp_diff"] < 1e-4


def test_staleness_k_is_never_exceeded_and_is_reached_by_a_fast_generator(tiny_policy):
    max_staleness = 2
    config = tiny_config("rollout.mode=async", f"rollout.max_staleness={max_staleness}")
    components, trained = in_process(config, tiny_policy, run_ahead=True)  # generator runs ahead
    history = run_steps(components, 6)
    lags = [version - int(batch.versions[batch.mask].min()) for version, batch in trained]
    assert max(lags) == max_staleness  # the bound binds...
    assert all(lag <= max_staleness for lag in lags)  # ...and holds
    # the generator fills S + 1 batches at once, consumed with lags 0, 1, 2; then again
    assert [m["staleness/max"] for m in history] == [0, 1, 2, 0, 1, 2]
    for key in ("staleness/mean", "staleness/hist", "mismatch/k1", "mismatch/k3", "mismatch/abs_logp_diff",
                "is/mean", "is/ess", "is/clip_frac", "is/masked_frac", "policy_version",
                "throughput/step_tokens_per_s"):
        assert key in history[-1], key
    assert history[-1]["mismatch/k3"] > 0  # stale samples: the trainer has moved on from the engine
    # Tokens of the trainer's own version: the engine ran the same weights, only numerics differ.
    assert [m["mismatch/lag0_frac"] > 0 for m in history] == [True, False, False, True, False, False]
    assert all(m["mismatch/lag0_k3"] < 1e-6 if m["mismatch/lag0_frac"] else math.isnan(m["mismatch/lag0_k3"])
               for m in history)  # NaN where no token was lag 0: nothing measured


def test_generation_rate_of_an_in_process_generator_is_over_its_polls(tiny_policy):
    """Sync mode with oversampling runs the driver with the generator in this thread: generation is
    the wait for data, not the step (training does not overlap it), and every token the engine
    sampled counts, those of the extra groups too."""
    config = tiny_config("rollout.mode=sync", "rollout.oversample=2")
    components, trained = in_process(config, tiny_policy, run_ahead=False)
    history = run_steps(components, 3)
    engine = components.transport.worker.engine
    for m in history:
        assert m["time/gen_s"] == m["time/wait_s"] < m["time/step_s"]
    generated = sum(m["throughput/gen_tokens_per_s"] * m["time/gen_s"] for m in history)
    assert generated == pytest.approx(engine.stats.num_generated_tokens, rel=1e-6)
    trained_tokens = sum(int(batch.mask.sum()) for _, batch in trained)
    assert engine.stats.num_generated_tokens > trained_tokens  # the extra groups' tokens


def test_oversampling_early_cut_keeps_every_prompt(tiny_policy):
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=1", "rollout.oversample=2",
                         "rollout.max_new_tokens=8")
    components, trained = in_process(config, tiny_policy, run_ahead=False)
    history = run_steps(components, 4)
    assert all(m["staleness/max"] <= 1 for m in history)
    worker = components.transport.worker
    consumed = [r for _, b in trained for r in b.prompt_ids[::4]]
    waiting = [g.prompt_ids for g in components.buffer.groups]
    waiting += [g.prompt_ids for g in worker.in_flight.values()]
    waiting += [worker.encode(r) for r in worker.reissue_queue]
    replay = DataCursor(worker.prompts.items, seed=worker.prompts.seed)  # the same order, from the start
    taken = [worker.encode(r) for r in replay.take(worker.prompts.state.position)]
    # every prompt taken from the data was trained on, or is still waiting: none silently skipped
    assert sorted(consumed + waiting) == sorted(taken)


def test_dynamic_sampling_trains_only_on_groups_with_signal(tiny_policy):
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=1", "rollout.dynamic_sampling=true",
                         reward="parity")
    components, trained = in_process(config, tiny_policy, run_ahead=False)
    history = run_steps(components, 3)
    for _, batch in trained:
        for rewards in batch.rewards.view(-1, 4):
            assert len(set(rewards.tolist())) > 1
    assert history[-1]["rollout/num_filtered"] == components.transport.counters.num_filtered > 0


def test_dynamic_sampling_without_any_signal_stops_after_ten_batches_of_groups(tiny_policy):
    """Not after max_wait_s: once ten batches' worth of groups were all filtered (verl's
    max_num_gen_batches), the run stops and says why."""
    config = tiny_config("rollout.mode=async", "rollout.dynamic_sampling=true", reward="constant")
    components, _ = in_process(config, tiny_policy, run_ahead=False)
    with pytest.raises(RolloutStalledError, match=r"dynamic sampling filtered \d+ groups in a row"):
        run_steps(components, 1)
    num_filtered, groups_per_batch = components.transport.counters.num_filtered, components.groups_per_batch
    # the poll returns as groups are filtered: past the limit by at most the groups one engine step ends
    assert 10 * groups_per_batch <= num_filtered < 11 * groups_per_batch


def test_reward_failures_in_groups_dynamic_sampling_drops_are_counted_and_named(tiny_policy):
    """A reward raising on every call scores each group all 0, which dynamic sampling drops: the
    failures must not leave with the groups (the stop names the reward's error, not only 'no variance')."""
    config = tiny_config("rollout.mode=async", "rollout.dynamic_sampling=true", reward="broken")
    components, _ = in_process(config, tiny_policy, run_ahead=False)
    with pytest.raises(RolloutStalledError, match=r"a reward function failed \(scored 0\): .*broken: ValueError: "
                                                  r"broken reward\): check the reward functions"):
        run_steps(components, 1)
    counters = components.transport.counters
    assert counters.num_filtered_reward_errors == counters.num_filtered * 4  # every call of every group
    # flaky: some groups keep variance and train, others are dropped with their failures counted
    config = tiny_config("rollout.mode=async", "rollout.dynamic_sampling=true", reward="flaky")
    components, _ = in_process(config, tiny_policy, run_ahead=False)
    state = LoopState()
    history = [async_rl_step(components, state)[0] for _ in range(3)]
    counters = components.transport.counters
    assert history[-1]["rollout/num_filtered_reward_errors"] == counters.num_filtered_reward_errors
    assert sum(m["reward/errors"] for m in history) + counters.num_filtered_reward_errors > 0
    assert "flaky reward failed" in state.first_reward_errors["reward_fns:flaky"]  # warned by the run


def test_sync_mode_with_oversampling_stays_on_policy(tiny_policy, tmp_path):
    from tether.metrics import read_metrics
    from tether.recipes.grpo import run_grpo

    model, tokenizer = tiny_policy
    config = tiny_config("rollout.oversample=2", "trainer.max_steps=3", "rollout.max_new_tokens=8")
    run_grpo(config, tmp_path, copy.deepcopy(model), tokenizer)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["staleness/max"] for m in metrics] == [0, 0, 0]


def test_partial_rollouts_default_to_the_staleness_bound_in_force():
    """Sync mode is on-policy (a staleness bound there is refused): dynamic sampling alone does not
    turn partial rollouts on there (groups in flight would be aborted and re-issued instead of finished)."""
    from tether.config import load_config
    from tether.recipes.grpo import is_partial_rollouts

    def partial(*overrides: str) -> bool:
        return is_partial_rollouts(load_config(None, list(overrides)))

    assert not partial("rollout.mode=sync", "rollout.dynamic_sampling=true")
    assert partial("rollout.mode=async", "rollout.max_staleness=2")
    assert partial("rollout.mode=sync", "rollout.oversample=2")
    assert not partial("rollout.mode=async", "rollout.max_staleness=2", "rollout.partial_rollouts=false")


@pytest.mark.slow
def test_a_generator_process_stops_starting_groups_once_dynamic_sampling_gave_up(tiny_policy):
    """The limit is counted where the groups are filtered: a generator process whose trainer is busy
    (here: 3 s before its first poll) stops at the limit plus the groups in flight; it went on
    filtering (384 groups against a limit of 30 in a review's run)."""
    from tether.recipes.grpo import build_async_components

    model, tokenizer = tiny_policy
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=1", "rollout.oversample=2",
                         "rollout.dynamic_sampling=true", "rollout.generate_during_boot=false",
                         "rollout.generator_threads=1", "trainer.num_threads=1", reward="constant")
    components = build_async_components(config, copy.deepcopy(model), tokenizer)
    try:
        time.sleep(3.0)
        with pytest.raises(RolloutStalledError, match=r"dynamic sampling filtered 3\d groups in a row"):
            run_steps(components, 1)
        num_in_flight = (1 + 1) * 3 + 2  # (S + 1) x B + oversample
        assert 30 <= components.transport.counters.num_filtered <= 30 + num_in_flight
    finally:
        components.transport.close()


def test_dynamic_sampling_limit_in_sync_mode_counts_filtered_groups_as_they_come(tiny_policy):
    """Sync mode keeps its one batch of groups in flight and re-issues each filtered one at once: the
    poll must hand back as groups are filtered, or it stepped on for its whole timeout (0.5 s: 55
    groups past a limit of 10)."""
    config = tiny_config("rollout.mode=sync", "rollout.dynamic_sampling=true", "rollout.prompts_per_step=1",
                         reward="constant")
    components, _ = in_process(config, tiny_policy, run_ahead=False)
    with pytest.raises(RolloutStalledError, match=r"dynamic sampling filtered \d+ groups in a row"):
        run_steps(components, 1)
    num_filtered = components.transport.counters.num_filtered
    assert 10 <= num_filtered <= 11
