"""Recompute mode from ``LinearLogits``, every backend: the floor needs each whole row, so the logits are built
one tile of rows at a time (``tile_rows x V`` fp32, the working tile) and each tile goes the tensor route
(``rows_fn``); the backward builds each tile again and back-propagates through it, so peak memory stays one
tile (and its gradient) plus ``O(N)``."""
import torch

from kltriton.kernels.linear import Side, scaled_and_capped
from kltriton.kernels.statistics import StreamStats
from kltriton._autograd import first_order


def head(side, start: int, stop: int) -> torch.Tensor:
    """``[stop - start, V]`` fp32 logits of rows ``start:stop`` of a ``LinearLogits`` side
    (``kltriton.kernels.linear.Side``), differentiable."""
    hidden, weight, bias, scale, softcap = side
    h = hidden.reshape(-1, hidden.shape[-1])[start:stop].float()
    y = h @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return scaled_and_capped(y, scale, softcap)


class _Tiles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_fn, tile_rows, n, head_fn, side_tensors, *params):
        hidden, weight, bias = params
        side = Side(hidden, weight, bias, *side_tensors)
        parts = []
        with torch.no_grad():
            for start in range(0, n, tile_rows):
                stop = min(start + tile_rows, n)
                parts.append(rows_fn(head_fn(side, start, stop), start, stop))
        stats = StreamStats(*(torch.cat(values) for values in zip(*parts)))
        ctx.save_for_backward(hidden, weight, bias)
        ctx.meta = (rows_fn, tile_rows, n, head_fn, side_tensors)
        ctx.set_materialize_grads(False)
        return tuple(stats)

    @staticmethod
    @first_order("a truncated LM head's tiles")
    def backward(ctx, *grads):
        hidden, weight, bias = ctx.saved_tensors
        rows_fn, tile_rows, n, head_fn, side_tensors = ctx.meta
        needs_grad = ctx.needs_input_grad[5:8]
        leaves = [None if t is None else t.detach().requires_grad_(w) for t, w in zip((hidden, weight, bias), needs_grad)]
        side = Side(*leaves, *side_tensors)
        for start in range(0, n, tile_rows):
            stop = min(start + tile_rows, n)
            with torch.enable_grad():
                logits = head_fn(side, start, stop)
                tile = logits.detach().requires_grad_(True)
                stats = rows_fn(tile, start, stop)
                pairs = [(v, g[start:stop]) for v, g in zip(stats, grads)
                         if g is not None and v.requires_grad and v.shape[0] == stop - start]
                if not pairs:
                    continue
                (d_tile,) = torch.autograd.grad([v for v, _ in pairs], [tile], [g for _, g in pairs],
                                                allow_unused=True)
                if d_tile is not None and any(needs_grad):
                    torch.autograd.backward(logits, d_tile)
        return (None, None, None, None, None, *(None if leaf is None or not w else leaf.grad
                                          for leaf, w in zip(leaves, needs_grad)))


def statistics(side, rows_fn, tile_rows: int, head_fn=head) -> StreamStats:
    """``StreamStats`` of a ``LinearLogits`` side, ``rows_fn(logits_tile [t, V] fp32, start, stop)`` giving the
    statistics of rows ``start:stop`` from their dense logits, ``tile_rows`` rows at a time (built by
    ``head_fn(side, start, stop)``, default ``head``); differentiable w.r.t. hidden, weight and bias."""
    hidden, weight, bias, scale, softcap = side
    n = hidden.reshape(-1, hidden.shape[-1]).shape[0]
    return StreamStats(*_Tiles.apply(rows_fn, tile_rows, n, head_fn, (scale, softcap), hidden, weight, bias))

