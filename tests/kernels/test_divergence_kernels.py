"""The distillation kernels of every backend against the float64 reference: the ``stream`` family's ``forward_kl``
statistic and the gradient basis's ``q`` term, and the ``divergence`` family (the JSD pass and its gradient);
the reference itself against the dense definitions.

Shapes: an odd vocab, one that splits Triton rows (several programs, the combine kernel), one beyond 65,536
(C++ / reference); ``-inf``, ``finfo.min`` and ``-1e30`` entries; a bf16 student with an fp32 teacher; upstream
gradients that are not 1.
"""
import pytest
import torch

from helpers import MIXED_GRAD_RTOL, assert_close, temp, value_atol
from kltriton import dispatch
from kltriton.kernels import SKIP, statistics
from kltriton.kernels.divergence import reference as divergence_reference
from kltriton.kernels.stream import reference as stream_reference

BETA = torch.tensor(0.3, dtype=torch.float64)


def _vocabs(backend):
    # Triton under the interpreter: 20000 splits a row with a reference into two programs (CHUNK = 16384).
    return (1001, 20000) if backend == "triton" else (1001, 70001)


def rows(vocab, dtype, seed=0, teacher_dtype=None):
    """Student / teacher rows ``[6, V]`` with masked stretches, and targets (one skipped row)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, vocab, generator=gen) * 3
    y = x + torch.randn(6, vocab, generator=gen)
    x[0, :vocab // 2] = torch.finfo(dtype).min   # both masked alike (vocab padding)
    y[0, :vocab // 2] = torch.finfo(dtype).min
    y[1, 7:40] = float("-inf")                   # banned by the teacher: infinite reverse KL
    x[2, 100:150] = float("-inf")                # banned by the student: infinite forward KL
    y[3, 3] = -1e30 if dtype != torch.float16 else torch.finfo(dtype).min
    x[4, ::3] = float("-inf")
    y[4, ::3] = float("-inf")
    target = torch.tensor([5, 9, 17, 300, 2, 0])
    target[5] = SKIP
    return x.to(dtype), y.to(teacher_dtype or dtype), target


def test_reference_is_the_definition():
    """The float64 reference (the oracle of the other tests) against dense float64 PyTorch."""
    x, y, t = rows(301, torch.float32)
    x64, y64 = x.double(), y.double()
    stats = stream_reference.forward(x64, y64, t, temp(0.7), statistics.request(ref=True, forward_kl=True))
    lp, lq = torch.log_softmax(x64 / 0.7, -1), torch.log_softmax(y64 / 0.7, -1)
    live = lq > float("-inf")
    fkl = torch.where(live, lq.exp() * (torch.where(live, lq, 0) - lp), 0.0).sum(-1)
    assert_close(stats.forward_kl[:5], fkl[:5], 1e-12, 1e-12, what="forward_kl")
    jsd, kl_student = divergence_reference.forward(x64, y64, t, temp(0.7), stats.lse, stats.ref_lse, BETA)
    lm = torch.logaddexp(lp + torch.log1p(-BETA), lq + torch.log(BETA))
    kl = lambda a: torch.where(a > float("-inf"), a.exp() * (torch.where(a > float("-inf"), a, 0) - lm), 0.0)  # noqa
    assert_close(kl_student[:5], kl(lp).sum(-1)[:5], 1e-12, 1e-12, what="kl_student")
    assert_close(jsd[:5], (BETA * kl(lq).sum(-1) + (1 - BETA) * kl(lp).sum(-1))[:5], 1e-12, 1e-12, what="jsd")
    assert jsd[5] == 0 and kl_student[5] == 0


@pytest.mark.parametrize("teacher_dtype", [None, torch.float32], ids=["same", "fp32_teacher"])
def test_forward_kl_statistic_and_q_gradient(backend, dtype, teacher_dtype):
    """``forward_kl`` (with the entropy in the same pass) and the gradient of random upstreams on it, the entropy and
    the log-prob: the basis's ``q`` term with the ``p`` / ``log p`` ones."""
    if teacher_dtype == dtype:
        pytest.skip("the same dtype: the 'same' case")
    impl = dispatch.implementation("stream", backend)
    for vocab in _vocabs(backend):
        x, y, t = rows(vocab, dtype, teacher_dtype=teacher_dtype)
        wanted = statistics.request(entropy=True, ref=True, forward_kl=True)
        got = impl.forward(x, y, t, temp(0.8), wanted)
        exp = stream_reference.forward(x.double(), y.double(), t, temp(0.8), wanted)
        for name in ("logp", "lse", "entropy", "ref_logp", "ref_lse", "forward_kl"):
            assert_close(getattr(got, name), getattr(exp, name).float(), 2e-4, 2e-5, what=f"{vocab} {name}")
        assert torch.isinf(got.forward_kl[2]) and not torch.isnan(got.forward_kl).any()
        gen = torch.Generator().manual_seed(1)
        g = {name: torch.randn(6, generator=gen) for name in ("logp", "entropy", "forward_kl")}
        g["forward_kl"][2] = 0.0  # an infinite KL has no finite gradient
        basis = statistics.gradient_basis(g, got, temp(0.8))
        assert basis.q is not None and basis.reads_ref()
        grad = impl.backward(x, y, t, temp(0.8), got.lse, got.ref_lse, basis)
        g64 = {name: value.double() for name, value in g.items()}
        expected = stream_reference.backward(x.double(), y.double(), t, temp(0.8), exp.lse, exp.ref_lse,
                                             statistics.gradient_basis(g64, exp, temp(0.8)))
        assert torch.isfinite(grad.float()).all() and bool((grad[5] == 0).all())
        assert_close(grad, expected, 1e-5, MIXED_GRAD_RTOL[dtype], what=f"{vocab} grad")


