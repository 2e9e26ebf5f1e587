"""The ``stream`` family as differentiable custom ops: ``kltriton::stream_forward`` / ``stream_backward``.

``stream_forward`` returns the ``StreamStats`` of the rows (``kltriton.kernels.statistics``); autograd
turns the upstream gradients of its differentiable statistics into the gradient basis
(``statistics.gradient_basis``) and ``stream_backward`` (a custom op of its own, so ``torch.compile``
traces it) takes them to the logits. Kernel: ``kltriton.dispatch.implementation("stream", backend)``.
"""
from typing import Optional

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.statistics import Basis
from kltriton.ops._define import define_op


def _forward(
    logits: torch.Tensor,                # [..., V]
    ref_logits: Optional[torch.Tensor],  # [..., V] or None
    target: torch.Tensor,                # [N] int64 (kltriton.kernels.constants)
    temperature: torch.Tensor,           # float64 [] or [N]
    wanted: int,                         # request bits (kltriton.kernels.constants)
    backend: str,
) -> statistics.StatsTuple:
    return tuple(dispatch.implementation("stream", backend).forward(logits, ref_logits, target, temperature, wanted))


def _forward_fake(logits, ref_logits, target, temperature, wanted, backend):
    acc = accumulation_dtype(logits.dtype)
    return tuple(statistics.empty_stats(target.shape[0], wanted, lambda size: logits.new_empty(size, dtype=acc)))


def _backward_kernel(
    logits: torch.Tensor,                # [..., V]
    ref_logits: Optional[torch.Tensor],  # [..., V], read only for the p_logq and q terms
    target: torch.Tensor,                # [N] int64
    temperature: torch.Tensor,           # float64 [] or [N]
    lse: torch.Tensor,                   # [N]
    ref_lse: Optional[torch.Tensor],     # [N], with the p_logq or q term
    c_label: torch.Tensor,               # [N] gradient basis (kltriton.kernels.statistics.Basis), / T
    c_p: torch.Tensor,
    c_p_logp: Optional[torch.Tensor],
    c_p_logq: Optional[torch.Tensor],
    c_q: Optional[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("stream", backend).backward(
        logits, ref_logits, target, temperature, lse, ref_lse, Basis(c_label, c_p, c_p_logp, c_p_logq, c_q))


stream_backward = define_op(
    "stream_backward", _backward_kernel, outputs=("grad",),
    fake=lambda logits, *rest: logits.new_empty(logits.shape))


def _backward(saved, grads):
    stats = statistics.StreamStats(*(getattr(saved, name) for name in statistics.NAMES))
    basis = statistics.gradient_basis(grads, stats, saved.temperature)
    with_ref = basis.reads_ref()
    return {"logits": stream_backward(saved.logits, saved.ref_logits if with_ref else None, saved.target,
                                      saved.temperature, stats.lse, stats.ref_lse if with_ref else None, *basis,
                                      saved.backend)}


stream_forward = define_op(
    "stream_forward", _forward, outputs=statistics.NAMES, fake=_forward_fake,
    save=("logits", "ref_logits", "target", "temperature", "backend", *statistics.NAMES), backward=_backward,
    materialize_grads=False)
