from __future__ import annotations

import copy

import pytest
import torch
from rollout_helpers import tiny_config

from tether.recipes.grpo import build_generator_worker
from tether.rollout.generator_worker import GeneratorWorker
from tether.rollout.local_backend import HandoverTransport


def make_worker(tiny_policy, *overrides: str, reward: str = "count_digits") -> GeneratorWorker:
    model, tokenizer = tiny_policy
    config = tiny_config("rollout.mode=async", "rollout.max_new_tokens=8", *overrides, reward=reward)
    return build_generator_worker(config, copy.deepcopy(model), tokenizer)


def perturbed(worker: GeneratorWorker) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach() + 0.01) for n, p in worker.engine.model.named_parameters()]


def run_until_groups(worker: GeneratorWorker, max_steps: int = 100):
    groups = []
    for _ in range(max_steps):
        groups.extend(worker.step())
        if not worker.in_flight:
            break
    return groups


def test_admission_follows_the_capacity_rule(tiny_policy):
    worker = make_worker(tiny_policy, "rollout.max_staleness=1", "rollout.oversample=1")
    worker.step()
    assert len(worker.in_flight) == (0 + 1 + 1) * 3 + 1  # (v + S + 1) * B + extra
    assert not worker.may_admit


def test_partial_rollouts_continue_under_new_weights_with_mixed_versions(tiny_policy):
    worker = make_worker(tiny_policy, "rollout.max_staleness=1", "rollout.partial_rollouts=true")
    for _ in range(3):  # prefill, then two decode steps under version 0
        worker.step()
    worker.load_weights(perturbed(worker), version=1)
    assert worker.engine.policy_version == 1 and worker.counters.num_aborted == 0  # lag 1 <= S
    groups = run_until_groups(worker)
    versions = [c.versions for g in groups for c in g.completions]
    mixed = [v for v in versions if 0 in v and 1 in v]
    assert mixed, versions
    assert all(v == sorted(v) for v in versions)  # a sample's versions never go back


def test_without_partial_rollouts_updates_wait_for_groups_in_flight(tiny_policy):
    worker = make_worker(tiny_policy, "rollout.max_staleness=1", "rollout.partial_rollouts=false")
    for _ in range(3):
        worker.step()
    worker.load_weights(perturbed(worker), version=1)
    assert worker.engine.policy_version == 0 and not worker.may_admit  # deferred, admission paused
    groups = run_until_groups(worker)
    assert all(set(c.versions) == {0} for g in groups for c in g.completions)
    worker.step()  # drained: the update lands, admission resumes
    assert worker.engine.policy_version == 1 and worker.in_flight


def test_an_update_that_arrives_after_the_drain_supersedes_the_pending_one(tiny_policy):
    """Partial rollouts off: v1 waits for the groups in flight; they finish, then v2 arrives before
    the next step and lands at once. v1 must not land after it (weights would go back a version)."""
    worker = make_worker(tiny_policy, "rollout.max_staleness=1", "rollout.partial_rollouts=false")
    for _ in range(3):
        worker.step()
    worker.load_weights(perturbed(worker), version=1)  # deferred
    run_until_groups(worker)
    v2 = [(n, p.detach() + 0.02) for n, p in worker.engine.model.named_parameters()]
    worker.load_weights(v2, version=2)
    worker.step()
    assert worker.engine.policy_version == worker.version == 2
    assert all(torch.equal(p, dict(v2)[n]) for n, p in worker.engine.model.named_parameters())
    groups = run_until_groups(worker)
    assert groups and all(set(c.versions) == {2} for g in groups for c in g.completions)


