"""The loss derivative per row, written three times (``terms.SLOPES``, C++ ``row_g_logp``, Triton
``_row_g_logp``), held against autograd through the formulas (``terms.objective``) in float64 and against
each other, for every fused loss type and estimator.

Tolerances: the C++ and Triton kernels compute in float64 from fp32 inputs and round the result to fp32,
so they agree with the float64 formula to a few fp32 ulps of the result (plus the fp32 rounding of the
log-ratio, which every backend applies alike)."""
import zlib

import pytest
import torch

from helpers import assert_close
from kltriton import dispatch, estimators
from kltriton.kernels.loss import LossInputs, terms

N = 257
ESTIMATOR_NAMES = ("", "k1", "abs", "k2", "k3", "k1+", "k3+", "abs+")


def rows(seed, on_policy=False):
    """Log-probs with old log-probs around them (ratios on both sides of the clip range and beyond the
    log-ratio clamp), advantages of both signs, and reference log-probs."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, generator=gen) * 6
    jitter = torch.randn(N, generator=gen) * 0.3
    jitter[:4] = torch.tensor([25.0, -25.0, 0.0, 0.1])  # beyond the +-20 log-ratio clamp, a tie, a small step
    old = None if on_policy else logp - jitter
    adv = torch.randn(N, generator=gen)
    w = torch.rand(N, generator=gen)
    ref = logp + torch.randn(N, generator=gen) * 0.7
    inputs = LossInputs(old, adv, w, 0.1 * w, -0.01 * w, ref)
    return logp, ref, inputs


def hp(loss_type, kl_clamp):
    return terms.hyperparameters("cpu", ratio_low=0.8, ratio_high=1.28,
                                 dual_clip=3.0 if loss_type == "ppo" else float("inf"), kl_clamp=kl_clamp)


def autograd_g_logp(loss_type, estimator, logp, ref, inputs, params):
    """d loss / d logp by autograd through ``terms.token_terms`` / ``objective`` in float64."""
    x = logp.double().requires_grad_()
    inputs64 = LossInputs(*(None if t is None else t.double() for t in inputs))
    old = inputs64.old_logp if inputs64.old_logp is not None else x.detach()
    est = estimators.parse(estimator) if estimator else None
    token = terms.token_terms(loss_type, est, x, inputs64.ref_logp, None, old, inputs64.advantages, params,
                              torch.ones(N, dtype=torch.bool))
    loss = terms.objective(token, torch.zeros_like(x), inputs64.w_pg, inputs64.w_kl, inputs64.w_ent).sum()
    return torch.autograd.grad(loss, x)[0]


def implementations():
    found = [("reference", lambda *a: _python(*a))]
    for backend in ("cpp", "triton"):
        usable, why = dispatch.availability(backend, "loss")
        if usable:
            found.append((backend, dispatch.implementation("loss", backend).coefficients))
    return found


def _python(logp, ref, inputs, params, loss_type, estimator):
    est = estimators.parse(estimator) if estimator else None
    return terms.coefficients(loss_type, est, logp, ref, inputs, params)[0]


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATOR_NAMES)
@pytest.mark.parametrize("loss_type", terms.FUSED)
def test_three_implementations_agree_with_autograd(loss_type, estimator, on_policy):
    logp, ref, inputs = rows(zlib.crc32(f"{loss_type}{estimator}{on_policy}".encode()), on_policy)
    for kl_clamp in (float("inf"), 0.05):
        params = hp(loss_type, kl_clamp)
        want = autograd_g_logp(loss_type, estimator, logp, ref, inputs, params)
        # Ties of the clip's max (ratio exactly at a bound) split the gradient under autograd; none here.
        for name, coefficients in implementations():
            got = coefficients(logp, ref, inputs, params, loss_type, estimator)
            assert_close(got, want, atol=1e-6 * (1 + want.abs().max().item()), rtol=4e-7,
                         what=f"{name} {loss_type} {estimator!r} clamp={kl_clamp}")


def test_fused_names_are_implemented_everywhere():
    """Every fused loss type has a slope in Python; the kernels reject an unknown name clearly."""
    assert set(terms.SLOPES) == set(terms.FUSED)
    logp, ref, inputs = rows(0)
    for name, coefficients in implementations()[1:]:
        with pytest.raises(Exception, match="loss_type|LOSS_TYPE|gspo"):
            coefficients(logp, ref, inputs, hp("ppo", float("inf")), "gspo", "")
