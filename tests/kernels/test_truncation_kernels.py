"""The ``truncation`` family's selection kernels (C++; Triton under the interpreter) against its reference backend,
which sorts each row (float64): the floor of every row and the statistics of the kept set, on the inputs that
break a selection: many ties (bf16 / fp16 rows, integer logits), ``-inf`` and ``finfo.min`` entries, all ``-inf``
rows, NaN / ``+inf`` rows, magnitudes of 1e4, vocab sizes that are not a multiple of any vector and above 65,536,
``top_k`` from 1 to ``V - 1``, ``top_p`` from 0.01 to 0.999, ``min_p`` up to 1, SKIP and OUT_OF_RANGE targets.

min-p and top-k floors are comparisons of fp32 values: equal bit for bit. A top-p cut is a comparison of sums: the
floors may differ only where the float64 mass at the higher of the two floors lies within ``AMBIGUOUS`` (relative)
of the goal (fp32 sums, as vLLM's own, cut there either way).
"""
import math

import pytest
import torch

import kltriton
from helpers import assert_close, temp, value_atol
from kltriton.kernels import OUT_OF_RANGE, SKIP, constants
from kltriton.kernels.truncation import reference

AMBIGUOUS = 1e-5


@pytest.fixture(params=("cpp", "triton"))
def selection_backend(request):
    usable, why = kltriton.dispatch.availability(request.param, "truncation")
    if not usable:
        pytest.skip(f"{request.param}: {why}")
    return request.param


def _kernel(backend):
    return kltriton.dispatch.implementation("truncation", backend)


def _knobs(n, top_k=0, top_p=1.0, min_p=0.0):
    as_rows = lambda v, dtype: (v if isinstance(v, torch.Tensor) else torch.full((n,), v)).to(dtype)  # noqa: E731
    return as_rows(top_k, torch.int64), as_rows(top_p, torch.float64), as_rows(min_p, torch.float64)


def _mass_at(x64, t, floor_prev, v):
    """Float64 fraction of the mass of ``{x >= floor_prev}`` on ``{x >= max(v, floor_prev)}``, per row."""
    z = x64 / t
    m = z.amax(-1, keepdim=True)
    e = torch.where(x64 >= floor_prev[:, None], (z - m).exp(), torch.zeros_like(z))
    above = torch.where(x64 >= torch.maximum(v, floor_prev)[:, None], e, torch.zeros_like(e)).sum(-1)
    return above / e.sum(-1)


def _check(backend, x, target, t, top_k=0, top_p=1.0, min_p=0.0, entropy=True):
    n = x.shape[0]
    knobs = _knobs(n, top_k, top_p, min_p)
    wanted = constants.ENTROPY if entropy else 0
    floor, stats = _kernel(backend).forward(x, target, temp(t), *knobs, None, wanted)
    ref_floor, _ = reference.forward(x.double(), target, temp(t), *knobs, None, wanted)
    same = (floor == ref_floor) | (torch.isnan(floor) & torch.isnan(ref_floor))
    p = knobs[1]
    if not bool(same.all()):
        # only a top-p cut within the rounding of the sums may differ
        prev, _ = reference.forward(x.double(), target, temp(t), knobs[0], torch.ones_like(p), knobs[2], None, 0)
        x64 = x.double()
        higher = torch.maximum(floor, ref_floor).double()
        near = (_mass_at(x64, t, prev.double(), higher) - p).abs() <= AMBIGUOUS
        bad = ~same & ~((p < 1) & near)
        assert not bool(bad.any()), (f"floors differ at rows {bad.nonzero().squeeze(1).tolist()}: "
                                     f"{floor[bad].tolist()} != {ref_floor[bad].tolist()}")
    # the statistics of the kept set, where the floors agree, against the reference from the same floor
    _, expected = reference.forward(x.double(), target, temp(t), *knobs, floor, wanted)
    tol = value_atol(x, t)
    rows = same
    assert_close(stats.logp[rows], expected.logp[rows], tol, what="logp")
    assert_close(stats.lse[rows], expected.lse[rows], tol, 1e-6, what="lse")
    if entropy:
        assert_close(stats.entropy[rows], expected.entropy[rows], 4 * tol, what="entropy")
    return floor


