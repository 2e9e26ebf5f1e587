"""The loss derivative per row, written three times (``terms.SLOPES``, C++ ``row_g_logp``, Triton
``_row_g_logp``), held against autograd through the formulas (``terms.token_terms`` / ``objective``) in float64
and against each other, for every fused formula and estimator, with and without TRL's bias-corrected KL, with
verl's log-ratio clamp (20) and without one (TRL's and torchrl's ratio).

Tolerances: the C++ and Triton kernels compute in float64 from fp32 inputs and round the result to fp32,
so they agree with the float64 formula to a few fp32 ulps of the result (plus the fp32 rounding of the
log-ratio, which every backend applies alike: a relative 6e-8 * |log-ratio| of an unclamped ratio)."""
import math
import zlib

import pytest
import torch

from helpers import assert_close
from kltriton import dispatch, estimators
from kltriton.kernels.loss import LossInputs, terms

N = 257
ESTIMATOR_NAMES = ("", "k1", "abs", "k2", "k3", "k1+", "k3+", "abs+", "full")
# (on-policy, kl_clamp, kl_ratio, delta): the plain loss, a clamped bias-corrected KL with TRL's delta below the
# clip's upper bound (both branches of the PPO max carry a gradient), and an on-policy bias-corrected KL.
SETTINGS = ((False, float("inf"), 0.0, float("inf")), (False, 0.05, 1.0, 1.1), (True, float("inf"), 1.0, 1.5))


