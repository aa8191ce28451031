import math

import torch

from tether.algorithms.mismatch import lag0_mismatch_metrics, mismatch_metrics, staleness_metrics

# Log ratio d = logp_trainer - logp_engine on valid tokens: [ln 2, ln 0.5, 0]; the last slot is padding.
LOGP_TRAINER = torch.tensor([[math.log(2.0), math.log(0.5)], [-0.3, float("-inf")]])
LOGP_ENGINE = torch.tensor([[0.0, 0.0], [-0.3, -1.0]])
MASK = torch.tensor([[True, True], [True, False]])
KEYS = {
    "mismatch/k1",
    "mismatch/k3",
    "mismatch/abs_logp_diff",
    "is/mean",
    "is/ess",
    "is/clip_frac",
    "is/masked_frac",
    "mismatch/outside_support_frac",
}


def test_hand_computed_metrics_with_raw_ratios():
    out = mismatch_metrics(LOGP_TRAINER, LOGP_ENGINE, MASK, cap=2.0)
    assert set(out) == KEYS
    ln2 = math.log(2)
    expected = {
        "mismatch/k1": 0.0,  # mean(-d) = (-ln 2 + ln 2 + 0) / 3
        "mismatch/k3": 0.5 / 3,  # (2 - ln 2 - 1) + (0.5 + ln 2 - 1) + 0 = 0.5
        "mismatch/abs_logp_diff": 2 * ln2 / 3,
        "is/mean": 3.5 / 3,  # weights 2, 0.5, 1
        "is/ess": 3.5**2 / (3 * (4 + 0.25 + 1)),  # 12.25 / 15.75 = 0.777778
        "is/clip_frac": 1 / 3,  # the weight 2 sits at cap
        "is/masked_frac": 0.0,
        "mismatch/outside_support_frac": 0.0,
    }
    for key, value in expected.items():
        assert math.isclose(out[key], value, rel_tol=1e-5, abs_tol=1e-6), key


def test_weights_and_keep_mask_from_a_correction():
    # Dropping the first token leaves weights 0.5 and 1 on 2 of 3 valid tokens.
    is_weights = torch.tensor([[0.0, 0.5], [1.0, 0.0]])
    keep_mask = torch.tensor([[False, True], [True, False]])
    out = mismatch_metrics(
        LOGP_TRAINER, LOGP_ENGINE, MASK, is_weights=is_weights, keep_mask=keep_mask, cap=2.0
    )
    assert math.isclose(out["is/mean"], 0.75, rel_tol=1e-6)
    assert math.isclose(out["is/ess"], 1.5**2 / (2 * 1.25), rel_tol=1e-6)  # 0.9
    assert out["is/clip_frac"] == 0.0
    assert math.isclose(out["is/masked_frac"], 1 / 3, rel_tol=1e-6)
    # Mismatch itself is measured over all valid tokens, not only the kept ones.
    assert math.isclose(out["mismatch/k3"], 0.5 / 3, rel_tol=1e-5)


def test_lag0_metrics_cover_the_tokens_of_the_trainers_version_only():
    # Valid tokens have d = ln 2, ln 0.5, 0; only the second and third were sampled at lag 0.
    is_lag0 = torch.tensor([[False, True], [True, True]])
    out = lag0_mismatch_metrics(LOGP_TRAINER, LOGP_ENGINE, MASK, is_lag0)
    ln2 = math.log(2)
    assert math.isclose(out["mismatch/lag0_k1"], ln2 / 2, rel_tol=1e-6)  # mean(-d) over ln 0.5, 0
    assert math.isclose(out["mismatch/lag0_k3"], (0.5 + ln2 - 1) / 2, rel_tol=1e-5)
    assert math.isclose(out["mismatch/lag0_frac"], 2 / 3, rel_tol=1e-6)  # padding is not a token
    none = lag0_mismatch_metrics(LOGP_TRAINER, LOGP_ENGINE, MASK, torch.zeros_like(MASK))
    # No lag-0 token: nothing measured, NaN (a 0 would read as "no numeric mismatch" in a run's mean)
    assert math.isnan(none["mismatch/lag0_k1"]) and math.isnan(none["mismatch/lag0_k3"])
    assert none["mismatch/lag0_frac"] == 0.0


def test_identical_logprobs_mean_no_mismatch():
    out = mismatch_metrics(LOGP_ENGINE, LOGP_ENGINE, MASK)
    assert out["mismatch/k1"] == 0.0 and out["mismatch/k3"] == 0.0 and out["mismatch/abs_logp_diff"] == 0.0
    assert out["is/mean"] == 1.0 and math.isclose(out["is/ess"], 1.0, rel_tol=1e-6)
    assert out["is/clip_frac"] == 0.0


def test_empty_mask_gives_zeros_not_nan():
    out = mismatch_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool), cap=2.0)
    assert set(out) == KEYS
    assert all(value == 0.0 for value in out.values())


def test_staleness_hand_computed():
    out = staleness_metrics(torch.tensor([0, 2, 2, 1]))
    assert out == {"staleness/mean": 1.25, "staleness/max": 2, "staleness/hist": {0: 1, 1: 1, 2: 2}}
    assert list(out["staleness/hist"]) == [0, 1, 2]


def test_staleness_of_empty_batch():
    out = staleness_metrics(torch.zeros(0, dtype=torch.long))
    assert out == {"staleness/mean": 0.0, "staleness/max": 0, "staleness/hist": {}}


def test_a_token_outside_the_trainers_support_is_counted_not_averaged():
    """The trainer's top-k/top-p set moved since the engine sampled a token: its log-prob is -inf
    there. The metrics stay finite and count it."""
    logp_trainer = LOGP_TRAINER.clone()
    logp_trainer[0, 1] = float("-inf")
    out = mismatch_metrics(logp_trainer, LOGP_ENGINE, MASK, cap=2.0)
    assert all(math.isfinite(value) for value in out.values())
    assert math.isclose(out["mismatch/outside_support_frac"], 1 / 3, rel_tol=1e-6)
    assert math.isclose(out["mismatch/abs_logp_diff"], math.log(2) / 2, rel_tol=1e-5)  # over the other two
