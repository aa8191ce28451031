from __future__ import annotations

import pytest

from tether.rollout.staleness import CapacityController


def num_startable(controller: CapacityController, version: int) -> int:
    count = 0
    while controller.may_start(version):
        controller.start()
        count += 1
    return count


def test_areal_rule_group_g_starts_only_when_g_div_b_le_version_plus_s():
    # B = 4, S = 2: groups 0..11 may start at version 0 (g // 4 <= 2), group 12 needs version 1.
    c = CapacityController(groups_per_batch=4, max_staleness=2)
    assert num_startable(c, version=0) == 12
    assert not c.may_start(0)
    assert num_startable(c, version=1) == 4  # groups 12..15
    assert c.num_started == 16


def test_on_policy_allows_exactly_one_batch_per_version():
    c = CapacityController(groups_per_batch=3, max_staleness=0)
    assert num_startable(c, 0) == 3
    assert num_startable(c, 1) == 3


def test_oversampling_adds_extra_groups():
    c = CapacityController(groups_per_batch=3, max_staleness=1, num_extra=2)
    assert c.limit(0) == 8 and num_startable(c, 0) == 8


def test_release_frees_capacity_for_a_replacement():
    c = CapacityController(groups_per_batch=2, max_staleness=0)
    num_startable(c, 0)
    c.release()
    assert c.may_start(0) and c.start() == 1
    with pytest.raises(ValueError):
        c.release(3)


def test_state_dict_round_trip():
    c = CapacityController(2, 1)
    num_startable(c, 0)
    d = CapacityController(2, 1)
    d.load_state_dict(c.state_dict())
    assert d.num_started == 4 and not d.may_start(0)


def test_bad_arguments():
    with pytest.raises(ValueError):
        CapacityController(0, 1)
    with pytest.raises(ValueError):
        CapacityController(1, -1)
