"""The ``linear`` family in the invariant mode (``kltriton.invariant``): every logit of an LM head comes from a GEMM
of one shape, ``[ROWS, H] x [H, BLOCK]`` (``geometry``), whatever the tile budget, the vocab shard or the number of
scored rows. BLAS libraries pick other kernels, with other reduction orders, for other shapes (MKL on CPU: vocab
tiles of 32 or 64 columns, or tiles of 2 to 11 rows, change a logit's bits), so a logit's bits would otherwise depend
on them.

A shard's ``V_local`` ids are covered by windows of ``BLOCK`` columns, ``[0, BLOCK), [BLOCK, 2 BLOCK), ...``, the last
one ending at the shard's end (it overlaps the one before; each column belongs to one window, ``windows``); a shard
narrower than ``BLOCK`` is padded with zero weight rows. Token tiles hold ``ROWS`` scored rows (the last one padded).
The statistics of the logits are the backend's ``invariant`` kernels (``kltriton.kernels.invariant``), the gradient
its ``stream`` backward on the saved ``lse``.
"""
import math

import torch

from kltriton.kernels import SKIP, accumulation_dtype
from kltriton.kernels.invariant import pack, sum_count
from kltriton.kernels.linear import scaled_and_capped
from kltriton.kernels.linear.tiles import _add_mm, _chain, _scored_tiles, _temp, _TileSide

# (ROWS, BLOCK) of every GEMM, per device type: fixed, never derived from the tile budget.
GEOMETRY = {"cuda": (256, 8192)}
DEFAULT_GEOMETRY = (256, 8192)


def geometry(device_type: str):
    """``(rows, block)``: the token rows and vocab columns of every GEMM on this device type."""
    return GEOMETRY.get(device_type, DEFAULT_GEOMETRY)


def windows(width: int, block: int):
    """``[(start, first, stop)]``: GEMM windows ``[start, start + block)`` covering ``[0, width)``, each owning the
    columns ``[first, stop)``; for ``width < block`` one window over the padded weight."""
    if width <= block:
        return [(0, 0, width)]
    return [(min(v0, width - block), v0, min(v0 + block, width)) for v0 in range(0, width, block)]


def _padded(side, block):
    """``side`` with its weight (and bias) padded by zero rows to ``block`` when narrower."""
    width = side.weight.shape[0]
    if width >= block:
        return side
    weight = torch.cat([side.weight, side.weight.new_zeros(block - width, side.weight.shape[1])])
    bias = None if side.bias is None else torch.cat([side.bias, side.bias.new_zeros(block - width)])
    return side._replace(weight=weight, bias=bias)


def forward(side, read, label, temperature, request, invariant, tile_elements, reduce_max, reduce_sum):
    """``(row_max [N], packed [k + 2, N])`` of an LM head ``side`` (``kltriton.kernels.linear.Side``): each read row's
    largest logit and its ``kernels.invariant.pack`` of fixed-point sums and label logit, each joined over the ranks
    by ``reduce_max`` / ``reduce_sum`` per token tile (identity without a vocab shard; every rank cuts the same
    tiles).

    ``read`` ``[N]`` bool: the rows to score; ``label`` ``[N]``: the label's column in this shard, ``-1`` elsewhere.
    With ``ROWS * V_local <= tile_elements`` a token tile's whole rows are held (one GEMM per window); else each
    window is built twice, once for the maxima and once for the sums (the same logits, the same results)."""
    n, width = read.numel(), side.weight.shape[0]
    device, acc = read.device, accumulation_dtype(side.x.dtype)
    rows, block = geometry(device.type)
    side = _padded(side, block)
    spans = windows(width, block)
    row_max = torch.full((n,), -math.inf, dtype=acc, device=device)
    packed = torch.zeros((sum_count(request) + 2, n), dtype=torch.int64, device=device)
    held_rows = rows * width <= tile_elements
    window = torch.empty(rows * block, dtype=acc, device=device)
    whole = torch.empty((rows, width), dtype=acc, device=device) if held_rows and len(spans) > 1 else None
    for idx, padded, m in _scored_tiles(read, read, rows):
        tgt = torch.zeros(rows, dtype=torch.int64, device=device)
        tgt[m:] = SKIP
        temp, lab = _temp(temperature, padded), torch.where(tgt >= 0, label[padded], -1)
        tile = _TileSide(side, padded, acc)

        def build():
            """``(logits [rows, w], first column)`` of each window's own columns."""
            for start, first, stop in spans:
                yield tile.logits(start, start + block, window)[:, first - start:stop - start], first

        if not held_rows:  # each window twice: for the maxima, then for the sums
            max_pieces, sum_pieces = build(), build()
        elif whole is None:  # one window holds the rows
            max_pieces = sum_pieces = [next(build())]
        else:
            for logits, first in build():
                whole[:, first:first + logits.shape[1]] = logits
            max_pieces = sum_pieces = [(whole, 0)]
        tile_max = None
        for logits, _ in max_pieces:
            part = invariant.maxima(logits, tgt, None)
            tile_max = part if tile_max is None else torch.maximum(tile_max, part)
        tile_max = reduce_max(tile_max)
        sums = torch.zeros((sum_count(request), rows), dtype=torch.int64, device=device)
        value = torch.zeros(rows, dtype=torch.float64, device=device)
        held = torch.zeros(rows, dtype=torch.bool, device=device)
        for logits, first in sum_pieces:
            sums += invariant.sums(logits, tgt, temp, tile_max, None, request)
            inside = (lab >= first) & (lab < first + logits.shape[1])
            at = (lab - first).clamp(0, logits.shape[1] - 1)[:, None]
            value = torch.where(inside, logits.gather(1, at).squeeze(1).double(), value)
            held |= inside
        tile_packed = reduce_sum(pack(sums, held, value))
        row_max[idx] = tile_max[:m]
        packed[:, idx] = tile_packed[:, :m]
    return row_max, packed


