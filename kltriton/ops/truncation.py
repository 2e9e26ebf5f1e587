"""The ``truncation`` family as custom ops: ``kltriton::truncated_forward`` (each row's kept set, found from the
knobs or given as a floor, and the statistics of the row restricted to it; differentiable) and
``kltriton::truncated_backward``. Kernel: ``kltriton.dispatch.implementation("truncation", backend)``."""
from typing import Optional, Tuple

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.statistics import Basis
from kltriton.ops._define import define_op


def _forward(
    logits: torch.Tensor,           # [..., V]
    target: torch.Tensor,           # [N] int64
    temperature: torch.Tensor,      # float64 [] or [N]
    top_k: torch.Tensor,            # [N] int64, 0: off
    top_p: torch.Tensor,            # [N] float64, 1: off
    min_p: torch.Tensor,            # [N] float64, 0: off
    floor: Optional[torch.Tensor],  # [N] float32 (keep x >= floor), or None: found from the knobs
    wanted: int,                    # 0 or ENTROPY
    backend: str,
) -> Tuple[(torch.Tensor,) * (1 + len(statistics.NAMES))]:
    given = floor
    floor, stats = dispatch.implementation("truncation", backend).forward(logits, target, temperature, top_k, top_p,
                                                                          min_p, floor, wanted)
    return (floor.clone() if floor is given else floor, *stats)  # an output may not alias an input


def _forward_fake(logits, target, temperature, top_k, top_p, min_p, floor, wanted, backend):
    acc = accumulation_dtype(logits.dtype)
    stats = statistics.empty_stats(target.shape[0], wanted, lambda size: logits.new_empty(size, dtype=acc))
    return (logits.new_empty(target.shape, dtype=torch.float32), *stats)


def _backward_kernel(
    logits: torch.Tensor,       # [..., V]
    target: torch.Tensor,       # [N] int64
    temperature: torch.Tensor,  # float64 [] or [N]
    floor: torch.Tensor,        # [N] float32
    lse: torch.Tensor,          # [N] log-sum-exp over the kept set
    c_label: torch.Tensor,      # [N] gradient basis, / T
    c_p: torch.Tensor,
    c_p_logp: Optional[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("truncation", backend).backward(logits, target, temperature, floor, lse,
                                                                   Basis(c_label, c_p, c_p_logp, None))


truncated_backward = define_op("truncated_backward", _backward_kernel, outputs=("grad",),
                               fake=lambda logits, *rest: logits.new_empty(logits.shape))


def outside_free(grads: dict, logp: torch.Tensor) -> dict:
    """The upstream gradients with the log-prob's dropped where it is ``-inf`` (the label outside the kept set:
    a constant ``-inf`` has no gradient, so such a row gets none from its log-prob)."""
    g = grads.get("logp")
    if g is None:
        return grads
    return dict(grads, logp=torch.where(logp == float("-inf"), torch.zeros_like(g), g))


def _backward(saved, grads):
    stats = statistics.StreamStats(*(getattr(saved, name) for name in statistics.NAMES))
    basis = statistics.gradient_basis(outside_free(grads, stats.logp), stats, saved.temperature)
    return {"logits": truncated_backward(saved.logits, saved.target, saved.temperature, saved.kept_floor, stats.lse,
                                         basis.label, basis.p, basis.p_logp, saved.backend)}


_forward_op = define_op(
    "truncated_forward", _forward, outputs=("kept_floor", *statistics.NAMES), fake=_forward_fake,
    save=("logits", "target", "temperature", "kept_floor", "backend", *statistics.NAMES), backward=_backward,
    materialize_grads=False)


def truncated_forward(logits, target, temperature, knobs, floor, wanted: int, backend: str):
    """``(floor [N], StreamStats)`` of the rows restricted to their kept set: ``floor`` None finds it from ``knobs``
    (``kltriton.truncation.RowKnobs``) row by row, a given ``floor`` is used as it is."""
    out = _forward_op(logits, target, temperature, *knobs, floor, wanted, backend)
    return out[0], statistics.StreamStats(*out[1:])
