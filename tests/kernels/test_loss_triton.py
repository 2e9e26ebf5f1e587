"""The fused Triton kernel of the ``loss`` family (``kltriton/kernels/loss/triton.py``) beyond the op
tests: several vocab tiles and gradient blocks with a masked tail, ``-inf`` / ``finfo.min`` logits,
a reference in another dtype, per-row temperatures, skipped rows, the entropy gradient on and off,
every dtype, against the float64 reference backend and the C++ fused kernel. Interpreter on CPU."""
from types import SimpleNamespace

import pytest
import torch

from helpers import MIXED_GRAD_RTOL, STORE_RTOL, assert_close, grad_tols, random_logits, temp, value_atol
from kltriton import dispatch, estimators
from kltriton.kernels import constants
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.loss import LossInputs, terms
from kltriton.kernels.stream import reference as stream_reference

VOCAB = 700  # small_blocks: a 512-entry statistics tile plus a masked tail, six gradient blocks (last masked)
INF = float("inf")

CONFIGS = [
    dict(loss_type="ppo", estimator="k3"),
    dict(loss_type="ppo", estimator="full"),
    dict(loss_type="cispo", estimator="k1+"),
    dict(loss_type="ppo", estimator="abs", given_ref=True),
    dict(loss_type="ppo", estimator="k2", given_ref=True, kl_clamp=0.05),
    dict(loss_type="ppo", estimator="", on_policy=True),
    dict(loss_type="cispo", estimator="k3+", given_ref=True, on_policy=True),
]


@pytest.fixture
def small_blocks(monkeypatch):
    """One warp and 128-entry gradient blocks: a vocab of a few hundred takes several statistics tiles
    and gradient blocks, as V = 151936 does on the GPU."""
    monkeypatch.setattr(rows, "NUM_WARPS", 1)
    monkeypatch.setattr(rows, "BACKWARD_BLOCK", 128)


