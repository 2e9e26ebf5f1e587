"""The ``truncation`` family as custom ops: ``kltriton::truncation_floor`` (the kept set of each row, no
gradient) and ``kltriton::truncated_forward`` / ``truncated_backward`` (the statistics of the rows restricted to
their kept set, differentiable). Kernel: ``kltriton.dispatch.implementation("truncation", backend)``."""
from typing import Optional

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.statistics import Basis
from kltriton.ops._define import define_op


def _floor(
    logits: torch.Tensor,       # [..., V]
    target: torch.Tensor,       # [N] int64
    temperature: torch.Tensor,  # float64 [] or [N]
    top_k: torch.Tensor,        # [N] int64, 0: off
    top_p: torch.Tensor,        # [N] float64, 1: off
    min_p: torch.Tensor,        # [N] float64, 0: off
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("truncation", backend).floor(logits.detach(), target, temperature, top_k, top_p,
                                                                min_p)


truncation_floor = define_op("truncation_floor", _floor, outputs=("floor",),
                             fake=lambda logits, target, *rest: logits.new_empty(target.shape, dtype=torch.float32))


def _forward(
    logits: torch.Tensor,       # [..., V]
    target: torch.Tensor,       # [N] int64
    temperature: torch.Tensor,  # float64 [] or [N]
    floor: torch.Tensor,        # [N] float32: keep x >= floor
    wanted: int,                # 0 or ENTROPY
    backend: str,
) -> statistics.StatsTuple:
    return tuple(dispatch.implementation("truncation", backend).forward(logits, target, temperature, floor, wanted))


def _forward_fake(logits, target, temperature, floor, wanted, backend):
    acc = accumulation_dtype(logits.dtype)
    return tuple(statistics.empty_stats(target.shape[0], wanted, lambda size: logits.new_empty(size, dtype=acc)))


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
    return {"logits": truncated_backward(saved.logits, saved.target, saved.temperature, saved.floor, stats.lse,
                                         basis.label, basis.p, basis.p_logp, saved.backend)}


truncated_forward = define_op(
    "truncated_forward", _forward, outputs=statistics.NAMES, fake=_forward_fake,
    save=("logits", "target", "temperature", "floor", "backend", *statistics.NAMES), backward=_backward,
    materialize_grads=False)
