"""The ``truncation`` family as custom ops. Kernel: ``kltriton.dispatch.implementation("truncation", backend)``.

Recompute mode: ``kltriton::truncated_forward`` (each row's kept set, found from the knobs or given as a floor, and
the statistics of the row restricted to it; differentiable) and ``kltriton::truncated_backward``. Dense logits only:
an LM head's rows go through it one tile of rows at a time (``kltriton.kernels.truncation.linear``).

Replay mode (``kltriton.kernels.truncation.replay``): ``replay_support`` (the engine's ids in canonical form),
``replay_columns`` (the ``[N, K]`` logits at the ids; its backward ``replay_scatter`` writes the logits gradient,
the C++ backend's into its reused gradient buffer) and ``replay_statistics`` (the row restricted to its kept ids; its
backward ``replay_backward``), each an op of its own so that ``torch.compile`` traces them.
"""
import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, constants, statistics
from kltriton.kernels.statistics import StreamStats
from kltriton.ops import invariant as invariant_ops
from kltriton.ops._define import BASIS, DTYPE, INT, OPTIONAL, STR, TENSOR, define_op

_ROWS = (("logits", TENSOR), ("target", TENSOR), ("temperature", TENSOR))


def _forward(args):
    if args.request & constants.INVARIANT:  # the invariant mode: fixed-point sums above the floor it was given
        stats, _ = invariant_ops.dense_statistics(args.logits, args.target, args.target, args.target >= 0,
                                                  args.temperature, args.floor, args.request, args.backend)
        return (args.floor.clone(), *stats)
    floor, stats = dispatch.implementation("truncation", args.backend).forward(
        args.logits, args.target, args.temperature, args.top_k, args.top_p, args.min_p, args.floor, args.request)
    return (floor.clone() if floor is args.floor else floor, *stats)  # an output may not alias an input


def _forward_fake(args):
    acc = accumulation_dtype(args.logits.dtype)
    stats = statistics.empty_stats(args.target.shape[0], args.request,
                                   lambda size: args.logits.new_empty(size, dtype=acc))
    return (args.logits.new_empty(args.target.shape, dtype=torch.float32), *stats)


def _backward_kernel(args):
    return dispatch.implementation("truncation", args.backend).backward(
        args.logits, args.target, args.temperature, args.floor, args.lse, args.basis)


truncated_backward = define_op(
    "truncated_backward",
    inputs=(*_ROWS, ("floor", TENSOR), ("lse", TENSOR), ("basis", BASIS), ("backend", STR)),
    outputs=("grad",), launch=_backward_kernel, fake=lambda args: args.logits.new_empty(args.logits.shape))


def outside_free(grads: dict, logp: torch.Tensor) -> dict:
    """The upstream gradients with the log-prob's dropped where it is ``-inf`` (the label outside the kept set:
    a constant ``-inf`` has no gradient, so such a row gets none from its log-prob)."""
    g = grads.get("logp")
    if g is None:
        return grads
    return dict(grads, logp=torch.where(logp == float("-inf"), torch.zeros_like(g), g))


def gradient(logits, target, temperature, floor, stats, grads, backend, label_here=None):
    """The logits gradient of upstream ``grads`` (statistic name -> ``[N]``) on the truncated statistics ``stats``
    of the rows kept above ``floor``; ``label_here`` as in ``ops.statistics.gradients``."""
    basis = statistics.gradient_basis(outside_free(grads, stats.logp), stats, temperature)
    if label_here is not None:
        basis = basis._replace(label=torch.where(label_here, basis.label, 0))
    return truncated_backward(logits, target, temperature, floor, stats.lse, basis, backend)


def _backward(saved, grads):
    stats = statistics.StreamStats(*(getattr(saved, name) for name in statistics.NAMES))
    return {"logits": gradient(saved.logits, saved.target, saved.temperature, saved.kept_floor, stats, grads,
                               saved.backend)}


_forward_op = define_op(
    "truncated_forward",
    inputs=(*_ROWS, ("top_k", TENSOR), ("top_p", TENSOR), ("min_p", TENSOR), ("floor", OPTIONAL), ("request", INT),
            ("backend", STR)),
    outputs=("kept_floor", *statistics.NAMES), launch=_forward, fake=_forward_fake,
    save=("logits", "target", "temperature", "kept_floor", "backend", *statistics.NAMES), backward=_backward,
    materialize_grads=False,
    grad_outputs=lambda args: tuple(name for name in statistics.DIFFERENTIABLE if statistics.present(args.request, name)))


def truncated_forward(logits, target, temperature, knobs, floor, request: int, backend: str):
    """``(floor [N], StreamStats)`` of the rows restricted to their kept set: ``floor`` None finds it from ``knobs``
    (``kltriton.truncation.RowKnobs``) row by row, a given ``floor`` is used as it is. A ``request`` with
    ``constants.INVARIANT`` takes a given floor and the ``invariant`` family's sums (``ops.invariant``)."""
    out = _forward_op(logits, target, temperature, *knobs, floor, request, backend)
    return out[0], statistics.StreamStats(*out[1:])


# --- replay ------------------------------------------------------------------------------------------------------