def inputs(dtype, ref_dtype=None, n_scored=5, vocab=VOCAB, seed=0, temperature=None, loss_type="ppo", estimator="k3",
           given_ref=False, on_policy=False, kl_clamp=INF):
    """Logits, a reference in ``ref_dtype`` (None with ``given_ref``), targets ending in a SKIP and an
    OUT_OF_RANGE row, ``LossInputs`` with old log-probs around the policy's (ratios on both sides of the
    clip range), the hyperparameters."""
    gen = torch.Generator().manual_seed(seed)
    n = n_scored + 2
    logits = random_logits((n, vocab), dtype, generator=gen)
    ref = (logits.float() + 0.5 * torch.randn(n, vocab, generator=gen)).to(ref_dtype or dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    target = torch.cat([labels[:n_scored], torch.tensor([constants.SKIP, constants.OUT_OF_RANGE])])
    temperature = temp(1.0) if temperature is None else temperature
    logp = stream_reference.forward(logits.double(), None, target, temperature, 0).logp
    jitter = lambda scale: (logp + scale * torch.randn(n, generator=gen, dtype=torch.float64)).float()  # noqa: E731
    w = torch.rand(n, generator=gen)
    inputs = LossInputs(None if on_policy else jitter(0.3).nan_to_num(-5.0), torch.randn(n, generator=gen), w, 0.1 * w,
                        -0.02 * w, jitter(0.4).nan_to_num(-5.0) if given_ref else None)
    hp = terms.hyperparameters("cpu", ratio_low=0.8, ratio_high=1.28, dual_clip=3.0 if loss_type == "ppo" else INF,
                               kl_clamp=kl_clamp)
    return SimpleNamespace(logits=logits, ref=None if given_ref else ref, target=target, temperature=temperature,
                           inputs=inputs, hp=hp, loss_type=loss_type, estimator=estimator)


def run(backend, d, entropy_grad=True, with_grad=True, logits=None, ref=None, inputs=None):
    logits = d.logits if logits is None else logits
    ref = d.ref if ref is None else ref
    return dispatch.implementation("loss", backend).forward(
        logits, ref, d.target, d.temperature, d.inputs if inputs is None else inputs, d.hp, d.loss_type, d.estimator,
        entropy_grad, with_grad)


def oracle(d, entropy_grad=True):
    """The reference backend on float64 logits and inputs: float64 statistics and gradient."""
    inputs = LossInputs(*(None if r is None else r.double() for r in d.inputs))
    return run("reference", d, entropy_grad, logits=d.logits.double(), ref=None if d.ref is None else d.ref.double(),
               inputs=inputs)


def tolerances(d, want_stats, entropy_grad):
    """(value atol, grad atol, grad rtol) of tests/helpers.py: masked entries (below -1e29) left out of the
    magnitude; the gradient's scale is the rows' largest coefficient."""
    finite = torch.where(d.logits.float() > -1e29, d.logits.float(), 0.0)
    temperature = float(d.temperature.min())
    ref_logp = want_stats.ref_logp if d.ref is not None else d.inputs.ref_logp
    est = estimators.parse(d.estimator) if d.estimator else None
    inputs = LossInputs(*(None if r is None else r.double() for r in d.inputs))
    coef = (*terms.coefficients(d.loss_type, est, want_stats.logp, ref_logp, inputs, d.hp), inputs.w_ent)
    scale = torch.stack([c.nan_to_num(0.0).abs().max() for c in coef if c is not None])
    atol = grad_tols(finite, temperature, scale)[0]
    mixed = entropy_grad or d.estimator == "full"
    rtol = (MIXED_GRAD_RTOL if mixed else STORE_RTOL)[d.logits.dtype]
    return 4 * value_atol(finite, temperature), atol, rtol


def check(d, got, want, entropy_grad=True, factor=1.0):
    value_tol, grad_atol, grad_rtol = tolerances(d, want[0], entropy_grad)
    for name in ("logp", "lse", "entropy", "ref_logp", "ref_lse", "full_kl"):
        assert_close(getattr(got[0], name), getattr(want[0], name).float(), factor * value_tol, 1e-5, what=name)
    assert got[1].dtype == d.logits.dtype and got[1].shape == d.logits.shape
    assert_close(got[1], want[1], factor * grad_atol, factor * grad_rtol, what="grad")
    assert not got[1][-2:].any(), "skipped rows have a zero gradient"


@pytest.mark.parametrize("entropy_grad", [True, False], ids=["ent", "noent"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_fused_matches_float64(small_blocks, dtype, cfg, entropy_grad):
    d = inputs(dtype, **cfg)
    check(d, run("triton", d, entropy_grad), oracle(d, entropy_grad), entropy_grad)


@pytest.mark.parametrize("dtype, ref_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.float16, torch.float32)])
@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_reference_in_another_dtype(small_blocks, dtype, ref_dtype, estimator):
    d = inputs(dtype, ref_dtype, estimator=estimator)
    check(d, run("triton", d), oracle(d))


def test_per_row_temperature(small_blocks):
    gen = torch.Generator().manual_seed(5)
    temperature = (0.5 + 1.5 * torch.rand(7, generator=gen)).double()
    d = inputs(torch.float32, temperature=temperature, estimator="full")
    check(d, run("triton", d), oracle(d))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_inf_and_finfo_min_logits(small_blocks, temperature):
    """Masked entries (``finfo.min``, ``-1e30``, ``-inf``) in whole tiles and whole rows: finite statistics
    and gradients where float64 has them; a row of ``-inf`` has NaN statistics and a zero gradient."""
    d = inputs(torch.float32, n_scored=6, estimator="full", temperature=temp(temperature))
    low = torch.finfo(torch.float32).min
    logits, ref = d.logits.clone(), d.ref.clone()
    logits[0, :512] = low                      # a masked first tile, then ordinary values
    logits[1, 100:] = -1e30
    ref[1, 100:] = -1e30
    logits[2, ::3] = float("-inf")             # banned tokens (the label is not one of them)
    logits[2, 1::3] = low
    ref[2, ::3] = float("-inf")
    logits[3, :] = float("-inf")               # no distribution
    logits[4, :] *= 30                         # large magnitudes
    if temperature == 1.0:
        logits[5, :] = low                     # a whole row masked: uniform (low / 0.6 is beyond fp32)
    d.target[:6] = torch.tensor([600, 7, 5, 9, 33, 2])
    d.logits, d.ref = logits, ref
    got, want = run("triton", d), oracle(d)
    scored = slice(0, 3) if temperature != 1.0 else slice(0, 6)
    assert torch.isfinite(got[1][:3]).all() and torch.isfinite(got[0].logp[:3]).all()
    assert not got[1][3].any() and torch.isnan(got[0].logp[3])
    check(d, got, want)
    assert torch.isfinite(got[1][scored]).all()


@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_equals_cpp_fused_kernel(small_blocks, dtype, cfg):
    """The C++ fused kernel on the same inputs: equal to fp32 rounding (two fp32 computations of the same
    float64 answer: twice the oracle tolerance)."""
    usable, why = dispatch.availability("cpp", "loss")
    if not usable:
        pytest.skip(why)
    d = inputs(dtype, **cfg)
    check(d, run("triton", d), run("cpp", d), factor=2.0)


def same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_batch_invariance_bitwise(small_blocks):
    """A row's statistics and gradient do not depend on N or its place."""
    d = inputs(torch.float32, estimator="full")
    whole = run("triton", d)
    for i in (0, 3, 6):
        part = SimpleNamespace(**dict(vars(d), logits=d.logits[i:i + 1], ref=d.ref[i:i + 1], target=d.target[i:i + 1],
                                      inputs=LossInputs(*(None if r is None else r[i:i + 1] for r in d.inputs))))
        alone = run("triton", part)
        for a, b in zip(whole[0], alone[0]):
            same(a[i:i + 1], b)
        same(whole[1][i:i + 1], alone[1])


def test_without_grad_and_empty(small_blocks):
    d = inputs(torch.bfloat16, estimator="full")
    stats, grad = run("triton", d, with_grad=False)
    assert grad.shape == (0, VOCAB)
    fused = run("triton", d)[0]
    for a, b in zip(stats, fused):  # one statistics tile loop per row on both routes here: bitwise
        same(a, b)
    empty = SimpleNamespace(**dict(vars(d), logits=d.logits[:0], ref=d.ref[:0], target=d.target[:0],
                                   inputs=LossInputs(*(None if r is None else r[:0] for r in d.inputs))))
    stats, grad = run("triton", empty)
    assert grad.shape == (0, VOCAB) and stats.logp.shape == (0,)


def test_fused_kernel_on_a_strided_view(small_blocks):
    """Logits as a ``[B, T, V]`` slice (rows not adjacent) are read in place."""
    d = inputs(torch.float32, n_scored=4)
    big = random_logits((2, 6, VOCAB), torch.float32)
    big[:, 1:4] = d.logits[:6].view(2, 3, VOCAB)
    view = big[:, 1:4]
    e = SimpleNamespace(**dict(vars(d), logits=view, ref=d.ref[:6].view(2, 3, VOCAB), target=d.target[:6],
                               inputs=LossInputs(*(None if r is None else r[:6] for r in d.inputs))))
    got = run("triton", e)
    want = run("triton", SimpleNamespace(**dict(vars(e), logits=d.logits[:6], ref=d.ref[:6])))
    for a, b in zip(got[0], want[0]):
        same(a, b)
    same(got[1], want[1])
