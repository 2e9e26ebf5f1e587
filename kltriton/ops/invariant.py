"""The ``invariant`` family as custom ops (not differentiable; ``kltriton.invariant`` wires the gradient):
``invariant_maxima``, ``invariant_sums`` and ``invariant_forward`` (both on rows of a whole vocabulary), kernel
``kltriton.dispatch.implementation("invariant", backend)``; ``invariant_finalize`` (the statistics from them,
``kltriton.kernels.invariant.finalize``), an op of its own so that ``torch.compile`` runs its float64 arithmetic as
eager does (a compiled graph may fuse and reorder it: other bits). Contract in ``kltriton.kernels.invariant``."""
import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, constants
from kltriton.kernels import invariant as family
from kltriton.kernels import statistics as table
from kltriton.kernels.invariant import sum_count
from kltriton.kernels.statistics import StreamStats
from kltriton.ops._define import DTYPE, INT, OPTIONAL, STR, TENSOR, define_op


def _impl(args):
    return dispatch.implementation("invariant", args.backend)


def _maxima_fake(args):
    return args.logits.new_empty(args.target.shape, dtype=accumulation_dtype(args.logits.dtype))


def _sums_fake(args):
    return args.target.new_empty((sum_count(args.request), args.target.shape[0]), dtype=torch.int64)


_maxima = define_op(
    "invariant_maxima", inputs=(("logits", TENSOR), ("target", TENSOR), ("floor", OPTIONAL), ("backend", STR)),
    outputs=("row_max",), launch=lambda args: _impl(args).maxima(args.logits.detach(), args.target, args.floor),
    fake=_maxima_fake)

_sums = define_op(
    "invariant_sums",
    inputs=(("logits", TENSOR), ("target", TENSOR), ("temperature", TENSOR), ("row_max", TENSOR), ("floor", OPTIONAL),
            ("request", INT), ("backend", STR)),
    outputs=("sums",),
    launch=lambda args: _impl(args).sums(args.logits.detach(), args.target, args.temperature, args.row_max,
                                         args.floor, args.request),
    fake=_sums_fake)

_forward = define_op(
    "invariant_forward",
    inputs=(("logits", TENSOR), ("target", TENSOR), ("temperature", TENSOR), ("floor", OPTIONAL), ("request", INT),
            ("backend", STR)),
    outputs=("row_max", "sums"),
    launch=lambda args: tuple(_impl(args).forward(args.logits.detach(), args.target, args.temperature, args.floor,
                                                  args.request)),
    fake=lambda args: (_maxima_fake(args), _sums_fake(args)))


def maxima(logits, target, floor, backend: str) -> torch.Tensor:
    """``[N]`` largest read entry of each row (``+inf``: a NaN or ``+inf`` read; ``-inf``: none or not read)."""
    return _maxima(logits, target, floor, backend)


def sums(logits, target, temperature, row_max, floor, request: int, backend: str) -> torch.Tensor:
    """``[k, N]`` int64 fixed-point sums of each row given its ``row_max``."""
    return _sums(logits, target, temperature, row_max.contiguous(), floor, request, backend)


def forward(logits, target, temperature, floor, request: int, backend: str):
    """``(row_max, sums)`` of rows of a whole vocabulary."""
    return _forward(logits, target, temperature, floor, request, backend)


def _finalize_launch(args):
    stats = family.finalize(args.row_max, args.sums, args.label, args.held, args.target, args.temperature,
                            args.request, args.dtype)
    return stats.logp, stats.lse, stats.entropy


def _finalize_fake(args):
    n = args.target.shape[0]
    new = lambda size: args.row_max.new_empty(size, dtype=args.dtype)  # noqa: E731
    return new(n), new(n), new(n if args.request & constants.ENTROPY else 0)


_finalize = define_op(
    "invariant_finalize",
    inputs=(("row_max", TENSOR), ("sums", TENSOR), ("label", TENSOR), ("held", TENSOR), ("target", TENSOR),
            ("temperature", TENSOR), ("request", INT), ("dtype", DTYPE)),
    outputs=("logp", "lse", "entropy"), launch=_finalize_launch, fake=_finalize_fake)


def finalize(row_max, sums, label, held, target, temperature, request: int, dtype) -> StreamStats:
    """``kernels.invariant.finalize`` as an op: ``StreamStats`` with ``logp``, ``lse`` and ``entropy`` (empty unless
    ``request`` asks), the others empty."""
    logp, lse, entropy = _finalize(row_max, sums.contiguous(), label.contiguous(), held, target, temperature, request,
                                   dtype)
    none = lse.new_empty(0)
    found = {"logp": logp, "lse": lse, "entropy": entropy}
    return StreamStats(*(found.get(name, none) for name in table.NAMES))
