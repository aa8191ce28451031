"""Pure RL math: tensors in, tensors out, selected by name from registries.

Importing this package fills the registries (``ADVANTAGES``, ``POLICY_LOSSES``, ``KL_ESTIMATORS``,
``CORRECTIONS``, ``AGGREGATIONS``); the trainer picks entries by their config names.
"""

from tether.algorithms import advantages, aggregation, corrections, kl, policy_loss  # noqa: F401 (registers)
from tether.algorithms.corrections import Correction
from tether.algorithms.logprobs import entropy_from_logits, gather_token_logprobs, process_logits
from tether.algorithms.mismatch import mismatch_metrics, staleness_metrics
from tether.algorithms.policy_loss import PolicyLossStats, approx_proximal_logprobs
from tether.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Correction",
    "PolicyLossStats",
    "Registry",
    "UnknownNameError",
    "approx_proximal_logprobs",
    "entropy_from_logits",
    "gather_token_logprobs",
    "mismatch_metrics",
    "process_logits",
    "staleness_metrics",
]
