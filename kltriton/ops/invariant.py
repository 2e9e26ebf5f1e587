"""The ``invariant`` family as custom ops (not differentiable: the ops that call them wire the gradient):
``invariant_maxima``, ``invariant_sums`` and ``invariant_forward`` (both on rows of a whole vocabulary), kernel
``kltriton.dispatch.implementation("invariant", backend)``; ``invariant_finalize`` (the statistics from them,
``kltriton.kernels.invariant.finalize``), an op of its own so that ``torch.compile`` runs its float64 arithmetic as
eager does (a compiled graph may fuse and reorder it: other bits). Contract in ``kltriton.kernels.invariant``.

And the passes of the invariant mode (``kltriton.invariant``) over one side, which the ``statistics`` and
``truncated_forward`` ops run when their request has ``constants.INVARIANT`` and the vocab-parallel passes
(``kltriton.parallel``) run over shards: ``dense_statistics`` (dense logits, optionally above a floor),
``head_statistics`` (an LM head: GEMMs of one fixed shape, ``kernels.linear.fixed``) and ``statistics`` (the policy's,
and the reference's in its own pass). On a vocab shard each takes ``reduce``: the all-reduce max of the rows' maxima
and the int64 all-reduce of their packed sums (``kernels.invariant.pack``), between the kernels.
"""
import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, constants
from kltriton.kernels import invariant as family
from kltriton.kernels import statistics as table
from kltriton.kernels.invariant import pack, sum_count, unpack
from kltriton.kernels.linear import Side, fixed
from kltriton.kernels.row_views import as_rows3d
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


# --- the passes of the invariant mode --------------------------------------------------------------------------

def label_logits(logits, target, floor) -> torch.Tensor:
    """``[N]`` float64 logit at each row's ``target`` column (column 0 for a sentinel), ``-inf`` below the floor."""
    rows3d = as_rows3d(logits)
    a, b, _ = rows3d.shape
    x = rows3d.gather(2, target.clamp(min=0).view(a, b, 1)).reshape(-1).double()
    if floor is not None:
        x = torch.where(x < floor.double(), torch.full((), float("-inf"), dtype=torch.float64, device=x.device), x)
    return x


def dense_statistics(logits, target, kernel_target, own, temperature, floor, request: int, backend: str,
                     reduce=None):
    """``(StreamStats, held)`` of dense ``logits [..., V]`` restricted to the entries ``>= floor`` (None: all):
    ``logp``, ``lse`` and ``entropy`` (when ``request`` has ``ENTROPY``), the others empty. ``target`` ``[N]``: the
    global labels and sentinels; ``kernel_target``: this vocabulary's column of each label (column 0 where another
    shard holds it); ``own`` ``[N]`` bool: the label is in this vocabulary. ``reduce``: None for rows of a whole
    vocabulary (one kernel for the maxima and the sums), else ``(reduce_max, reduce_sum)`` over the shards.
    ``held``: ``[N]`` bool, some shard holds the row's label."""
    request &= constants.ENTROPY
    logits = logits.detach()
    label = label_logits(logits, kernel_target, floor)
    if reduce is None:
        row_max, row_sums = forward(logits, kernel_target, temperature, floor, request, backend)
        held = own
    else:
        reduce_max, reduce_sum = reduce
        row_max = reduce_max(maxima(logits, kernel_target, floor, backend))
        row_sums = sums(logits, kernel_target, temperature, row_max, floor, request, backend)
        row_sums, held, label = unpack(reduce_sum(pack(row_sums, own, label)))
    stats = finalize(row_max, row_sums, label, held, target, temperature, request, accumulation_dtype(logits.dtype))
    return stats, held


def _identity(tensor):
    return tensor


def head_statistics(side: Side, target, label, temperature, request: int, backend: str, tile_elements: int,
                    reduce=None):
    """``dense_statistics`` of an LM head ``side`` (its weight this vocabulary's rows) from GEMMs of one fixed shape
    (``kernels.linear.fixed.forward``, joined over the shards by ``reduce`` per token tile). ``label`` ``[N]``: the
    label's column in this vocabulary, ``-1`` where it is not here."""
    request &= constants.ENTROPY
    reduce_max, reduce_sum = reduce if reduce is not None else (_identity, _identity)
    side = Side(*(t.detach() if isinstance(t, torch.Tensor) else t for t in side))
    kernels = dispatch.implementation("invariant", backend)
    row_max, packed = fixed.forward(side, target >= 0, label, temperature, request, kernels, tile_elements, reduce_max,
                                    reduce_sum)
    row_sums, held, value = unpack(packed)
    stats = finalize(row_max, row_sums, value, held, target, temperature, request,
                     accumulation_dtype(side.x.dtype))
    return stats, held


def statistics(policy: Side, ref, target, kernel_target, own, temperature, request: int, backend: str,
               tile_elements: int, reduce=None):
    """``(StreamStats, held)``: the policy's ``dense_statistics`` or ``head_statistics`` and, when ``request`` has
    ``REF``, the reference's ``logp`` and ``lse`` from a pass of its own (either side dense logits or an LM head)."""

    def one(side, side_request):
        if side.weight is None:
            return dense_statistics(side.x, target, kernel_target, own, temperature, None, side_request, backend,
                                    reduce)
        label = torch.where(own, kernel_target, torch.full_like(kernel_target, -1))
        return head_statistics(side, target, label, temperature, side_request, backend, tile_elements, reduce)

    stats, held = one(policy, request)
    if ref is not None and request & constants.REF:
        ref_stats, _ = one(ref, 0)
        stats = stats._replace(ref_logp=ref_stats.logp, ref_lse=ref_stats.lse)
    return stats, held
