"""The statistics pass as custom ops: ``kltriton::statistics`` and its gradient ``kltriton::statistics_backward``.

One op per pass, keyed on the sides (``kltriton.kernels.linear.Side``): when both the policy and the reference
(if any) are dense logits, the backend's ``stream`` family runs; when a side is an LM head, its ``linear`` family
(GEMM tiles folded by the same ``stream`` kernel). ``statistics`` returns the ``StreamStats`` of the rows
(``kltriton.kernels.statistics``); autograd turns the upstream gradients of its differentiable statistics into the
gradient basis (``statistics.gradient_basis``) and ``statistics_backward`` takes them to the policy's logits, or to
its hidden states, weight and bias. ``labels_here``: every scored target is a label of this vocabulary (False on a
vocab shard, where a target ``>= V`` is a label another shard holds). ``rows``: the one-tile path's GEMM operand when
it was made with the target (``_inputs.Layout.scored_rows``), else None.

A request with ``constants.INVARIANT`` (the invariant mode) runs the ``invariant`` family's passes instead
(``ops.invariant.statistics``: each side its own pass, an LM head by GEMMs of one fixed shape); the gradient is the
same ``stream`` backward on their ``lse`` (an LM head's per fixed-shape tile, ``kernels.linear.fixed.backward``).
"""
import functools

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, constants
from kltriton.kernels import statistics as table
from kltriton.kernels.statistics import StreamStats
from kltriton.kernels.linear import fixed
from kltriton.kernels.linear.tiles import one_tile, plan
from kltriton.kernels.stream import Upstream
from kltriton._autograd import first_order, used_up
from kltriton.ops import invariant as invariant_ops
from kltriton.ops._define import (BASIS, BOOL, INT, MUTABLE, NEEDS_GRAD, OPTIONAL, SIDE, STR, TENSOR, UPSTREAM, NeedsGrad,
                                  define_op, eager)


def family(policy, ref) -> str:
    """``stream`` for dense logits on both sides, ``linear`` when a side is an LM head."""
    return "stream" if policy.weight is None and (ref is None or ref.weight is None) else "linear"


def _keeps_tile(args) -> bool:
    """Whether the forward keeps an LM head's one logits tile for the backward (``tiles.one_tile``)."""
    return (family(args.policy, args.ref) == "linear" and args.labels_here and not args.request & constants.INVARIANT
            and one_tile(args.policy, args.ref, args.target.numel(), args.tile_elements))


def _forward(args):
    """The statistics, and ``tile``: the one-tile path's logits tile, kept for the backward (``[0]`` otherwise)."""
    name = family(args.policy, args.ref)
    none = args.target.new_empty(0, dtype=torch.float32)
    if args.request & constants.INVARIANT:
        stats, _ = invariant_ops.statistics(args.policy, args.ref, args.target, args.target, args.target >= 0,
                                            args.temperature, args.request, args.backend, args.tile_elements)
        return (*stats, none)
    impl = dispatch.implementation(name, args.backend)
    if name == "stream":
        return (*impl.forward(args.policy.x, None if args.ref is None else args.ref.x, args.target, args.temperature,
                              args.request), none)
    if _keeps_tile(args):
        stats, tile = impl.one_tile_forward(args.policy, args.target, args.temperature, args.request,
                                            args.tile_elements, args.rows)
        return (*stats, tile)
    return (*impl.forward(args.policy, args.ref, args.target, args.temperature, args.request, args.tile_elements),
            none)


def _forward_fake(args):
    acc = accumulation_dtype(args.policy.x.dtype)
    n = args.target.shape[0]
    stats = table.empty_stats(n, args.request, lambda size: args.policy.x.new_empty(size, dtype=acc))
    tile = (0,)
    if _keeps_tile(args):
        tile = plan(args.policy.weight.shape[0], args.tile_elements)
    return (*stats, args.policy.x.new_empty(tile, dtype=acc if len(tile) > 1 else torch.float32))


def _no_gradients(side, gradients):
    """``(d_x, d_weight, d_bias)`` with an empty tensor where there is none (an op's output may not be None or alias
    an input)."""
    return tuple(side.x.new_empty(0) if d is None else d for d in gradients)


