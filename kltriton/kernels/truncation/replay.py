"""Replay mode of the ``truncation`` family: the kept set is the engine's ``ids [N, K]`` (``-1`` padding), so a row's
statistics need only those ``K`` logits.

1. ``support``: the ids in a canonical form, each kept id once in increasing order, then the padding (a repeated
   id counts once);
2. ``columns`` (logits) or ``project`` (``LinearLogits``: only those ``K`` columns of the LM head are projected, a
   tile of rows at a time): the ``[N, K]`` logits at those ids (0 at padding). The logits gradient of ``columns`` is
   written by the backend's ``replay_scatter`` (the C++ backend: into the reused gradient buffer of its other
   backwards), zero outside the kept ids;
3. ``statistics``: ``logp``, ``lse`` and ``entropy`` of the row restricted to its kept ids, by the backend's
   ``replay_forward`` / ``replay_backward`` (contract: ``kltriton.kernels.truncation``).

Every bit of a row's values and gradients is independent of ``K`` (how wide the support is padded), of the order
and repetitions of its ids and of the other rows: the row's reductions are a maximum and fixed-point integer sums
(``constants.FIXED_POINT_BITS``), which are associative, and everything else is per entry.
"""
from typing import Optional, Tuple

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.linear import scaled_and_capped
from kltriton.kernels.statistics import StreamStats
from kltriton.ops._define import define_op

def _support(
    ids: torch.Tensor,  # [N, K] int64, -1: padding
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("truncation", backend).replay_support(ids)


_support_op = define_op("replay_support", _support, outputs=("ids",), fake=lambda ids, backend: torch.empty_like(ids))


def support(ids: torch.Tensor, backend: str) -> torch.Tensor:
    """The canonical form of engine ids ``[N, K]`` int64 (``-1`` padding): each kept id once, in increasing order,
    then ``-1`` (``backend``'s ``replay_support``)."""
    return _support_op(ids.contiguous(), backend)


def shard_ids(ids: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Global ids ``[N, K]`` as the ids of a vocab shard ``[start, start + width)``, ``-1`` where it does not hold
    them."""
    local = ids - start
    return torch.where((ids >= 0) & (local >= 0) & (local < width), local, -1)


# --- the K logits of a row ---------------------------------------------------------------------------------------

def _columns(
    logits: torch.Tensor,  # [..., V]
    ids: torch.Tensor,     # [N, K] int64, -1: not read
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("truncation", backend).replay_columns(logits.detach(), ids)


def _scatter_kernel(
    columns: torch.Tensor,  # [N, K] the gradient at the ids (accumulation dtype)
    ids: torch.Tensor,      # [N, K] int64, -1: not written
    vocab: int,
    dtype: torch.dtype,     # the logits'
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("truncation", backend).replay_scatter(columns, ids, vocab, dtype)


# An op of its own (as the stream backward), so that torch.compile traces the backward of replay_columns.
replay_scatter = define_op(
    "replay_scatter", _scatter_kernel, outputs=("grad",),
    fake=lambda columns, ids, vocab, dtype, backend: columns.new_empty((ids.shape[0], vocab), dtype=dtype))


def _columns_backward(saved, grads):
    logits, grad = saved.logits, grads["values"]
    if grad is None:
        return {}
    scattered = replay_scatter(grad.contiguous(), saved.ids, logits.shape[-1], logits.dtype, saved.backend)
    return {"logits": scattered.view(logits.shape)}


_columns_op = define_op(
    "replay_columns", _columns, outputs=("values",),
    fake=lambda logits, ids, backend: logits.new_empty(ids.shape, dtype=accumulation_dtype(logits.dtype)),
    save=("logits", "ids", "backend"), backward=_columns_backward, materialize_grads=False)


def columns(logits: torch.Tensor, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """``[N, K]`` logits at ``ids [N, K]`` (``-1``: 0) in the accumulation dtype, read in place (any strides on the
    leading dims); differentiable: the gradient is ``backend``'s ``replay_scatter`` of the ``K`` columns'."""
    return _columns_op(logits, ids.contiguous(), backend)


class _Projection(torch.autograd.Function):
    """``[N, K]`` fp32 logits ``head(hidden[n]) [ids[n, k]]`` of an LM head ``(weight, bias, scale, softcap)``
    over row tiles of ``tile_rows``: a tile holds ``weight[ids]`` as ``[tile_rows, K, H]``, never ``[N, K, H]``.
    The backward projects the tiles again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, scale, softcap, tile_rows):
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, ids.shape[0], tile_rows):
            stop = min(start + tile_rows, ids.shape[0])
            out[start:stop] = _project_tile(hidden[start:stop], weight, bias, ids[start:stop], scale, softcap)[0]
        ctx.save_for_backward(hidden, weight, bias, ids, scale, softcap)
        ctx.tile_rows = tile_rows
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, ids, scale, softcap = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        d_h = torch.zeros_like(hidden, dtype=torch.float32) if want_h else None
        d_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        d_b = torch.zeros_like(bias, dtype=torch.float32) if want_b else None
        for start in range(0, ids.shape[0], ctx.tile_rows):
            stop = min(start + ctx.tile_rows, ids.shape[0])
            h, tile_ids = hidden[start:stop].float(), ids[start:stop]
            _, d_linear, w_rows = _project_tile(hidden[start:stop], weight, bias, tile_ids, scale, softcap)
            d = grad[start:stop].float() * d_linear                                  # [t, K]
            if want_h:
                d_h[start:stop] = (d[:, :, None] * w_rows).sum(1)
            if want_w:
                d_w.index_add_(0, tile_ids.reshape(-1), (d[:, :, None] * h[:, None, :]).reshape(-1, h.shape[-1]))
            if want_b:
                d_b.index_add_(0, tile_ids.reshape(-1), d.reshape(-1))
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(d_h, hidden), cast(d_w, weight), cast(d_b, bias), None, None, None, None