def test_a_group_is_aborted_by_its_oldest_token_not_by_when_it_was_admitted(tiny_policy):
    """Groups admitted at v0 but queued behind the engine's sequence limit sample nothing under v0:
    at v1 with S = 0 they are kept (their tokens will all be v1); the ones that sampled are aborted."""
    worker = make_worker(tiny_policy, "rollout.max_staleness=0", "rollout.partial_rollouts=true",
                         "engine.max_num_seqs=4")
    worker.step()  # 3 groups of 4 admitted under v0; only the first runs
    sampled = [rid for rid in worker.in_flight if worker.engine.oldest_token_version(rid) is not None]
    queued = [rid for rid in worker.in_flight if rid not in sampled]
    assert sampled and queued
    worker.load_weights(perturbed(worker), version=1)
    assert worker.counters.num_aborted == len(sampled) and sorted(worker.in_flight) == sorted(queued)
    groups = run_until_groups(worker)
    kept = [g for g in groups if g.start_version == 0]
    assert len(kept) == len(queued) and all(set(c.versions) == {1} for g in kept for c in g.completions)


def test_without_partial_rollouts_queued_groups_an_update_would_leave_too_stale_are_aborted(tiny_policy):
    """Deferred, the update leaves groups queued behind the sequence limit to sample under v0: with
    S = 0 they could never be trained, so they go with the ones that sampled, and v1 lands at once."""
    worker = make_worker(tiny_policy, "rollout.max_staleness=0", "rollout.partial_rollouts=false",
                         "engine.max_num_seqs=4")
    worker.step()  # 3 groups of 4 admitted under v0; only the first runs
    assert any(worker.engine.oldest_token_version(rid) is None for rid in worker.in_flight)
    worker.load_weights(perturbed(worker), version=1)
    assert worker.counters.num_aborted == 3 and not worker.in_flight and worker.engine.policy_version == 1
    groups = run_until_groups(worker)
    assert groups and all(set(c.versions) == {1} for g in groups for c in g.completions)


@pytest.mark.parametrize("partial", ["true", "false"])
def test_groups_that_can_never_be_trained_on_are_aborted_and_reissued(tiny_policy, partial):
    """Partial rollouts off too: the update would wait for groups that can only finish too stale to
    train; they are aborted at once and the update lands."""
    worker = make_worker(tiny_policy, "rollout.max_staleness=0", f"rollout.partial_rollouts={partial}")
    for _ in range(2):
        worker.step()
    in_flight = [g.record for g in sorted(worker.in_flight.values(), key=lambda g: g.uid)]
    worker.load_weights(perturbed(worker), version=1)  # their version-0 tokens would have lag 1 > S
    assert worker.counters.num_aborted == 3 and worker.counters.num_reissued == 3
    assert list(worker.reissue_queue) == in_flight and worker.controller.num_started == 0
    assert worker.engine.policy_version == 1  # nothing left to wait for
    groups = run_until_groups(worker)
    groups.sort(key=lambda g: g.uid)
    assert [g.record for g in groups[:3]] == in_flight  # re-issued first, and now fully on version 1
    assert all(set(c.versions) == {1} for g in groups for c in g.completions)


def test_dynamic_sampling_drops_groups_without_reward_variance_and_refills(tiny_policy):
    worker = make_worker(tiny_policy, "rollout.dynamic_sampling=true", reward="constant")
    groups = run_until_groups(worker)
    assert groups == [] and worker.counters.num_filtered == 3
    assert worker.may_admit  # capacity released: replacements start
    worker.step()
    assert len(worker.in_flight) == 3


def test_a_raising_reward_function_is_counted_not_fatal(tiny_policy):
    worker = make_worker(tiny_policy, reward="flaky")
    groups = run_until_groups(worker)
    assert len(groups) == 3
    num_errors = sum(sum(g.scores.num_errors.values()) for g in groups)
    assert 0 < num_errors < 12  # raised on about half, scored 1.0 on the others
    assert sorted({t for g in groups for t in g.scores.totals}) == [0.0, 1.0]