def _backward_kernel(args):
    name = family(args.policy, args.ref)
    if name == "linear" and args.invariant:  # the logits of the invariant mode's GEMMs, one fixed shape
        return _no_gradients(args.policy, fixed.backward(
            args.policy, args.target >= 0, args.target, args.temperature, args.lse, args.basis,
            dispatch.implementation("stream", args.backend), args.needs_grad))
    impl = dispatch.implementation(name, args.backend)
    if name == "stream":
        grad = impl.backward(args.policy.x, None if args.ref is None else args.ref.x, args.target, args.temperature,
                             args.lse, args.ref_lse, args.basis)
        return _no_gradients(args.policy, (grad, None, None))
    return _no_gradients(args.policy, impl.backward(args.policy, args.ref, args.target, args.temperature, args.lse,
                                                    args.ref_lse, args.basis, *args.needs_grad, args.tile_elements))


def empty_gradients(side, needs_grad):
    """Empty tensors shaped like the ones request of the side's ``(x, weight, bias)`` (``[0]`` for the others)."""
    return tuple(t.new_empty(t.shape) if w and t is not None else side.x.new_empty(0)
                 for t, w in zip((side.x, side.weight, side.bias), needs_grad))


statistics_backward = define_op(
    "statistics_backward",
    inputs=(("policy", SIDE), ("ref", SIDE), ("target", TENSOR), ("temperature", TENSOR), ("lse", TENSOR),
            ("ref_lse", OPTIONAL), ("basis", BASIS), ("needs_grad", NEEDS_GRAD), ("tile_elements", INT),
            ("invariant", BOOL), ("backend", STR)),
    outputs=("d_x", "d_weight", "d_bias"), launch=_backward_kernel,
    fake=lambda args: empty_gradients(args.policy, (True, *args.needs_grad[1:]) if args.policy.weight is None else args.needs_grad))


def gradients(policy, ref, target, temperature, tile_elements, backend, grads, stats, needs_grad, label_here=None,
              invariant=False):
    """``(d_x, d_weight, d_bias)`` of upstream gradients ``grads`` (statistic name -> ``[N]`` or None) on the
    statistics ``stats`` of a forward of ``policy`` and ``ref`` (``needs_grad``: which of the three; the others come back
    empty). The reference is read only for the basis terms that need it (``Basis.reads_ref``). ``label_here``:
    ``[N]`` bool, the rows whose label this vocab shard holds (the label term on those only). ``invariant``: the
    statistics of the invariant mode (an LM head's logits rebuilt by its GEMMs of one shape)."""
    basis = table.gradient_basis(grads, stats, temperature)
    if label_here is not None:
        basis = basis._replace(label=torch.where(label_here, basis.label, 0))
    with_ref = basis.reads_ref()
    return statistics_backward(policy, ref if with_ref else None, target, temperature, stats.lse,
                               stats.ref_lse if with_ref else None, basis, NeedsGrad(*needs_grad), tile_elements,
                               invariant, backend)


def _gradient_kernel(args):
    upstream = Upstream(*(None if g is None else g.contiguous() for g in args.upstream))
    return dispatch.implementation("stream", args.backend).backward_upstream(
        args.logits, args.ref, args.target, args.temperature, args.lse, args.ref_lse, upstream)


statistics_gradient = define_op(
    "statistics_gradient",
    inputs=(("logits", TENSOR), ("ref", OPTIONAL), ("target", TENSOR), ("temperature", TENSOR), ("lse", TENSOR),
            ("ref_lse", OPTIONAL), ("upstream", UPSTREAM), ("backend", STR)),
    outputs=("grad",), launch=_gradient_kernel, fake=lambda args: args.logits.new_empty(args.logits.shape))


def _tile_gradient(args):
    upstream = Upstream(*(None if g is None else g.contiguous() for g in args.upstream))
    return _no_gradients(args.policy, dispatch.implementation("linear", args.backend).one_tile_backward(
        args.policy, args.tile, args.target, args.temperature, args.lse, upstream, *args.needs_grad))


