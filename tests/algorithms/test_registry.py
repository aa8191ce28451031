import pytest

from tether.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
)
from tether.errors import ConfigError, TetherError


def test_register_get_and_names_sorted():
    registry: Registry = Registry("widget")

    @registry.register("zeta")
    def zeta():
        return "z"

    @registry.register("alpha")
    def alpha():
        return "a"

    assert registry.get("zeta") is zeta
    assert registry.get("alpha")() == "a"
    assert registry.names() == ("alpha", "zeta")
    assert "zeta" in registry and "beta" not in registry


def test_unknown_name_lists_valid_names_on_one_line():
    registry: Registry = Registry("widget")
    registry.register("b")(lambda: None)
    registry.register("a")(lambda: None)
    with pytest.raises(UnknownNameError) as info:
        registry.get("c")
    message = str(info.value)
    assert message == "unknown widget 'c'; valid names: a, b"
    assert "\n" not in message
    # Code that catches KeyError and the CLI that catches TetherError both see it.
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, TetherError)


def test_registering_a_name_twice_is_an_error():
    registry: Registry = Registry("widget")
    registry.register("a")(lambda: None)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(lambda: None)


def test_built_in_registries_hold_the_documented_names():
    assert set(ADVANTAGES.names()) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    assert set(POLICY_LOSSES.names()) == {"ppo_clip", "decoupled_ppo"}
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3"}
    assert set(CORRECTIONS.names()) == {"none", "tis_token", "tis_seq", "mis_token", "mis_seq", "geo_mask"}
    assert set(AGGREGATIONS.names()) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"}


def test_built_in_registry_error_names_the_kind_and_choices():
    with pytest.raises(KeyError, match=r"unknown policy loss 'ppo'; valid names: decoupled_ppo, ppo_clip"):
        POLICY_LOSSES.get("ppo")