def test_state_dict_saves_groups_in_flight_as_prompts_to_reissue(tiny_policy):
    worker = make_worker(tiny_policy)
    worker.step()
    in_flight = [g.record for g in sorted(worker.in_flight.values(), key=lambda g: g.uid)]
    state = worker.state_dict()
    fresh = make_worker(tiny_policy)
    fresh.load_state_dict(state)
    assert list(fresh.reissue_queue) == in_flight and fresh.controller.num_started == 0
    groups = run_until_groups(fresh)
    assert [g.record for g in groups] == in_flight


def test_a_drained_worker_finishes_its_groups_and_hands_over_the_whole_stream(tiny_policy):
    worker = make_worker(tiny_policy, "rollout.max_staleness=1")
    worker.step()
    started = len(worker.in_flight)
    worker.drain()
    groups = run_until_groups(worker)
    assert len(groups) == started and worker.is_idle  # nothing new started, nothing dropped
    state = worker.state_dict()
    fresh = make_worker(tiny_policy, "rollout.max_staleness=1")
    fresh.load_state_dict(state)
    assert fresh.counters == worker.counters and fresh.controller.num_started == started
    # The fresh worker goes on with the next prompts of the same stream and the next uids.
    expected = make_worker(tiny_policy, "rollout.max_staleness=1").prompts.take(started + 3)[started:]
    fresh.load_weights(perturbed(fresh), version=1)  # capacity for one more batch
    more = run_until_groups(fresh)
    assert sorted(g.uid for g in more) == list(range(started, started + 3))
    assert [g.record for g in sorted(more, key=lambda g: g.uid)] == expected


class _ProcessStandIn:
    """The generator process's side of a hand-over, in this thread: a second worker."""

    def __init__(self, worker: GeneratorWorker) -> None:
        self.worker = worker
        self.ready = False
        self.received: tuple[dict, int] | None = None

    @property
    def counters(self):
        return self.worker.counters

    def is_ready(self) -> bool:
        return self.ready

    def hand_over(self, state, named_tensors, version: int) -> None:
        self.received = (state, version)
        self.worker.load_state_dict(state)
        self.worker.load_weights(list(named_tensors), version)

    def poll(self, timeout_s: float):
        return run_until_groups(self.worker)

    def publish_weights(self, named_tensors, version: int) -> None:
        self.worker.load_weights(list(named_tensors), version)


@pytest.mark.parametrize("partial", ["true", "false"])
def test_hand_over_waits_for_groups_in_flight_and_sends_the_version_they_end_under(tiny_policy, partial):
    model, tokenizer = tiny_policy
    overrides = ("rollout.max_staleness=1", f"rollout.partial_rollouts={partial}")
    policy = copy.deepcopy(model)
    local = build_generator_worker(
        tiny_config("rollout.mode=async", "rollout.max_new_tokens=8", *overrides), policy, tokenizer)
    remote = _ProcessStandIn(make_worker(tiny_policy, *overrides))
    transport = HandoverTransport(local, remote)  # type: ignore[arg-type]
    local.step()
    local.step()
    started = len(local.in_flight)
    assert started == 6  # (v + S + 1) * B groups in flight
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    transport.publish_weights(policy.named_parameters(), version=1)  # deferred when partial=false
    remote.ready = True
    local_groups, remote_groups = [], []
    for _ in range(100):
        if remote_groups:
            break
        groups = transport.poll(1.0)  # the poll that hands over returns the process's first groups
        (remote_groups if transport.is_handed_over else local_groups).extend(groups)
        assert transport.is_handed_over or remote.received is None
    assert len(local_groups) == started  # drained: every group in flight finished locally, no new one
    state, version = remote.received
    assert version == 1 and state["version"] == 1 and state["reissue"] == []
    assert state["num_started"] == started and remote.worker.counters.num_weight_updates == 1
    assert sorted(g.uid for g in remote_groups) == list(range(started, started + 3))  # one more batch
    assert all(set(c.versions) == {1} for g in remote_groups for c in g.completions)
