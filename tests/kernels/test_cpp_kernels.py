"""The C++ CPU kernels against the PyTorch reference run in float64.

Focused numeric checks of ``kltriton.kernels.stream.cpp.forward / backward``: odd vocab sizes
(tails shorter than a SIMD vector), long rows, -inf entries and all -inf rows, magnitudes 1e4,
temperatures, SKIP and OUT_OF_RANGE targets, strided views, the three input dtypes,
entropy, full KL and random upstream gradients. Skipped when the backend cannot be built here.
"""
import pytest
import torch

from helpers import MIXED_GRAD_RTOL, assert_close, kernel_backward, kernel_forward, temp
from kltriton.kernels import OUT_OF_RANGE, SKIP, cpp_library
from kltriton.kernels.stream import cpp as cpp_stream
from kltriton.kernels.stream import reference

NEG_INF = float("-inf")


@pytest.fixture(scope="module", autouse=True)
def _cpp():
    ok, why = cpp_library.availability()
    if not ok:
        pytest.skip(f"C++ backend unavailable: {why}")


def _ref_forward(x, y, t, temperature, ent, kl):
    return kernel_forward(reference, x.double(), None if y is None else y.double(), t, temperature, ent, kl)


def _close(actual, expected, rtol, atol, what):
    assert_close(actual, expected, atol, rtol, what)


def _make(shape, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    y = x + torch.randn(*shape, generator=g) * (0.5 * scale)
    return x.to(dtype), y.to(dtype)


def _targets(n, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (n,), generator=g)
    if n >= 3:
        t[1] = SKIP
        t[-1] = OUT_OF_RANGE
    return t


def _check(x, y, t, temperature, ent, kl, grad_rtol, seed=2, out_rtol=2e-5):
    """Forward and backward of the C++ backend against the float64 reference."""
    got = kernel_forward(cpp_stream, x, y, t, temp(temperature), ent, kl)
    exp = _ref_forward(x, y, t, temp(temperature), ent, kl)
    n = t.numel()
    for name in got._fields:
        a, e = getattr(got, name), getattr(exp, name)
        assert a.dtype == torch.float32 and a.shape == e.shape, name
        if a.numel():
            scale = 1e-5 * max(1.0, x.float().abs().nan_to_num(0, 0, 0).max().item() / temperature)
            _close(a, e, out_rtol, scale, name)
    assert (got.logp[t >= 0].nan_to_num(0.0) <= 0).all()
    # backward with random upstream grads, stats from the C++ forward fed to both
    g = torch.Generator().manual_seed(seed)
    gl = torch.randn(n, generator=g)
    ge = torch.randn(n, generator=g) if ent else None
    gk = torch.randn(n, generator=g) if kl else None
    grad = kernel_backward(cpp_stream, x, y, t, temp(temperature), got, gl, ge, gk)
    assert grad.dtype == x.dtype and grad.shape == x.shape and grad.is_contiguous()
    dbl = lambda v: None if v is None else v.double()  # noqa: E731
    eg = kernel_backward(reference, x.double(), dbl(y), t, temp(temperature), type(got)(*map(dbl, got)), dbl(gl),
                         dbl(ge), dbl(gk))
    atol = 1e-6 + grad_rtol * eg.abs().nan_to_num(0, 0, 0).max().item() * 1e-2
    _close(grad, eg, grad_rtol, atol, "grad")
    rows = grad.reshape(-1, x.shape[-1])
    assert (rows[t < 0] == 0).all()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 7, 1001), (41, 4099), (4, 5), (6, 16), (5, 33)])
def test_forward_backward_matrix(shape, dtype):
    x, y = _make(shape, dtype)
    xf = x.reshape(-1, shape[-1])
    xf[0, 3] = NEG_INF  # a -inf entry in policy and reference
    y.reshape(-1, shape[-1])[0, 3] = NEG_INF
    n = xf.shape[0]
    t = _targets(n, shape[-1])
    _check(x, y, t, 0.7, True, True, MIXED_GRAD_RTOL[dtype])
    _check(x, None, t, 1.0, False, False, MIXED_GRAD_RTOL[dtype])
    _check(x, None, t, 1.3, True, False, MIXED_GRAD_RTOL[dtype])
    _check(x, y, t, 1.0, False, False, MIXED_GRAD_RTOL[dtype])


def test_long_rows_two_rows():
    x, y = _make((2, 70001), torch.float32)
    t = torch.tensor([70000, 12345])
    _check(x, y, t, 0.7, True, True, 2e-4)


def test_large_magnitudes():
    x, y = _make((9, 3001), torch.float32, scale=1e4)
    t = _targets(9, 3001)
    _check(x, None, t, 0.7, True, False, 1e-3, out_rtol=1e-5)
    _check(x, y, t, 1.0, False, False, 1e-3, out_rtol=1e-5)
    # With the full KL the gradient has p * (log p - log q - KL), a cancellation of terms of
    # size |x| / T evaluated in fp32 (~1e-7 * 1e4 absolute), inherent to fp32 statistics.
    _check(x, y, t, 0.7, True, True, 1e-2, out_rtol=1e-5)


