import numpy as np
import torch

from tether.engine.rng import ACCEPT_DRAW, DRAFT_DRAW, STOP_DRAW, SampleRNG, draw_at, draw_uniforms, position_uniforms
from tether.engine.sequence import sample_seed
from tether.engine.types import SamplingParams

MASK = (1 << 64) - 1


def mix(z: int) -> int:
    """SplitMix64's output function on Python ints (the reference the numpy version must match)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def splitmix64(state: int) -> tuple[int, int]:
    """Reference SplitMix64 (Steele et al. 2014) on Python ints: (next state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK
    return state, mix(state)


def test_draws_are_splitmix64_outputs_from_the_mixed_seed_scaled_to_24_bits():
    _, first = splitmix64(0)
    assert first == 0xE220A8397B1DCDAF  # the published first output for seed 0
    for seed in (0, 1, 12345, sample_seed(7, 3), (1 << 63) - 1):
        state, expected = mix(seed ^ 0x243F6A8885A308D3), []
        for _ in range(6):
            state, out = splitmix64(state)
            expected.append((out >> 40) / (1 << 24))
        got = draw_uniforms([SampleRNG(seed)], 6)
        assert got.dtype == torch.float32
        assert got[0].tolist() == expected


def test_a_stream_continues_where_it_stopped_and_ignores_its_neighbours():
    alone = SampleRNG(99)
    first = draw_uniforms([alone], 3)[0].tolist() + draw_uniforms([alone], 2)[0].tolist()
    assert alone.num_draws == 5
    batched = [SampleRNG(1), SampleRNG(99), SampleRNG(2, num_draws=40)]
    together = draw_uniforms(batched, 5)
    assert together[1].tolist() == first
    assert [r.num_draws for r in batched] == [5, 5, 45]


def test_draw_at_reads_chosen_offsets_and_advances_by_what_was_consumed():
    a, b = SampleRNG(5), SampleRNG(6)
    reference = draw_uniforms([SampleRNG(5)], 4)[0]
    out = draw_at([a, b], np.array([[0, 3], [1, 1]], dtype=np.uint64), [4, 2])
    assert out[0].tolist() == [reference[0].item(), reference[3].item()]
    assert (a.num_draws, b.num_draws) == (4, 2)


def test_position_draws_are_keyed_by_seed_position_and_purpose_and_leave_the_stream_alone():
    rng = SampleRNG(77, num_draws=13)
    reference = draw_uniforms([SampleRNG(77)], 3 * 6)[0].view(6, 3)  # draw 3t + purpose
    other = SampleRNG(78)
    positions = np.array([[5, 0, 2], [1, 1, 4]])
    for purpose in (DRAFT_DRAW, ACCEPT_DRAW, STOP_DRAW):
        got = position_uniforms([rng, other], positions, purpose)
        assert got[0].tolist() == reference[[5, 0, 2], purpose].tolist()
        assert got[1, 0] == got[1, 1] and got[1, 0] != got[0, 0]
    assert (rng.num_draws, other.num_draws) == (13, 0)


def test_uniforms_are_uniform_within_a_stream_and_across_sample_seeds():
    within = draw_uniforms([SampleRNG(2024)], 200_000)[0]
    across = draw_uniforms([SampleRNG(sample_seed(2024, i)) for i in range(200_000)])[:, 0]
    for u in (within, across):
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
        counts = torch.histc(u, bins=50, min=0.0, max=1.0)
        expected = u.numel() / 50
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 90, chi2  # 49 degrees of freedom: p < 1e-3 above ~85
        lag1 = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])
        assert abs(lag1) < 0.01, lag1


def test_the_samples_of_a_runs_requests_do_not_replay_each_other():
    """Request and sample seeds are derived with SplitMix64's own increment (``for_request``,
    ``sample_seed``); used as states they made sample j of request r + 1 replay sample j of request
    r one draw later. Among 2000 requests x 16 samples x 8 draws (256,000 24-bit values) chance
    alone repeats ~1,950 values; a replaying stream would repeat most of them."""
    base = SamplingParams(seed=3)
    rngs = [SampleRNG(sample_seed(base.for_request(r).seed, j)) for r in range(2000) for j in range(16)]
    values = (draw_uniforms(rngs, 8) * (1 << 24)).long().flatten()
    num_repeats = values.numel() - values.unique().numel()
    assert num_repeats < 3 * 1950, num_repeats


def test_derived_request_seeds_do_not_collide_with_small_seeds():
    """``tether generate``: a line without a seed gets one derived from --seed and its index; an
    affine derivation sent seed 0's line i to seed i + 1, so a line seeded 1 replayed line 0."""
    derived = [SamplingParams(seed=base).for_request(i).seed for base in range(4) for i in range(1000)]
    assert len(set(derived)) == len(derived)
    assert all(seed >= 1 << 20 for seed in derived)  # far from any seed a person types