@pytest.mark.parametrize("teacher_dtype", [None, torch.float32], ids=["same", "fp32_teacher"])
def test_jsd_pass_and_gradient(backend, dtype, teacher_dtype):
    """The JSD and ``KL(p || m)`` from the whole rows' log-sum-exps, and the gradient of a random upstream: finite on
    every masked row (the mixture has mass wherever either side has), 0 / zero gradient on a skipped row."""
    if teacher_dtype == dtype:
        pytest.skip("the same dtype: the 'same' case")
    impl = dispatch.implementation("divergence", backend)
    stream = dispatch.implementation("stream", backend)
    for vocab in _vocabs(backend):
        x, y, t = rows(vocab, dtype, teacher_dtype=teacher_dtype)
        stats = stream.forward(x, y, t, temp(0.8), statistics.request(ref=True))
        jsd, kl_student = impl.forward(x, y, t, temp(0.8), stats.lse, stats.ref_lse, BETA)
        exp = stream_reference.forward(x.double(), y.double(), t, temp(0.8), statistics.request(ref=True))
        e_jsd, e_kl = divergence_reference.forward(x.double(), y.double(), t, temp(0.8), exp.lse, exp.ref_lse, BETA)
        tol = value_atol(x, 0.8) * 8
        assert torch.isfinite(jsd).all() and jsd[5] == 0
        assert_close(jsd, e_jsd, tol, 1e-5, what=f"{vocab} jsd")
        assert_close(kl_student, e_kl, tol, 1e-5, what=f"{vocab} kl_student")
        coef = torch.randn(6, generator=torch.Generator().manual_seed(2))
        grad = impl.backward(x, y, t, temp(0.8), stats.lse, stats.ref_lse, BETA, kl_student, coef)
        expected = divergence_reference.backward(x.double(), y.double(), t, temp(0.8), exp.lse, exp.ref_lse, BETA,
                                                 e_kl, coef.double())
        assert grad.dtype == x.dtype and grad.shape == x.shape
        assert torch.isfinite(grad.float()).all() and bool((grad[5] == 0).all())
        assert_close(grad, expected, 1e-6, MIXED_GRAD_RTOL[dtype], what=f"{vocab} grad")


def test_jsd_rows_without_a_distribution(backend):
    """A row whose logits are all ``-inf`` or hold a NaN (no distribution): NaN JSD and a zero gradient, as the
    ``stream`` family's rule."""
    x = torch.randn(3, 300)
    y = torch.randn(3, 300)
    x[0] = float("-inf")
    y[1, 4] = float("nan")
    t = torch.tensor([1, 2, 3])
    stats = dispatch.implementation("stream", backend).forward(x, y, t, temp(1.0), statistics.request(ref=True))
    impl = dispatch.implementation("divergence", backend)
    jsd, kl_student = impl.forward(x, y, t, temp(1.0), stats.lse, stats.ref_lse, BETA)
    assert torch.isnan(jsd[:2]).all() and torch.isfinite(jsd[2])
    grad = impl.backward(x, y, t, temp(1.0), stats.lse, stats.ref_lse, BETA, kl_student, torch.ones(3))
    assert bool((grad[:2] == 0).all()) and torch.isfinite(grad[2]).all()
