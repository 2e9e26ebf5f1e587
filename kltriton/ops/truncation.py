"""The ``truncation`` family as custom ops: ``kltriton::truncated_forward`` (each row's kept set, found from the
knobs or given as a floor, and the statistics of the row restricted to it; differentiable) and
``kltriton::truncated_backward``. Kernel: ``kltriton.dispatch.implementation("truncation", backend)``. Dense logits
only: an LM head's rows go through it one tile of rows at a time (``kltriton.kernels.truncation.linear``)."""
import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.ops._define import BASIS, INT, OPTIONAL, STR, TENSOR, define_op

_ROWS = (("logits", TENSOR), ("target", TENSOR), ("temperature", TENSOR))


def _forward(args):
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
    materialize_grads=False)


def truncated_forward(logits, target, temperature, knobs, floor, request: int, backend: str):
    """``(floor [N], StreamStats)`` of the rows restricted to their kept set: ``floor`` None finds it from ``knobs``
    (``kltriton.truncation.RowKnobs``) row by row, a given ``floor`` is used as it is."""
    out = _forward_op(logits, target, temperature, *knobs, floor, request, backend)
    return out[0], statistics.StreamStats(*out[1:])