def _project_tile(hidden, weight, bias, ids, scale, softcap):
    """``(logits [t, K], d logits / d linear [t, K], weight rows [t, K, H] fp32)`` of one row tile. Each logit is
    its own dot product over ``H`` (a product and a sum over the last dim: the same order whatever ``K``)."""
    w_rows = weight[ids].float()                                                      # [t, K, H]
    linear = (w_rows * hidden.float()[:, None, :]).sum(-1)
    if bias is not None:
        linear = linear + bias[ids].float()
    y = scaled_and_capped(linear, scale, softcap)
    slope = torch.ones_like(y) if scale is None else torch.ones_like(y) * scale.float()
    if softcap is not None:  # d(c tanh(u / c)) / du = 1 - (y / c)^2
        slope = slope * (1 - (y / softcap).square())
    return y, slope, w_rows


def project(side, ids: torch.Tensor, tile_elements: int) -> torch.Tensor:
    """``[N, K]`` fp32 logits of a ``LinearLogits`` side (``kltriton.kernels.linear.Side``) at ``ids [N, K]``
    (``-1``: 0), differentiable w.r.t. its hidden states, weight and bias; ``tile_elements`` bounds
    ``tile_rows * K * H``."""
    hidden, weight, bias, scale, softcap = side
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    tile_rows = max(1, tile_elements // max(ids.shape[1] * hidden.shape[-1], 1))
    values = _Projection.apply(hidden2d, weight, bias, ids.clamp(min=0), scale, softcap, tile_rows)
    return torch.where(ids >= 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


# --- the statistics of the kept set ------------------------------------------------------------------------------

def _statistics(
    values: torch.Tensor,       # [N, K] the logits at the ids (accumulation dtype)
    ids: torch.Tensor,          # [N, K] int64, the support (canonical, global ids)
    target: torch.Tensor,       # [N] int64
    temperature: torch.Tensor,  # float64 [] or [N]
    wanted: int,                # 0 or ENTROPY
    backend: str,
) -> Tuple[(torch.Tensor,) * 6]:
    out = dispatch.implementation("truncation", backend).replay_forward(values, ids, target, temperature, wanted)
    return tuple(out)


def _statistics_fake(values, ids, target, temperature, wanted, backend):
    n = target.shape[0]
    new = lambda size, dtype=values.dtype: values.new_empty(size, dtype=dtype)  # noqa: E731
    entropy = new(n if wanted & statistics.constants.ENTROPY else 0)
    return new(n), new(n), entropy, new(n), new(n, torch.float64), new(n, torch.int64)


def _backward_kernel(
    values: torch.Tensor,            # [N, K]
    ids: torch.Tensor,               # [N, K] int64
    target: torch.Tensor,            # [N] int64
    temperature: torch.Tensor,       # float64 [] or [N]
    row_max: torch.Tensor,           # [N] from the forward
    log_mass: torch.Tensor,          # [N] float64 from the forward
    c_label: torch.Tensor,           # [N] gradient basis (kltriton.kernels.statistics.Basis), / T
    c_p: torch.Tensor,
    c_p_logp: Optional[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("truncation", backend).replay_backward(
        values, ids, target, temperature, row_max, log_mass, statistics.Basis(c_label, c_p, c_p_logp))


replay_backward = define_op("replay_backward", _backward_kernel, outputs=("grad",),
                            fake=lambda values, *rest: values.new_empty(values.shape))


def _statistics_backward(saved, grads):
    none = saved.logp.new_empty(0)
    stats = StreamStats(*(getattr(saved, name) if name in ("logp", "lse", "entropy") else none
                          for name in statistics.NAMES))
    g = grads.get("logp")
    if g is not None:  # a label outside the kept set: its log-prob is a constant -inf, without gradient
        g = torch.where(saved.label_column >= 0, g, torch.zeros((), dtype=g.dtype, device=g.device))
    basis = statistics.gradient_basis({"logp": g, "entropy": grads.get("entropy")}, stats, saved.temperature)
    return {"values": replay_backward(saved.values, saved.ids, saved.target, saved.temperature, saved.row_max,
                                      saved.log_mass, basis.label, basis.p, basis.p_logp, saved.backend)}


_statistics_op = define_op(
    "replay_statistics", _statistics, outputs=("logp", "lse", "entropy", "row_max", "log_mass", "label_column"),
    fake=_statistics_fake,
    save=("values", "ids", "target", "temperature", "backend", "logp", "lse", "entropy", "row_max", "log_mass",
          "label_column"),
    backward=_statistics_backward, materialize_grads=False)


def statistics_of(values: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor,
                  wanted: int, backend: str) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``wanted`` asks) of each row restricted to its kept
    logits ``values [N, K]`` at the support ``ids`` (``support``), differentiable w.r.t. ``values``."""
    logp, lse, entropy = _statistics_op(values.contiguous(), ids.contiguous(), target, temperature, wanted,
                                        backend)[:3]
    none = logp.new_empty(0)
    found = {"logp": logp, "lse": lse, "entropy": entropy}
    return StreamStats(*(found.get(name, none) for name in statistics.NAMES))