def backward(side, read, label, temperature, lse, basis, stream, needs_grad):
    """``(d_x, d_weight, d_bias)`` (None where not in ``needs_grad`` or absent) of the logits gradient ``basis`` (a
    ``Basis`` of ``[N]`` coefficients, ``kltriton.kernels.statistics``) on the rows where ``read``: per token tile and
    window, the backend's ``stream`` backward on the window's logits and ``lse`` (the label term in the window that
    owns ``label``, the columns it does not own zeroed), chained through softcap and scale, then ``d_x += grad @ W``,
    ``d_weight += grad.T @ x``, ``d_bias += grad.sum(0)`` in fp32, each GEMM of the fixed shape."""
    width = side.weight.shape[0]
    device, acc = read.device, accumulation_dtype(side.x.dtype)
    rows, block = geometry(device.type)
    want_x, want_weight, want_bias = needs_grad
    want_bias = want_bias and side.bias is not None
    padded_side = _padded(side, block)
    d_x = torch.zeros(side.x.shape, dtype=side.x.dtype, device=device) if want_x else None
    d_x_rows = d_x.view(-1, d_x.shape[-1]) if want_x else None
    d_weight = torch.zeros(padded_side.weight.shape, dtype=acc, device=device) if want_weight else None
    d_bias = torch.zeros(padded_side.weight.shape[0], dtype=acc, device=device) if want_bias else None
    window = torch.empty(rows * block, dtype=acc, device=device)
    ok = read & torch.isfinite(lse)
    for idx, padded, m in _scored_tiles(ok, ok, rows):
        lab = label[padded]
        lab[m:] = -1
        temp = _temp(temperature, padded)
        tile_basis = type(basis)(*(None if c is None else c[padded] for c in basis))
        tile = _TileSide(padded_side, padded, acc)
        d_tile = torch.zeros(rows, side.x.shape[-1], dtype=acc, device=device) if want_x else None
        for start, first, stop in windows(width, block):
            inside = (lab >= first) & (lab < stop)
            local = torch.where(inside, lab - start, 0)
            local[m:] = SKIP
            logits = tile.logits(start, start + block, window)
            grad = stream.backward(logits, None, local, temp, lse[padded], None,
                                   tile_basis._replace(label=torch.where(inside, tile_basis.label, 0)))
            grad[:, :first - start] = 0
            grad[:, stop - start:] = 0
            _chain(padded_side, logits, grad)
            if want_x:
                _add_mm(d_tile, grad, tile.weight(start, start + block))
            if want_weight:
                _add_mm(d_weight[start:start + block], grad.T, tile.x)
            if want_bias:
                d_bias[start:start + block] += grad.sum(0)
            del grad
        if want_x:
            d_x_rows[idx] = d_tile[:m].to(d_x.dtype)
    d_weight = None if d_weight is None else d_weight[:width].to(side.weight.dtype)
    d_bias = None if d_bias is None else d_bias[:width].to(side.bias.dtype)
    return d_x, d_weight, d_bias


def head(side, start: int, stop: int) -> torch.Tensor:
    """``[stop - start, V_local]`` fp32 logits of rows ``start:stop`` (at most ``ROWS``) of an LM head ``side`` from
    GEMMs of the fixed shape (the rows padded to ``ROWS`` with zeros), differentiable: the invariant mode's
    ``kernels.truncation.linear.head``."""
    hidden, weight, bias, scale, softcap = side
    rows, block = geometry(hidden.device.type)
    h = hidden.reshape(-1, hidden.shape[-1])[start:stop].float()
    h = torch.cat([h, h.new_zeros(rows - h.shape[0], h.shape[1])])
    padded = _padded(side._replace(weight=weight.float(), bias=None if bias is None else bias.float()), block)
    parts = []
    for v0, first, v1 in windows(weight.shape[0], block):
        y = h @ padded.weight[v0:v0 + block].T
        if padded.bias is not None:
            y = y + padded.bias[v0:v0 + block]
        parts.append(y[:, first - v0:v1 - v0])
    return scaled_and_capped(torch.cat(parts, 1)[:stop - start], scale, softcap)