def rows(seed, on_policy=False):
    """Log-probs with old log-probs around them (ratios on both sides of the clip range and beyond the
    log-ratio clamp), advantages of both signs, reference log-probs and full-KL values."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, generator=gen) * 6
    logp[4:40] = -torch.rand(36, generator=gen) * 0.3  # likely tokens: DPPO's divergences leave the trust region
    jitter = torch.randn(N, generator=gen) * 0.3
    jitter[:4] = torch.tensor([25.0, -25.0, 0.0, 0.1])  # beyond the +-20 log-ratio clamp, a tie, a small step
    old = None if on_policy else logp - jitter
    adv = torch.randn(N, generator=gen)
    w = torch.rand(N, generator=gen)
    ref = logp + torch.randn(N, generator=gen) * 0.7
    full_kl = torch.rand(N, generator=gen)
    inputs = LossInputs(old, adv, w, 0.1 * w, -0.01 * w, ref)
    return logp, ref, full_kl, inputs


def hp(loss_type, kl_clamp, kl_ratio, delta, log_ratio_clamp=20.0):
    return terms.hyperparameters("cpu", ratio_low=0.8, ratio_high=1.28,
                                 dual_clip=3.0 if loss_type == "ppo" else None, kl_clamp=kl_clamp, kl_ratio=kl_ratio,
                                 delta=delta, tau_pos=1.0, tau_neg=1.05, clip_ratio_c=1.2, dro_beta=0.3,
                                 log_ratio_clamp=log_ratio_clamp)


def autograd_g_logp(loss_type, estimator, logp, ref, full_kl, inputs, params):
    """d loss / d logp by autograd through ``terms.token_terms`` / ``objective`` in float64."""
    x = logp.double().requires_grad_()
    inputs64 = LossInputs(*(None if t is None else t.double() for t in inputs))
    old = inputs64.old_logp if inputs64.old_logp is not None else x.detach()
    est = estimators.parse(estimator) if estimator else None
    token = terms.token_terms(loss_type, est, x, inputs64.ref_logp, full_kl.double(), old, inputs64.advantages,
                              params, torch.ones(N, dtype=torch.bool))
    loss = terms.objective(token, torch.zeros_like(x), inputs64.w_pg, inputs64.w_kl, inputs64.w_ent).sum()
    if not loss.requires_grad:  # kl_only without a KL term: the loss does not depend on the log-probs
        return torch.zeros_like(x)
    return torch.autograd.grad(loss, x)[0]


def implementations():
    found = [("reference", _python)]
    for backend in ("cpp", "triton"):
        usable, why = dispatch.availability(backend, "loss")
        if usable:
            found.append((backend, dispatch.implementation("loss", backend).coefficients))
    return found


def _python(logp, ref, inputs, params, loss_type, estimator, full_kl):
    est = estimators.parse(estimator) if estimator else None
    return terms.coefficients(loss_type, est, logp, ref, inputs, params, full_kl)[0]


@pytest.mark.parametrize("log_ratio_clamp", [20.0, math.inf], ids=["verl-clamp", "no-clamp"])
@pytest.mark.parametrize("estimator", ESTIMATOR_NAMES)
@pytest.mark.parametrize("loss_type", terms.FUSED)
def test_three_implementations_agree_with_autograd(loss_type, estimator, log_ratio_clamp):
    for on_policy, kl_clamp, kl_ratio, delta in SETTINGS:
        logp, ref, full_kl, inputs = rows(zlib.crc32(f"{loss_type}{estimator}{on_policy}".encode()), on_policy)
        params = hp(loss_type, kl_clamp, kl_ratio, delta, log_ratio_clamp)
        want = autograd_g_logp(loss_type, estimator, logp, ref, full_kl, inputs, params)
        # The absolute tolerance from the rows of ordinary size: an unclamped ratio of exp(25) on rows 0-1 would
        # make it meaningless for the others (those two are held to the relative tolerance).
        scale = want[2:].abs().max().item()
        rtol = 4e-7 if log_ratio_clamp == 20.0 else 2e-6
        # Ties of the clip's max (ratio exactly at a bound) split the gradient under autograd; none here.
        for name, coefficients in implementations():
            got = coefficients(logp, ref, inputs, params, loss_type, estimator, full_kl)
            assert_close(got, want, atol=1e-6 * (1 + scale), rtol=rtol,
                         what=f"{name} {loss_type} {estimator!r} clamp={kl_clamp} kl_ratio={kl_ratio} "
                              f"on_policy={on_policy} log_ratio_clamp={log_ratio_clamp}")


@pytest.mark.parametrize("loss_type", terms.FUSED)
def test_log_ratio_clamp_is_a_runtime_value(loss_type):
    """The clamp is a slot of the hyperparameter vector on every backend: a log-ratio of +-22 gets verl's slope (0
    beyond the clamp of 20) or, without a clamp, the slope of the unclamped ratio (exp(22) for PPO's unclipped
    branch under a negative advantage); a log-ratio inside the clamp is the same either way."""
    logp = torch.tensor([-1.0, -30.0, -1.0, -30.0, -1.0, -2.0])
    old = logp - torch.tensor([22.0, -22.0, 22.0, -22.0, 0.3, -0.1])
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0, -0.5, 0.7])
    w = torch.ones(6)
    inputs = LossInputs(old, adv, w, 0 * w, 0 * w, None)
    for name, coefficients in implementations():
        clamped, free = (coefficients(logp, logp, inputs, terms.hyperparameters(
            "cpu", ratio_low=0.8, ratio_high=1.28, log_ratio_clamp=c, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
            dro_beta=0.3), loss_type, "", logp) for c in (20.0, math.inf))
        assert torch.equal(clamped[4:], free[4:]), name
        if loss_type in ("ppo", "sapo", "dppo_tv", "dppo_kl"):  # their slope goes through the ratio out there
            assert not torch.equal(clamped[:4], free[:4]), (name, loss_type)
        if loss_type == "ppo":
            assert clamped[0] == 0 and free[0] == pytest.approx(math.exp(22.0), rel=1e-6), (name, clamped, free)


def test_an_overflowing_unclamped_ratio_gives_no_nan():
    """Without a clamp a log-ratio of 800 overflows the ratio to +inf even in float64: a slope that is 0 there (a
    clip, the dual clip, SAPO's saturated gate) stays 0 on every backend, never 0 * inf = NaN."""
    logp = torch.full((6,), -1.0)
    old = logp - torch.tensor([800.0, 800.0, 800.0, -800.0, 800.0, 0.0])
    adv = torch.tensor([1.0, -1.0, 0.5, 1.0, -2.0, 1.0])
    w = torch.ones(6)
    inputs = LossInputs(old, adv, w, 0 * w, 0 * w, None)
    for loss_type, expected in (("ppo", [0.0, 0.0, 0.0, 0.0, 0.0, -1.0]), ("sapo", [0.0, 0.0, 0.0, 0.0, 0.0, -1.0]),
                                ("clipped_ratio", [0.0, 0.0, 0.0, 0.0, 0.0, -1.0])):
        params = hp(loss_type, math.inf, 0.0, math.inf, math.inf)  # ppo: the dual clip (3.0) holds A < 0
        for name, coefficients in implementations():
            got = coefficients(logp, logp, inputs, params, loss_type, "", logp)
            assert torch.equal(got, torch.tensor(expected)), (name, loss_type, got)


def test_the_cases_are_not_trivial():
    """Every fused formula's slope takes zero and nonzero values on these rows (a clip, a dual clip, a trust
    region or a truncation is hit somewhere), so the parity test can fail."""
    logp, ref, full_kl, inputs = rows(1)
    for loss_type in terms.FUSED:
        if loss_type == "kl_only":  # no policy term by definition: its slope is 0 everywhere
            continue
        got = _python(logp, ref, inputs, hp(loss_type, float("inf"), 0.0, 1.1), loss_type, "", full_kl)
        ratio = torch.exp(logp - inputs.old_logp)
        slope = got / (inputs.w_pg * inputs.advantages)
        assert (got != 0).sum() > N // 4, loss_type
        if loss_type not in ("gpg", "dro", "sapo"):  # these have no flat region
            assert (got == 0).any() or not torch.allclose(slope.abs(), ratio), loss_type


def test_fused_names_are_implemented_everywhere():
    """Every fused formula has a slope in Python; the kernels reject an unknown name clearly."""
    assert set(terms.SLOPES) == set(terms.FUSED)
    logp, ref, full_kl, inputs = rows(0)
    for name, coefficients in implementations()[1:]:
        with pytest.raises(Exception, match="loss_type|LOSS_TYPE|gspo"):
            coefficients(logp, ref, inputs, hp("ppo", float("inf"), 0.0, float("inf")), "gspo", "", full_kl)
