import math

import torch

from tether.algorithms import KL_ESTIMATORS
from tether.algorithms.kl import k1, k2, k3


def test_hand_computed_values():
    # pi = 0.5, pi_ref = 0.25: d = log(pi_ref / pi) = -ln 2.
    # k1 = ln 2 = 0.693147; k2 = (ln 2)^2 / 2 = 0.240227; k3 = 0.5 + ln 2 - 1 = 0.193147.
    logp = torch.tensor([[math.log(0.5)]])
    logp_ref = torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2)
    torch.testing.assert_close(k1(logp, logp_ref), torch.tensor([[ln2]]))
    torch.testing.assert_close(k2(logp, logp_ref), torch.tensor([[ln2**2 / 2]]))
    torch.testing.assert_close(k3(logp, logp_ref), torch.tensor([[0.5 + ln2 - 1]]))


def test_k3_is_nonnegative_and_zero_at_equality_while_k1_can_be_negative():
    logp = torch.tensor([[-1.0, -2.0, -0.3]])
    logp_ref = torch.tensor([[-1.0, -0.5, -3.0]])
    out = k3(logp, logp_ref)
    assert out[0, 0].item() == 0.0
    assert (out >= 0).all()
    assert k1(logp, logp_ref)[0, 1].item() < 0


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    # Sample from pi, average the estimators, compare with the exact KL(pi || ref) of two categoricals.
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.3, 0.5])
    exact = (pi * (pi / ref).log()).sum()  # 0.274887
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logp_ref = pi.log()[samples], ref.log()[samples]
    torch.testing.assert_close(k1(logp, logp_ref).mean(), exact, atol=0.01, rtol=0)
    torch.testing.assert_close(k3(logp, logp_ref).mean(), exact, atol=0.01, rtol=0)


def test_mask_zeros_padding_and_keeps_gradients_finite():
    logp = torch.tensor([[-0.5, float("-inf")]], requires_grad=True)
    logp_ref = torch.tensor([[-0.7, float("-inf")]])
    mask = torch.tensor([[True, False]])
    for name in KL_ESTIMATORS.names():
        out = KL_ESTIMATORS.get(name)(logp, logp_ref, mask)
        assert out[0, 1].item() == 0.0
        out.sum().backward()
        assert torch.isfinite(logp.grad).all()
        logp.grad = None


def test_k3_gradient_matches_its_formula():
    # d k3 / d logp = -exp(ref - logp) + 1; at logp = ln 0.5, ref = ln 0.25: -0.5 + 1 = 0.5.
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    k3(logp, torch.tensor([math.log(0.25)])).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.5]))


def test_as_a_loss_k2_pulls_toward_kl_pi_ref_k3_toward_kl_ref_pi_and_k1_nowhere():
    """The expected gradient over samples of pi, summed exactly over a small vocabulary: why
    algorithm.kl_estimator=k1 is refused as a loss term (verl's kl_loss_type=kl pitfall)."""
    gen = torch.Generator().manual_seed(0)
    theta, ref_logits = torch.randn(6, generator=gen, requires_grad=True), torch.randn(6, generator=gen)
    logp_ref = torch.log_softmax(ref_logits, -1)

    def expected_gradient(estimator) -> torch.Tensor:
        logp = torch.log_softmax(theta, -1)
        # E_{x ~ pi}[grad k(x)]: pi(x) weights the per-sample gradients, itself not differentiated
        (grad,) = torch.autograd.grad((logp.exp().detach() * estimator(logp, logp_ref)).sum(), theta)
        return grad

    def exact(kl) -> torch.Tensor:
        (grad,) = torch.autograd.grad(kl(torch.log_softmax(theta, -1)), theta)
        return grad

    forward_kl = exact(lambda logp: (logp.exp() * (logp - logp_ref)).sum())  # KL(pi || ref)
    reverse_kl = exact(lambda logp: (logp_ref.exp() * (logp_ref - logp)).sum())  # KL(ref || pi)
    assert torch.allclose(expected_gradient(k1), torch.zeros(6), atol=1e-6)
    assert torch.allclose(expected_gradient(k2), forward_kl, atol=1e-6)
    assert torch.allclose(expected_gradient(k3), reverse_kl, atol=1e-6)
