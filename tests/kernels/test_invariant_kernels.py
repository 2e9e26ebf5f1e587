"""The ``invariant`` family's kernels (``kltriton.kernels.invariant``) on every backend: a row cut into pieces anywhere
(vocab shards, tiles, strided views of a wider tile), its maxima merged by a maximum and its sums by integer addition,
gives the whole row's results bit for bit; so does the Triton kernel with other block sizes; the statistics match the
float64 oracle within fp32 tolerances; the ``stream`` backward's entries do not depend on where the row ends."""
import math

import pytest
import torch

from helpers import assert_close, kernel_backward, temp, value_atol
from kltriton import dispatch
from kltriton.kernels import SKIP, OUT_OF_RANGE, constants, statistics
from kltriton.kernels.invariant import finalize, triton as invariant_triton

ENTROPY = constants.ENTROPY
CUTS = ([0, 1, 1000, 2003], [0, 17, 18, 1500, 1999, 2003], [0, 2003])


def _rows(dtype, n=7, vocab=2003, seed=0):
    """Fresh logits with -inf, finfo.min, a large row, an all -inf row and a NaN row; a skipped row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=gen) * 4
    x[0, 5] = float("-inf")
    x[1, -3] = torch.finfo(dtype).min
    x[2] *= 40
    x[3] = float("-inf")
    x[4, 7] = float("nan")
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[5] = SKIP
    return x.to(dtype), target


def _merged(impl, x, target, temperature, floor, cuts, wanted=ENTROPY):
    """Maxima and sums of the pieces ``x[:, a:b]`` (views of the full rows), merged."""
    pieces = list(zip(cuts, cuts[1:]))
    row_max = torch.stack([impl.maxima(x[:, a:b], target, floor) for a, b in pieces]).amax(0)
    sums = sum(impl.sums(x[:, a:b], target, temperature, row_max, floor, wanted) for a, b in pieces)
    return row_max, sums


@pytest.mark.parametrize("with_floor", [False, True])
def test_pieces_merge_bit_for_bit(backend, dtype, with_floor):
    impl = dispatch.implementation("invariant", backend)
    x, target = _rows(dtype)
    floor = None
    if with_floor:  # a kept set: every entry above the row's 40th largest (the NaN row's floor: NaN)
        floor = x.float().nan_to_num(nan=0.0).topk(40, dim=-1).values[:, -1].contiguous()
    t = temp(0.7)
    whole = impl.forward(x, target, t, floor, ENTROPY)
    for cuts in CUTS:
        for a, b in zip(whole, _merged(impl, x, target, t, floor, cuts)):
            assert torch.equal(a, b), f"cuts {cuts}"
    assert whole[0][4] == math.inf and whole[0][3] == -math.inf and whole[0][5] == -math.inf
    assert bool((whole[1][:, [3, 4, 5]] == 0).all())


def test_strided_views_and_row_order(backend):
    """Rows read through a wider tile's column view (as the LM head's windows), in another order: the same bits."""
    impl = dispatch.implementation("invariant", backend)
    x, target = _rows(torch.float32)
    t = torch.linspace(0.5, 2.0, x.shape[0], dtype=torch.float64)
    base = impl.forward(x, target, t, None, ENTROPY)
    wide = torch.randn(x.shape[0], x.shape[1] + 37)
    wide[:, 20:20 + x.shape[1]] = x
    perm = torch.randperm(x.shape[0])
    view = wide[perm, 20:20 + x.shape[1]]
    row_max = impl.maxima(view, target[perm], None)
    sums = impl.sums(view, target[perm], t[perm], row_max, None, ENTROPY)
    assert torch.equal(row_max, base[0][perm]) and torch.equal(sums, base[1][:, perm])


def test_triton_block_sizes(monkeypatch):
    """The Triton kernels' block and chunk sizes (one program per row, or many) change no bit."""
    if not dispatch.availability("triton", "invariant")[0]:
        pytest.skip("triton unavailable")
    x, target = _rows(torch.float32, n=6, vocab=3001)
    t = temp(1.3)
    results = []
    for block, chunk_blocks in ((1024, 16), (128, 2), (256, 1), (64, 64)):
        monkeypatch.setattr(invariant_triton, "BLOCK", block)
        monkeypatch.setattr(invariant_triton, "CHUNK_BLOCKS", chunk_blocks)
        results.append(invariant_triton.forward(x, target, t, None, ENTROPY))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_statistics_match_float64(backend, dtype):
    """``finalize`` of the kernels' maxima and sums against the float64 ``stream`` oracle: fp32 accumulation of values
    of size ``|x| / T`` (the fixed-point truncation costs at most ``V 2^-40`` of the sum, far below)."""
    impl = dispatch.implementation("invariant", backend)
    x, target = _rows(dtype)
    target[6] = OUT_OF_RANGE
    t = temp(0.7)
    row_max, sums = impl.forward(x, target, t, None, ENTROPY)
    label = x.double().gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    got = finalize(row_max, sums, label, target >= 0, target, t, ENTROPY, torch.float32)
    expected = dispatch.implementation("stream", "reference").forward(x.double(), None, target, t, ENTROPY)
    atol = value_atol(x[torch.isfinite(x)].reshape(1, -1), 0.7)
    for name in ("logp", "lse", "entropy"):
        assert_close(getattr(got, name), getattr(expected, name), atol=atol, rtol=1e-6, what=name)


def test_stream_backward_entries_do_not_depend_on_the_row_end(backend, dtype):
    """The ``stream`` backward (the invariant mode's gradient) of an entry on the saved ``lse`` has the same bits in
    the whole row and in any piece of it (the C++ kernel's tail runs the vector code)."""
    stream = dispatch.implementation("stream", backend)
    x = _rows(dtype)[0][:3]
    target = torch.tensor([3, 1500, 2002])
    t = temp(0.9)
    stats = dispatch.implementation("stream", "reference").forward(x.float(), None, target, t, ENTROPY)
    g_logp, g_entropy = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.0, 0.25, -0.5])
    whole = kernel_backward(stream, x, None, target, t, stats, g_logp, g_entropy)
    for a, b in ((0, 1000), (1000, 2003), (17, 1500), (1999, 2003), (1, 2)):
        inside = (target >= a) & (target < b)
        local = torch.where(inside, target - a, 0)
        basis = statistics.gradient_basis({"logp": g_logp, "entropy": g_entropy}, stats, t)
        basis = basis._replace(label=torch.where(inside, basis.label, 0))
        piece = stream.backward(x[:, a:b].contiguous(), None, local, t, stats.lse, None, basis)
        assert torch.equal(piece, whole[:, a:b]), (a, b)