def _distinct(n, vocab, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale, torch.randint(0, vocab, (n,), generator=g)


KNOBS = [dict(top_k=1), dict(top_k=7), dict(top_k=200), dict(top_p=0.01), dict(top_p=0.5), dict(top_p=0.9),
         dict(top_p=0.999), dict(min_p=0.1), dict(min_p=1.0), dict(min_p=1e-9), dict(top_k=30, top_p=0.9, min_p=0.02),
         dict(top_k=100, top_p=0.6), dict(top_p=0.95, min_p=0.05)]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=("fp32", "bf16", "fp16"))
def test_floor_and_statistics(selection_backend, knobs, dtype):
    if selection_backend == "triton" and dtype == torch.float16 and kltriton.dispatch.triton_interpreted():
        pytest.skip("bf16 covers the half-precision ties under the (slow) interpreter")
    x, target = _distinct(6, 1000, seed=1)
    x = x.to(dtype)          # bf16 / fp16 rows hold many ties
    target[2] = SKIP
    target[4] = OUT_OF_RANGE
    _check(selection_backend, x, target, 0.8, **knobs)


@pytest.mark.parametrize("vocab", (7, 9, 33))
def test_tiny_rows_and_large_k(selection_backend, vocab):
    x, target = _distinct(3, vocab, seed=vocab)
    for k in (1, vocab // 2, vocab - 1):
        _check(selection_backend, x, target, 1.0, top_k=k)
    _check(selection_backend, x, target, 1.3, top_k=3, top_p=0.8, min_p=0.2)


def test_ties(selection_backend):
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-4, 5, (4, 301), generator=g).float()     # 9 values: every cut is inside a tie
    target = torch.randint(0, 301, (4,), generator=g)
    for knobs in (dict(top_k=1), dict(top_k=40), dict(top_k=150), dict(top_p=0.3), dict(top_p=0.97),
                  dict(min_p=0.3), dict(top_k=40, top_p=0.5)):
        _check(selection_backend, x, target, 1.0, **knobs)


def test_special_values(selection_backend):
    x, target = _distinct(7, 777, seed=5)
    x[0, ::2] = -math.inf                       # half the row -inf
    x[1] = -math.inf                            # every logit -inf
    x[2, 10:400] = torch.finfo(torch.float32).min
    x[3] *= 4e3                                  # magnitudes ~1e4
    x[4, 5] = math.nan
    x[5, 6] = math.inf
    x[6, :770] = -math.inf                      # 7 finite logits
    target[0] = 1                               # -inf label
    for knobs in (dict(top_k=5), dict(top_k=500), dict(top_p=0.9), dict(top_p=0.999), dict(min_p=0.01),
                  dict(top_k=20, top_p=0.8, min_p=0.001)):
        floor = _check(selection_backend, x, target, 1.0, **knobs)  # T = 1: finfo.min / T fits in fp32
        assert bool(torch.isnan(floor[4:6]).all()) and floor[1] == -math.inf


@pytest.mark.parametrize("knobs", (dict(top_k=50), dict(top_p=0.9), dict(top_k=50, top_p=0.95, min_p=0.01)),
                         ids=("top_k", "top_p", "all"))
def test_long_rows(selection_backend, knobs):
    if selection_backend == "triton" and kltriton.dispatch.triton_interpreted():
        pytest.skip("a 70,000-wide row takes minutes under the interpreter")
    x, target = _distinct(3, 70001, seed=6)
    _check(selection_backend, x, target, 1.0, **knobs)


def test_per_row_knobs(selection_backend):
    x, target = _distinct(6, 513, seed=7)
    top_k = torch.tensor([0, 3, 0, 50, 512, 1])
    top_p = torch.tensor([0.9, 1.0, 0.3, 0.8, 1.0, 0.5], dtype=torch.float64)
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 1.0], dtype=torch.float64)
    t = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.0, 1.5], dtype=torch.float64)
    floor, _ = _kernel(selection_backend).forward(x, target, t, top_k, top_p, min_p, None, 0)
    expected, _ = reference.forward(x.double(), target, t, top_k, top_p, min_p, None, 0)
    assert torch.equal(floor, expected)
