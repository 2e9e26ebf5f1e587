"""Extreme inputs on every backend against the float64 reference.

- Logits masked with ``finfo(dtype).min``, ``-1e30`` or ``-inf`` (vocab padding, banned tokens), a row
  that is ``-max`` everywhere and ``+max`` at one token, masks that end or start a streaming block (so the
  kernels rescale their running sums by factors that underflow to 0 while the shift overflows): every
  statistic and gradient finite and exact wherever the float64 answer is finite.
- The reference backend as exact as torch's own fp32 ``log_softmax`` (logits ~200, +-1e30 with ties).
- NaN / +inf logits: NaN statistics on every backend, and one gradient rule (zero on a row whose lse is
  not finite).
"""
import math

import pytest
import torch

from helpers import MIXED_GRAD_RTOL, assert_close, kernel_backward, kernel_forward, temp
from kltriton import dispatch
from kltriton.kernels import statistics
from kltriton.kernels.stream import reference

from masked_rows import MASKS, VOCAB, masked_rows  # noqa: E402


def _impl(backend):
    return dispatch.implementation("stream", backend)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_masked_logits_finite_and_exact(backend, dtype, mask, temperature):
    if dtype == torch.float16 and mask == "neg_1e30":
        pytest.skip("-1e30 is not an fp16 value")
    mask_value = torch.finfo(dtype).min if MASKS[mask] is None else MASKS[mask]
    # |logits| / T must stay inside the fp32 range: the +max row only with T >= 1.
    x, y, t = masked_rows(dtype, mask_value, with_max_row=temperature >= 1.0)
    if dtype == torch.float16:
        y[4, 1::3] = torch.finfo(dtype).min
    impl = _impl(backend)
    got = kernel_forward(impl, x, y, t, temp(temperature), True, True)
    exp = kernel_forward(reference, x.double(), y.double(), t, temp(temperature), True, True)
    for name in ("logp", "entropy", "ref_logp", "full_kl"):
        # The float64 answer rounded to fp32: a log-prob of a token masked with finfo.min at T < 1
        # is below -finfo.max, so -inf in fp32.
        a, e = getattr(got, name), getattr(exp, name).float()
        assert torch.isfinite(a[torch.isfinite(e)]).all(), f"{name}: {a}"
        assert_close(a, e, 2e-4, 2e-5, what=name)

    gen = torch.Generator().manual_seed(1)
    gl, ge, gk = (torch.randn(7, generator=gen) for _ in range(3))
    finite_kl = torch.isfinite(exp.full_kl)
    gk = torch.where(finite_kl, gk, torch.zeros_like(gk))  # an infinite KL has no finite gradient
    grad = kernel_backward(impl, x, y, t, temp(temperature), got, gl, ge, gk)
    assert torch.isfinite(grad.float()).all()
    dbl = lambda v: v.double()  # noqa: E731
    expected = kernel_backward(reference, x.double(), y.double(), t, temp(temperature),
                               exp._replace(full_kl=exp.full_kl.nan_to_num(posinf=0.0)), dbl(gl), dbl(ge), dbl(gk))
    assert_close(grad, expected, 1e-5, MIXED_GRAD_RTOL[dtype], what="grad")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_as_exact_as_torch_log_softmax(temperature):
    """The reference backend is the oracle and the fallback: at logits ~200 its fp32 log-probs are at least as
    exact as torch's own fp32 ``log_softmax(x / T)`` against float64 (it is torch's ``log_softmax`` of
    ``(x - max) / T``)."""
    for seed in range(4):
        x = torch.randn(16, 1000, generator=torch.Generator().manual_seed(seed)) * 3 + 199
        t = torch.arange(16)
        exact = kernel_forward(reference, x.double(), None, t, temp(temperature)).logp
        ours = kernel_forward(reference, x, None, t, temp(temperature)).logp
        torch_err = (torch.log_softmax(x / temperature, -1)[t, t].double() - exact).abs().max()
        assert (ours.double() - exact).abs().max() <= torch_err


def test_huge_ties_give_minus_log_ties(backend):
    """+-1e30 with three tied maxima: log p = -log 3 and entropy log 3 to fp32 rounding, every backend."""
    x = torch.full((2, 50), -1e30)
    x[:, [3, 17, 40]] = 1e30
    got = kernel_forward(_impl(backend), x, None, torch.tensor([17, 5]), temp(1.0), entropy=True)
    assert abs(got.logp[0].item() + math.log(3)) < 1e-6 and got.logp[1].item() == torch.tensor(-2e30).item()
    assert abs(got.entropy[0].item() - math.log(3)) < 1e-6


