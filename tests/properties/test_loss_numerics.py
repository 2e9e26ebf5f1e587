"""The fused loss kernels on extreme inputs against the float64 reference: masked logits (``finfo.min``, ``-1e30``,
``-inf``) across streaming blocks, a ``-max`` / ``+max`` row, temperatures, every dtype, with the entropy and
full-KL terms of the gradient and TRL's bias-corrected KL; a vocabulary short enough for the C++ kernel to keep
its forward's exponentials for the gradient pass and one too long for it (``kCacheVocab``), each not a multiple
of the vector width."""
import pytest
import torch

from helpers import MIXED_GRAD_RTOL, assert_close, temp
from kltriton import dispatch
from kltriton.kernels.loss import LossInputs, terms
from masked_rows import MASKS, masked_rows


def _inputs(n, logp, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp)) - 0.2 * torch.randn(n, generator=gen)
    w = torch.rand(n, generator=gen)
    return LossInputs(old, torch.randn(n, generator=gen), w, 0.1 * w, -0.05 * w, None)


def _check(backend, x, y, targets, temperature, loss_type, estimator, dtype):
    t = temp(temperature)
    hp = terms.hyperparameters("cpu", ratio_low=0.8, ratio_high=1.28, delta=1.5, tau_pos=1.0, tau_neg=1.05,
                               kl_ratio=1.0, dual_clip=3.0 if loss_type == "ppo" else None)
    ref = dispatch.implementation("loss", "reference")
    probe, _ = ref.forward(x.double(), y.double(), targets, t, _inputs(len(targets), torch.zeros(len(targets))),
                           hp, loss_type, estimator, True, False)
    inputs = _inputs(len(targets), probe.logp.float())
    want, want_grad = ref.forward(x.double(), y.double(), targets, t, inputs, hp, loss_type, estimator, True, True)
    stats, grad = dispatch.implementation("loss", backend).forward(x, y, targets, t, inputs, hp, loss_type,
                                                                   estimator, True, True)
    assert grad.dtype == dtype
    fin = torch.isfinite(want.logp)
    assert_close(stats.logp[fin], want.logp[fin], 1e-4 * (1 + want.logp[fin].abs().max().item()), 1e-5,
                 what=f"{backend} logp")
    # Finite and exact wherever the float64 gradient is finite (an infinite KL, e.g. a reference of -inf where
    # the policy has mass in fp16, has no finite gradient to compare with).
    fin = torch.isfinite(want_grad)
    assert bool(torch.isfinite(grad[fin]).all()), f"{backend}: non-finite gradient where float64 is finite"
    size = want_grad[fin].abs().max().item()
    rtol = MIXED_GRAD_RTOL[dtype]
    assert_close(grad.float()[fin], want_grad[fin], rtol * size / 4 + 1e-6, rtol, what=f"{backend} {loss_type} grad")


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("loss_type, estimator", [("ppo", "k3"), ("sapo", "full")])
def test_fused_loss_on_masked_logits(backend, dtype, mask, temperature, loss_type, estimator):
    if dtype == torch.float16 and mask == "neg_1e30":
        pytest.skip("-1e30 is not an fp16 value")
    value = MASKS[mask] if MASKS[mask] is not None else torch.finfo(dtype).min
    x, y, targets = masked_rows(dtype, value, with_max_row=mask != "neg_inf")
    targets[3] = 50  # not a banned token: the loss of a token of probability 0 is infinite
    _check(backend, x, y, targets, temperature, loss_type, estimator, dtype)


@pytest.mark.parametrize("vocab", [4099, 70001])  # kept exponentials (C++), recomputed ones
def test_fused_loss_long_and_short_rows(backend, vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=gen) * 4
    y = x + torch.randn(5, vocab, generator=gen)
    x[1, ::7] = float("-inf")
    targets = torch.tensor([0, 1, vocab - 1, 12, -1])
    _check(backend, x, y, targets, 0.8, "ppo", "k3", torch.float32)
