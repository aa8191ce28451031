from __future__ import annotations

import pytest
import torch

from tether.data.records import PromptRecord
from tether.engine.types import Completion
from tether.rewards.compute import RewardResult
from tether.rollout.buffer import GroupRollout, RolloutBuffer, is_consumable


def group(uid: int, versions: list[list[int]], start_version: int = 0, rewards: list[float] | None = None
          ) -> GroupRollout:
    completions = [Completion(0, i, [1], token_ids=[5] * len(v), logprobs=[-1.0] * len(v), versions=v)
                   for i, v in enumerate(versions)]
    totals = rewards if rewards is not None else [0.0] * len(versions)
    return GroupRollout(uid, PromptRecord(f"p{uid}"), [1], completions, ["x"] * len(versions),
                        RewardResult(totals, {}), start_version)


def test_lag_is_trainer_version_minus_oldest_token():
    g = group(0, [[3, 3, 4], [4, 5]])
    assert g.oldest_versions == [3, 4]
    assert g.oldest_version == 3
    assert g.lags(6) == [3, 2]
    assert is_consumable(g, 6, max_staleness=3) and not is_consumable(g, 7, max_staleness=3)


def test_empty_completion_counts_from_the_start_version():
    g = group(0, [[], [2]], start_version=1)
    assert g.oldest_versions == [1, 2]


def test_reward_variance():
    assert group(0, [[0], [0]], rewards=[1.0, 0.0]).has_reward_variance
    assert not group(0, [[0], [0]], rewards=[1.0, 1.0]).has_reward_variance


def test_take_batch_waits_for_enough_groups():
    buffer = RolloutBuffer(max_staleness=1)
    buffer.add([group(0, [[0]])])
    take = buffer.take_batch(2, trainer_version=0)
    assert take.groups is None and take.stale == [] and len(buffer) == 1


def test_take_batch_drops_stale_groups_and_returns_them_for_reissue():
    buffer = RolloutBuffer(max_staleness=1)
    buffer.add([group(0, [[0, 1]]), group(1, [[1]]), group(2, [[2]]), group(3, [[2]])])
    take = buffer.take_batch(2, trainer_version=2)
    assert [g.uid for g in take.stale] == [0]  # lag 2 > 1
    assert [g.uid for g in take.groups] == [1, 2]  # oldest first, then admission order
    assert [g.uid for g in buffer.groups] == [3]


def test_take_batch_with_too_few_fresh_groups_still_drops_stale():
    buffer = RolloutBuffer(max_staleness=0)
    buffer.add([group(0, [[0]]), group(1, [[1]])])
    take = buffer.take_batch(2, trainer_version=1)
    assert take.groups is None and [g.uid for g in take.stale] == [0]
    assert [g.uid for g in buffer.groups] == [1]


def test_state_dict_round_trip():
    buffer = RolloutBuffer(max_staleness=2)
    buffer.add([group(0, [[0]]), group(1, [[1]])])
    restored = RolloutBuffer(max_staleness=0)
    restored.load_state_dict(buffer.state_dict())
    assert restored.max_staleness == 2 and [g.uid for g in restored.groups] == [0, 1]


def test_negative_staleness_rejected():
    with pytest.raises(ValueError):
        RolloutBuffer(-1)


def test_rollout_batch_pads_each_sample_into_its_row():
    from tether.rollout.sync_loop import build_rollout_batch

    completions = [Completion(0, 0, [1], [7, 8], [-0.5, -1.5], [2, 3]), Completion(0, 1, [1]),
                   Completion(1, 0, [2, 3], [9, 4, 6], [-0.1, -0.2, -0.3], [3, 3, 3])]
    batch = build_rollout_batch([[1], [2, 3]], completions, torch.zeros(3), torch.zeros(3), group_size=2)
    assert batch.completion_ids.tolist() == [[7, 8, 0], [0, 0, 0], [9, 4, 6]]
    assert batch.mask.tolist() == [[True, True, False], [False] * 3, [True] * 3]
    assert torch.equal(batch.behaviour_logprobs, torch.tensor([[-0.5, -1.5, 0], [0, 0, 0], [-0.1, -0.2, -0.3]]))
    assert batch.versions.tolist() == [[2, 3, 0], [0, 0, 0], [3, 3, 3]]
    assert batch.prompt_ids == [[1], [1], [2, 3]]
