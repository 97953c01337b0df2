"""hugehead.integrations.verl.linear_cross_entropy: verl's fused-kernel signature and results (per-token
log-probs and entropies, their gradients) against float64 PyTorch on one process; across ranks (the vocabulary
split over them) in tests/test_distributed.py."""
import pytest
import torch

from hugehead.integrations.verl import linear_cross_entropy


def _reference(hidden, weight, labels, temperature):
    lp = torch.log_softmax(hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().T / temperature, -1)
    return lp.gather(1, labels.reshape(-1, 1))[:, 0], torch.special.entr(lp.exp()).sum(1)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, None])
def test_matches_float64_with_gradients(reduction, temperature):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 300, (2, 7), generator=g)
    up = torch.randn(2, 14, generator=g, dtype=torch.float64)
    logprobs, entropy = linear_cross_entropy(hidden, weight, labels, temperature, reduction)
    ref_lp, ref_h = _reference(hidden, weight, labels, 1.0 if temperature is None else temperature)
    ref_lp = {"none": ref_lp, "sum": ref_lp.sum(), "mean": ref_lp.mean()}[reduction]
    torch.testing.assert_close(logprobs, ref_lp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy, ref_h, rtol=1e-10, atol=1e-12)
    assert entropy.shape == (14,) and logprobs.shape == ((14,) if reduction == "none" else ())
    w = up[0] if reduction == "none" else up[0, 0]
    got = torch.autograd.grad((logprobs * w).sum() + (entropy * up[1]).sum(), [hidden, weight])
    ref = torch.autograd.grad((ref_lp * w).sum() + (ref_h * up[1]).sum(), [hidden, weight])
    for a, r in zip(got, ref):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_bad_arguments_raise():
    hidden, weight, labels = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 5])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels.clamp(max=4), reduction="batchmean")
    with pytest.raises(ValueError, match="target 5 at row 2"):
        linear_cross_entropy(hidden, weight, labels)