def test_neg_inf_rows_and_entries():
    x, y = _make((6, 257), torch.float32)
    x[2] = NEG_INF  # an all -inf row: NaN outputs, lse -inf, zero gradient
    x[3, ::2] = NEG_INF  # half the vocab masked in the policy only
    y[4, 1::2] = NEG_INF  # reference -inf where the policy has mass: full KL = +inf
    t = torch.tensor([0, 5, 7, 8, 9, 10])
    t[3] = 0  # label on a -inf logit: logp = -inf
    got = _check(x, y, t, 0.7, True, False, 2e-4)
    assert torch.isnan(got.logp[2]) and torch.isnan(got.entropy[2]) and got.lse[2] == NEG_INF
    assert got.logp[3] == NEG_INF
    kl = kernel_forward(cpp_stream, x, y, t, temp(0.7), full_kl=True).full_kl
    exp = _ref_forward(x, y, t, temp(0.7), False, True).full_kl
    _close(kl, exp, 1e-4, 1e-5, "full_kl")
    assert kl[4] == float("inf") and torch.isnan(kl[2])


def test_skipped_rows_are_not_read():
    x, y = _make((5, 100), torch.float32)
    t = torch.tensor([SKIP, 3, OUT_OF_RANGE, 4, SKIP])
    x[t < 0] = float("nan")  # a row that were read would give NaN everywhere
    y[t < 0] = float("nan")
    got = kernel_forward(cpp_stream, x, y, t, temp(1.0), True, True)
    for name in ("logp", "entropy", "ref_logp", "full_kl"):
        v = getattr(got, name)
        assert (v[[0, 4]] == 0).all() and torch.isnan(v[2]) and torch.isfinite(v[[1, 3]]).all(), name
    assert (got.lse[[0, 2, 4]] == 0).all()
    grad = kernel_backward(cpp_stream, x, y, t, temp(1.0), got, torch.ones(5), torch.ones(5), torch.ones(5))
    assert (grad[t < 0] == 0).all() and torch.isfinite(grad[t >= 0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_views(dtype):
    full, yfull = _make((3, 9, 515), dtype)
    x = full[:, :-1]  # [B, T-1, V] view with a row stride gap
    y = yfull.contiguous()[:, 1:]  # other strides than x
    assert not x.is_contiguous()
    t = _targets(3 * 8, 515)
    _check(x, y, t, 0.7, True, True, MIXED_GRAD_RTOL[dtype])
    # reference logits contiguous while the policy is a view
    _check(x, yfull[:, :-1].contiguous(), t, 1.0, True, True, MIXED_GRAD_RTOL[dtype])
    # transposed leading dims (unmergeable strides)
    xt = full.transpose(0, 1)
    _check(xt, yfull.transpose(0, 1), _targets(27, 515), 1.0, True, True, MIXED_GRAD_RTOL[dtype])


def test_empty_and_single_element_vocab():
    x = torch.randn(0, 7)
    got = kernel_forward(cpp_stream, x, x, torch.empty(0, dtype=torch.long), temp(1.0), True, True)
    assert all(v.numel() == 0 for v in got)
    g = kernel_backward(cpp_stream, x, None, torch.empty(0, dtype=torch.long), temp(1.0), got, got.logp)
    assert g.shape == (0, 7)
    x1 = torch.randn(3, 1)
    got = kernel_forward(cpp_stream, x1, None, torch.zeros(3, dtype=torch.long), temp(1.0), entropy=True)
    assert (got.logp == 0).all() and (got.entropy.abs() < 1e-6).all()


def test_nan_logits_give_nan():
    x = torch.randn(3, 100)
    x[1, 50] = float("nan")
    x[2, 7] = float("inf")
    got = kernel_forward(cpp_stream, x, None, torch.tensor([0, 1, 2]), temp(1.0), entropy=True)
    assert torch.isfinite(got.logp[0]) and torch.isnan(got.logp[1:]).all() and torch.isnan(got.entropy[1:]).all()
    g = kernel_backward(cpp_stream, x, None, torch.tensor([0, 1, 2]), temp(1.0), got, torch.ones(3))
    assert torch.isfinite(g).all()


def test_gradient_buffers_are_reused_never_shared():
    """Large gradients (>= 8 MiB) come from a one-block cache (csrc/gradient_buffer.cpp): a freed
    gradient's memory serves the next call, a live one is never handed out again, and a reused
    buffer holds exactly the new gradient (checked on a few rows against float64). 100 MB: larger
    than any other gradient of the suite, so the block this test frees is the one that is kept."""
    n, v = 128, 200_000
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, v, generator=gen) * 3
    t = torch.randint(0, v, (n,), generator=gen)
    rows = torch.tensor([0, 1, 77, n - 1])

    def grad(seed):
        g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        stats = kernel_forward(cpp_stream, x, None, t, temp(1.0))
        out = kernel_backward(cpp_stream, x, None, t, temp(1.0), stats, g)
        picked = type(stats)(*(v[rows].double() if v.numel() else v for v in stats))
        expected = kernel_backward(reference, x[rows].double(), None, t[rows], temp(1.0), picked, g[rows].double())
        return out, expected

    first, _ = grad(1)
    kept = first[rows].clone()
    second, second_expected = grad(2)  # `first` is alive: new memory
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first[rows], kept)
    address = first.data_ptr()
    del first
    third, third_expected = grad(3)  # `first` was freed: its block is reused
    assert third.data_ptr() == address
    for got, expected in ((second, second_expected), (third, third_expected)):
        assert_close(got[rows], expected, atol=1e-6, rtol=1e-5, what="gradient in a reused buffer")