_support_op = define_op(
    "replay_support", inputs=(("ids", TENSOR), ("backend", STR)), outputs=("canonical",),
    launch=lambda args: dispatch.implementation("truncation", args.backend).replay_support(args.ids),
    fake=lambda args: torch.empty_like(args.ids))


def replay_support(ids: torch.Tensor, backend: str) -> torch.Tensor:
    """The canonical form of engine ids ``[N, K]`` int64 (``-1`` padding): each kept id once, in increasing order,
    then ``-1``."""
    return _support_op(ids.contiguous(), backend)


replay_scatter = define_op(
    "replay_scatter", inputs=(("columns", TENSOR), ("ids", TENSOR), ("vocab", INT), ("dtype", DTYPE),
                              ("backend", STR)),
    outputs=("grad",),
    launch=lambda args: dispatch.implementation("truncation", args.backend).replay_scatter(args.columns, args.ids,
                                                                                           args.vocab, args.dtype),
    fake=lambda args: args.columns.new_empty((args.ids.shape[0], args.vocab), dtype=args.dtype))


def _columns_backward(saved, grads):
    logits, grad = saved.logits, grads["values"]
    if grad is None:
        return {}
    scattered = replay_scatter(grad.contiguous(), saved.ids, logits.shape[-1], logits.dtype, saved.backend)
    return {"logits": scattered.view(logits.shape)}


_columns_op = define_op(
    "replay_columns", inputs=(("logits", TENSOR), ("ids", TENSOR), ("backend", STR)), outputs=("values",),
    launch=lambda args: dispatch.implementation("truncation", args.backend).replay_columns(args.logits.detach(),
                                                                                           args.ids),
    fake=lambda args: args.logits.new_empty(args.ids.shape, dtype=accumulation_dtype(args.logits.dtype)),
    save=("logits", "ids", "backend"), backward=_columns_backward, materialize_grads=False)


def replay_columns(logits: torch.Tensor, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """``[N, K]`` logits at ``ids [N, K]`` (``-1``: 0) in the accumulation dtype, read in place (any strides on the
    leading dims); differentiable: the gradient is the backend's ``replay_scatter`` of the ``K`` columns'."""
    return _columns_op(logits, ids.contiguous(), backend)


def _replay_fake(args):
    n, values = args.target.shape[0], args.values
    new = lambda size, dtype=values.dtype: values.new_empty(size, dtype=dtype)  # noqa: E731
    entropy = new(n if args.request & statistics.constants.ENTROPY else 0)
    return new(n), new(n), entropy, new(n), new(n, torch.float64), new(n, torch.int64)


_ROWS_KEPT = (("values", TENSOR), ("ids", TENSOR), ("target", TENSOR), ("temperature", TENSOR))

replay_backward = define_op(
    "replay_backward", inputs=(*_ROWS_KEPT, ("row_max", TENSOR), ("log_mass", TENSOR), ("basis", BASIS),
                               ("backend", STR)),
    outputs=("grad",),
    launch=lambda args: dispatch.implementation("truncation", args.backend).replay_backward(
        args.values, args.ids, args.target, args.temperature, args.row_max, args.log_mass, args.basis),
    fake=lambda args: args.values.new_empty(args.values.shape))


def _replay_statistics_backward(saved, grads):
    none = saved.logp.new_empty(0)
    stats = StreamStats(*(getattr(saved, name) if name in ("logp", "lse", "entropy") else none
                          for name in statistics.NAMES))
    g = grads.get("logp")
    if g is not None:  # a label outside the kept set: its log-prob is a constant -inf, without gradient
        g = torch.where(saved.label_column >= 0, g, torch.zeros((), dtype=g.dtype, device=g.device))
    basis = statistics.gradient_basis({"logp": g, "entropy": grads.get("entropy")}, stats, saved.temperature)
    return {"values": replay_backward(saved.values, saved.ids, saved.target, saved.temperature, saved.row_max,
                                      saved.log_mass, basis, saved.backend)}


_replay_statistics_op = define_op(
    "replay_statistics", inputs=(*_ROWS_KEPT, ("request", INT), ("backend", STR)),
    outputs=("logp", "lse", "entropy", "row_max", "log_mass", "label_column"),
    launch=lambda args: tuple(dispatch.implementation("truncation", args.backend).replay_forward(
        args.values, args.ids, args.target, args.temperature, args.request)),
    fake=_replay_fake,
    save=("values", "ids", "target", "temperature", "backend", "logp", "lse", "entropy", "row_max", "log_mass",
          "label_column"),
    backward=_replay_statistics_backward, materialize_grads=False,
    grad_outputs=lambda args: ("logp", "entropy") if args.request & statistics.constants.ENTROPY else ("logp",))


def replay_statistics(values: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor,
                      request: int, backend: str) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``request`` asks) of each row restricted to its kept
    logits ``values [N, K]`` at the canonical support ``ids`` (``replay_support``), differentiable w.r.t.
    ``values``."""
    logp, lse, entropy = _replay_statistics_op(values.contiguous(), ids.contiguous(), target, temperature, request,
                                               backend)[:3]
    none = logp.new_empty(0)
    found = {"logp": logp, "lse": lse, "entropy": entropy}
    return StreamStats(*(found.get(name, none) for name in statistics.NAMES))