tile_gradient = define_op(
    "tile_gradient",
    inputs=(("policy", SIDE), ("tile", MUTABLE), ("target", TENSOR), ("temperature", TENSOR), ("lse", TENSOR),
            ("upstream", UPSTREAM), ("needs_grad", NEEDS_GRAD), ("backend", STR)),
    outputs=("d_x", "d_weight", "d_bias"), launch=_tile_gradient,
    fake=lambda args: empty_gradients(args.policy, args.needs_grad))


def _dense_gradient(logits, ref, target, temperature, lse, ref_lse, upstream, backend):
    """The gradient of dense logits: the basis is computed per row inside the kernel, which reads the reference only
    for the terms that need it."""
    with_ref = upstream.reads_ref()
    return statistics_gradient(logits, ref if with_ref else None, target, temperature, lse,
                               ref_lse if with_ref else None, upstream, backend)


def _present(grads, saved) -> dict:
    """The gradients ``grads`` (statistic name -> ``[N]`` or None) of the differentiable statistics a forward computed
    (``saved`` holds them by name): a statistic it did not compute has no gradient (a traced backward may hand it an
    empty one)."""
    return {name: g for name, g in grads.items()
            if g is not None and name in table.DIFFERENTIABLE and getattr(saved, name).shape == saved.lse.shape}


def _upstream(grads, entropy, full_kl) -> Upstream:
    """The ``Upstream`` of the kernels from ``_present`` gradients and the forward's ``entropy`` and ``full_kl``."""
    d_entropy, d_full_kl = grads.get("entropy"), grads.get("full_kl")
    return Upstream(grads.get("logp"), d_entropy, d_full_kl, grads.get("forward_kl"),
                    None if d_entropy is None else entropy, None if d_full_kl is None else full_kl)


def _backward(saved, grads):
    needs_grad = saved.needs_grad["policy"][:3]
    policy, ref = saved.policy, saved.ref
    grads = _present(grads, saved)
    upstream = _upstream(grads, saved.entropy, saved.full_kl)
    if family(policy, ref) == "stream":
        grad = _dense_gradient(policy.x, None if ref is None else ref.x, saved.target, saved.temperature, saved.lse,
                               saved.ref_lse, upstream, saved.backend)
        return {"policy": (grad, None, None)}
    if saved.tile.numel():  # one tile, kept by the forward: the gradient is written over it
        # Through the dispatcher (torch.compile, opcheck) the tile is an output of the op others may hold (and a saved
        # output written in place cannot be partitioned): write a copy. An eager call's tile is its own.
        if getattr(saved, "repeated", False):
            raise used_up("LinearLogits")
        tile = saved.tile if getattr(saved, "eager", False) else saved.tile.clone()
        d = tile_gradient(policy, tile, saved.target, saved.temperature, saved.lse, upstream, NeedsGrad(*needs_grad),
                          saved.backend)
        return {"policy": tuple(g if w else None for g, w in zip(d, needs_grad))}
    stats = StreamStats(*(getattr(saved, name) for name in table.NAMES))
    d = gradients(policy, ref, saved.target, saved.temperature, saved.tile_elements, saved.backend,
                  grads, stats, needs_grad, invariant=bool(saved.request & constants.INVARIANT))
    return {"policy": tuple(g if w else None for g, w in zip(d, needs_grad))}


@functools.lru_cache(maxsize=None)
def _differentiable(request: int) -> tuple:
    """The differentiable statistics a forward with ``request`` computes."""
    return tuple(name for name in table.DIFFERENTIABLE if table.present(request, name))


statistics = define_op(
    "statistics",
    inputs=(("policy", SIDE), ("ref", SIDE), ("target", TENSOR), ("temperature", TENSOR), ("request", INT),
            ("tile_elements", INT), ("labels_here", BOOL), ("rows", OPTIONAL), ("backend", STR)),
    outputs=(*table.NAMES, "tile"), launch=_forward, fake=_forward_fake,
    save=("policy", "ref", "target", "temperature", "request", "tile_elements", "backend", *table.NAMES, "tile"),
    backward=_backward,
    materialize_grads=False,
    grad_outputs=lambda args: _differentiable(args.request))