def test_nan_and_inf_logits_propagate_and_share_one_gradient_rule(backend):
    """A NaN or +inf logit: NaN statistics (never a silent 0). A row whose lse is not finite (NaN, +inf,
    or -inf for an all -inf row) gets a zero gradient; the other rows are untouched."""
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    x[1, 50] = float("nan")
    x[2, 7] = float("inf")
    x[3] = float("-inf")
    t = torch.tensor([0, 1, 2, 3])
    got = kernel_forward(_impl(backend), x, y, t, temp(1.0), True, True)
    for name in ("logp", "entropy", "full_kl"):
        v = getattr(got, name)
        assert torch.isfinite(v[0]) and torch.isnan(v[1:]).all(), (name, v)
    assert not torch.isfinite(got.lse[1:]).any()
    ones = torch.ones(4)
    grad = kernel_backward(_impl(backend), x, y, t, temp(1.0), got, ones, ones, ones)
    assert (grad[1:] == 0).all() and torch.isfinite(grad[0]).all() and (grad[0] != 0).any()


def _kl_rows(dtype):
    """``[R, V]`` policy / reference rows whose KL terms pass through a log-prob beyond fp32: a ``finfo.min`` logit
    on one side where the other has mass (forward KL, full KL, both), masks that cross the kernels' blocks, and
    ``+-max`` rows (bf16's max is just below fp32's) whose float64 KL is finite in fp32 (the first is exactly 0)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, VOCAB, generator=g) * 2
    y = torch.randn(8, VOCAB, generator=g) * 2
    low, big = torch.finfo(dtype).min, torch.finfo(dtype).max
    x[0, 3] = low                                  # forward KL ~ q_3 * |finfo.min| / T
    y[1, 4100] = low                               # full KL ~ p_4100 * |finfo.min| / T (the second C++ block)
    x[2, 7], y[2, 4400] = low, low
    x[3, ::3] = low                                # the teacher's mass on a third of the masked logits
    x[4, :], y[4, :] = -big, -big                  # +-max, the same rows: KL 0
    x[4, [5, 4321]], y[4, [5, 4321]] = big, big
    x[5, :] = -big                                 # the policy's mass at +max, the reference's -max there:
    x[5, 11], y[5, 11] = big, -big                 # a KL of about max (finite)
    x[6, :4200], y[6, 4200:] = -big, -big          # +-max rows that start and end a block
    x[6, 4300], y[6, 17] = big, big
    x[7] = y[7]                                    # identical rows: exactly 0
    return x.to(dtype), y.to(dtype), torch.zeros(8, dtype=torch.long)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kl_through_a_log_prob_beyond_fp32_is_the_float64_value(backend, dtype, temperature):
    """Issue 33: where a KL's float64 value is finite in fp32, every backend returns it (C++ AVX-512 and Triton
    scaled ``x - max`` by ``log2(e) / T`` before weighting it by the other side's mass, and gave ``+inf``); where it is
    not (a ``+-max`` row at ``T < 1``), ``inf`` or NaN as fp32 has it. The full KL (``KL(p || q)``) and the forward KL
    (``KL(q || p)``); both exactly 0 on identical rows, and never negative."""
    if dtype == torch.float16 and temperature < 1.0:
        pytest.skip("fp16's max over T is an fp32 number: no row here is beyond fp32")
    x, y, t = _kl_rows(dtype)
    for name in ("full_kl", "forward_kl"):
        wanted = statistics.request(ref=True, **{name: True})
        got = _impl(backend).forward(x, y, t, temp(temperature), wanted)
        exp = reference.forward(x.double(), y.double(), t, temp(temperature), wanted)
        a, e = getattr(got, name), getattr(exp, name).float()
        finite = torch.isfinite(e) & torch.isfinite(exp.lse.float()) & torch.isfinite(exp.ref_lse.float())
        # the cases do reach beyond fp32 (fp16's finfo.min does not)
        assert finite[:4].all() and (bool((e[:4] > 1e30).any()) or dtype == torch.float16), (name, e)
        assert_close(a[finite], e[finite], 2e-4, 2e-5, what=name)
        assert bool((a[finite] >= 0).all()) and a[7] == 0 and not torch.signbit(a[7]), (name, a)
