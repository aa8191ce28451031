"""Each sample's random stream: counter-based, so a draw is a pure function of (seed, draw index).

The j-th uniform of a sample seeded ``s`` is SplitMix64's j-th output (Steele, Lea and Flood 2014,
"Fast Splittable Pseudorandom Number Generators") from the state ``mix(s ^ c)``:
``mix(mix(s ^ c) + (j + 1) * gamma)``, gamma the odd golden-ratio constant, its top 24 bits scaled
into [0, 1) -- a float32 that is exact and never 1.0, as ``torch.rand`` draws. The seed is mixed
into the state, not used as it: seeds that differ by a multiple of gamma (``sample_seed`` derives a
request's sample seeds with that very constant) would otherwise give one stream shifted by a draw.
``derived_seed`` (``SamplingParams.for_request``) takes a request's seed from a draw of the run's.

The whole state of a sample's stream is two integers (``SampleRNG``), and a step draws for all its
rows in a handful of vectorised integer operations instead of one ``torch.rand`` call per row
(which was ~1 ms of a 256-row step on these CPUs).

Same seed, same draws, whatever else shares the step: a row's uniforms depend only on its own
seed and how many it drew before.

Draft-model speculation keys its draws by the output position instead (``position_uniforms``):
the token at output index t has draws ``3t + k`` for its k-th purpose (the draft token, the
acceptance test, the residual), whatever step or how many drafts produced it. Such an engine's
plain steps (a sample whose draft stopped drafting) draw ``3t + 2`` too, the bonus token's draw: a
counter draw ``j`` there would be a draw an earlier token's test already spent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_SEED_SALT = np.uint64(0x243F6A8885A308D3)  # c: pi's fraction, so seed 0 is no fixed point of mix
_FLOAT_BITS = 24  # float32's significand: every value k / 2**24 is exact
_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True)
class SampleRNG:
    """One sample's stream: its seed and the number of uniforms it has drawn."""

    seed: int
    num_draws: int = 0


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Stafford's Mix13) on uint64 arrays (wrapping, never warning)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def _draws(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """uint64 arrays (broadcasting) -> draws ``counters`` of the streams ``seeds``, all 64 bits."""
    z = _mix(seeds ^ _SEED_SALT) + (counters + np.uint64(1)) * _GAMMA  # wraps mod 2**64, as SplitMix64
    return _mix(z)


def counter_uniforms(seeds: np.ndarray, counters: np.ndarray) -> torch.Tensor:
    """uint64 arrays (broadcasting) -> float32 uniforms in [0, 1): draw ``counters`` of the streams
    ``seeds``."""
    top = (_draws(seeds, counters) >> np.uint64(64 - _FLOAT_BITS)).astype(np.float32)  # exact in float32
    return torch.from_numpy(top * np.float32(1.0 / (1 << _FLOAT_BITS)))


def derived_seed(seed: int, index: int) -> int:
    """A 63-bit seed derived from ``seed`` and ``index``: draw ``index`` of stream ``seed``, so
    derived seeds look unrelated to each other and to small seeds a person types."""
    draw = _draws(np.array([seed & _SEED_MASK], dtype=np.uint64), np.array([index], dtype=np.uint64))
    return int(draw[0]) >> 1


def draw_uniforms(rngs: Sequence[SampleRNG], num_per_row: int = 1) -> torch.Tensor:
    """``[M, num_per_row]`` float32 uniforms in [0, 1), row i the next draws of rngs[i] (advanced)."""
    offsets = np.broadcast_to(np.arange(num_per_row, dtype=np.uint64), (len(rngs), num_per_row))
    return draw_at(rngs, offsets, [num_per_row] * len(rngs))


def draw_at(rngs: Sequence[SampleRNG], offsets: np.ndarray, num_drawn: Sequence[int]) -> torch.Tensor:
    """``[M, K]`` uniforms: row i's draws ``offsets[i]`` (uint64 ``[M, K]``, counted from its next
    draw); then rngs[i] advances by ``num_drawn[i]``, the draws it consumed."""
    seeds = np.fromiter((r.seed & _SEED_MASK for r in rngs), dtype=np.uint64, count=len(rngs))
    starts = np.fromiter((r.num_draws for r in rngs), dtype=np.uint64, count=len(rngs))
    for r, num in zip(rngs, num_drawn):
        r.num_draws += num
    return counter_uniforms(seeds[:, None], starts[:, None] + offsets)


# The purposes of a draft-model speculation draw at one output position (``position_uniforms``).
DRAFT_DRAW, ACCEPT_DRAW, STOP_DRAW = 0, 1, 2
_NUM_PURPOSES = 3


def position_uniforms(rngs: Sequence[SampleRNG], positions: np.ndarray, purpose: int) -> torch.Tensor:
    """``[M, K]`` uniforms of purpose ``purpose`` (``DRAFT_DRAW`` ...) for the output positions
    ``positions`` (int ``[M, K]``) of streams rngs[i]: draw ``3 * position + purpose``, a pure
    function of (seed, position, purpose). The streams do not advance."""
    seeds = np.fromiter((r.seed & _SEED_MASK for r in rngs), dtype=np.uint64, count=len(rngs))
    counters = np.asarray(positions, dtype=np.uint64) * np.uint64(_NUM_PURPOSES) + np.uint64(purpose)
    return counter_uniforms(seeds[:, None], counters)