class _DenseStatistics(torch.autograd.Function):
    """``statistics`` of dense logits in an eager call that needs a gradient (``local``): the ``stream`` kernels
    through one plain autograd node, without ``Op``'s generic bookkeeping, which costs more than the kernels at small
    ``N`` (``python -m benchmarks host``). The forward returns the differentiable statistics of the request and puts
    every statistic in ``out`` (then the target); the statistics it does not return are held, the ones it returns
    saved (holding a returned output would be a reference cycle through this node). Without a target it makes it from
    the label side (``plan``'s ``source``) with the statistics (``forward_labels``)."""

    @staticmethod
    def forward(ctx, logits, temperature, plan):
        ref, target, request, backend, out, source = plan  # one argument: each costs the node's apply a little
        impl = dispatch.implementation("stream", backend)
        if target is None:  # made from the label side in the same call (``dense_labels``)
            target, stats = impl.forward_labels(logits, ref, *source, temperature, request)
        else:
            stats = impl.forward(logits, ref, target, temperature, request)
        out += (stats, target)
        names = ctx.names = _differentiable(request)
        ctx.backend, ctx.lse, ctx.ref_lse = backend, stats.lse, stats.ref_lse
        ctx.save_for_backward(logits, ref, target, temperature, stats.entropy if "entropy" in names else None,
                              stats.full_kl if "full_kl" in names else None)
        ctx.set_materialize_grads(False)
        return tuple(getattr(stats, name) for name in names)

    @staticmethod
    @first_order("kltriton::statistics")
    def backward(ctx, *grads):
        logits, ref, target, temperature, entropy, full_kl = ctx.saved_tensors
        given = {name: g for name, g in zip(ctx.names, grads) if g is not None}
        upstream = _upstream(given, entropy, full_kl)
        grad = _dense_gradient(logits, ref, target, temperature, ctx.lse, ctx.ref_lse, upstream, ctx.backend)
        return grad, None, None


def local(policy, ref, target, temperature, request, tile_elements, backend, rows=None) -> StreamStats:
    """``StreamStats`` of this rank's rows (every target a label of this vocabulary): the ``statistics`` op, or, for
    dense logits in an eager call (``eager``: no ``torch.compile``, fake or functional tensor) outside the invariant
    mode, the backend's kernels called directly (``_DenseStatistics`` when the logits need a gradient). ``rows``: the
    op's (an LM head's one tile)."""
    if (family(policy, ref) != "stream" or request & constants.INVARIANT
            or not eager((policy.x, None if ref is None else ref.x, target, temperature))):
        return StreamStats(*statistics(policy, ref, target, temperature, request, tile_elements, True, rows,
                                       backend)[:len(table.NAMES)])
    return dense(policy.x, None if ref is None else ref.x, target, temperature, request, backend)


def dense(logits, ref, target, temperature, request, backend) -> StreamStats:
    """``local`` of dense ``logits`` (and ``ref`` logits, or None) in an eager call: the ``stream`` backend's forward,
    inside ``_DenseStatistics`` when the logits need a gradient."""
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return dispatch.implementation("stream", backend).forward(logits, ref, target, temperature, request)
    out = []
    _DenseStatistics.apply(logits, temperature, (ref, target, request, backend, out, None))
    return out[0]  # the statistics the node returned are these tensors, now with their gradient function


def dense_labels(logits, ref, layout, temperature, request, backend) -> StreamStats:
    """``dense`` at the targets of ``layout`` (an ``_inputs.Layout`` whose target is not made yet, ``pending``), made
    in the same call (the stream family's ``forward_labels``: one op on the C++ backend)."""
    source = layout.kernel_source()
    if not (torch.is_grad_enabled() and logits.requires_grad):
        target, stats = dispatch.implementation("stream", backend).forward_labels(logits, ref, *source, temperature,
                                                                                  request)
    else:
        out = []
        _DenseStatistics.apply(logits, temperature, (ref, None, request, backend, out, source))
        stats, target = out
    layout.made(target)
    return stats
