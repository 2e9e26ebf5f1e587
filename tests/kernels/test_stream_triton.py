"""Triton ``stream`` kernels beyond the op tests: the vocab split (several programs per row and a
combine pass), ``finfo.min`` / ``-inf`` rows, and batch invariance. Interpreter on CPU."""
import pytest
import torch

from helpers import assert_close, kernel_forward, random_logits, temp, value_atol
from kltriton.kernels import constants, statistics
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.stream import reference
from kltriton.kernels.stream import triton as ts


@pytest.fixture
def small_tiles(monkeypatch):
    """One warp (32 lanes) and one block per chunk: vocabs of a few hundred split into several
    programs with a masked tail, as V > 32768 does on the GPU."""
    monkeypatch.setattr(rows, "NUM_WARPS", 1)
    monkeypatch.setattr(rows, "CHUNK_BLOCKS", 1)


def _both(logits, ref, target, temperature):
    got = kernel_forward(ts, logits, ref, target, temperature, True, ref is not None)
    want = kernel_forward(reference, logits.double(), None if ref is None else ref.double(), target, temperature, True,
                          ref is not None)
    return got, want


def _check(got, want, logits, temperature, finite_only=False):
    atol = 4 * value_atol(logits, float(temperature))
    for name in ("logp", "lse", "entropy", "ref_logp", "ref_lse", "full_kl"):
        # float64 rounded to the fp32 outputs: a value beyond fp32's range is an infinity there too.
        g, w = getattr(got, name), getattr(want, name).float()
        if finite_only:
            assert torch.isfinite(g[torch.isfinite(w)]).all(), f"{name}: not finite where float64 is"
        assert_close(g, w, atol, 1e-5, what=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [700, 1030])  # not a multiple of the block: a masked tail chunk
def test_split_rows_match_float64(small_tiles, dtype, vocab):
    wanted = statistics.request(entropy=True, ref=True, full_kl=True)
    assert ts._forward_launch(vocab, torch.empty((), dtype=dtype).element_size(), wanted).grid_split > 1
    logits = random_logits((4, vocab), dtype)
    ref = random_logits((4, vocab), dtype)
    # the skipped rows' statistics (0, NaN) come from the forward kernel's first program, not the combine pass
    target = torch.tensor([5, vocab - 1, constants.SKIP, constants.OUT_OF_RANGE])
    _check(*_both(logits, ref, target, temp(0.7)), logits, 0.7)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_finfo_min_and_inf_rows_stay_finite(monkeypatch, split, temperature):
    """Masked entries (``finfo.min``, ``-1e30``, ``-inf``), in whole chunks and whole rows: every
    output is finite wherever the float64 answer is, and matches it."""
    if split:
        monkeypatch.setattr(rows, "NUM_WARPS", 1)
        monkeypatch.setattr(rows, "CHUNK_BLOCKS", 1)
    vocab = 600
    low = torch.finfo(torch.float32).min
    logits = random_logits((6, vocab), torch.float32)
    ref = random_logits((6, vocab), torch.float32)
    logits[0, :512] = low                      # a masked first chunk, then ordinary values
    logits[1, :] = low                         # a whole row masked: uniform
    logits[2, ::3] = float("-inf")
    logits[2, 1::3] = low
    ref[3, :300] = -1e30                       # the reference masks what the policy uses: huge finite KL
    logits[4, 100:] = -1e30
    ref[4, 100:] = -1e30
    logits[5, :] = float("-inf")               # no distribution: NaN statistics, as torch
    target = torch.tensor([3, 7, 2, 400, 50, 9])
    got, want = _both(logits, ref, target, temp(temperature))
    _check(got, want, logits[:5, :100], temperature, finite_only=True)


def test_batch_invariance_bitwise(small_tiles):
    """A row's outputs do not depend on N or its place: bitwise, split path included."""
    logits = random_logits((5, 700), torch.float32)
    ref = random_logits((5, 700), torch.float32)
    target = torch.tensor([1, 2, 3, 4, 5])
    whole = kernel_forward(ts, logits, ref, target, temp(1.0), True, True)
    for i in (0, 3):
        alone = kernel_forward(ts, logits[i:i + 1], ref[i:i + 1], target[i:i + 1], temp(1.0), True, True)
        for a, b in zip(whole, alone):
            assert torch.equal(a[i:i + 1], b)
