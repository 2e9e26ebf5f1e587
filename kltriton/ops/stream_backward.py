"""``kltriton::stream_backward``: the one backward every op's autograd formula calls.

Gradient w.r.t. the policy logits of ``sum(g_logp * logp + g_entropy * entropy +
g_full_kl * full_kl)``, recomputed from the saved fp32 log-sum-exp (see ``kltriton.kernels``).
It is a custom op of its own so ``torch.compile`` traces the backward graph through it.
"""
from typing import Optional

import torch

from kltriton import _backends


@torch.library.custom_op("kltriton::stream_backward", mutates_args=())
def stream_backward(
    logits: torch.Tensor,               # [..., V]
    ref_logits: Optional[torch.Tensor],  # [..., V], only for the full-KL term
    target: torch.Tensor,               # [N] int64
    temperature: torch.Tensor,          # 0-dim float64
    lse: torch.Tensor,                  # [N] fp32
    ref_lse: Optional[torch.Tensor],    # [N] fp32
    g_logp: torch.Tensor,               # [N] fp32
    g_entropy: Optional[torch.Tensor],  # [N] fp32
    entropy: Optional[torch.Tensor],    # [N] fp32
    g_full_kl: Optional[torch.Tensor],  # [N] fp32
    full_kl: Optional[torch.Tensor],    # [N] fp32
    backend: str,
) -> torch.Tensor:
    return _backends.module(backend).backward(
        logits, ref_logits, target, temperature, lse, ref_lse,
        g_logp.to(lse.dtype).contiguous(),
        None if g_entropy is None else g_entropy.to(lse.dtype).contiguous(), entropy,
        None if g_full_kl is None else g_full_kl.to(lse.dtype).contiguous(), full_kl,
    )


@stream_backward.register_fake
def _(logits, ref_logits, target, temperature, lse, ref_lse, g_logp, g_entropy, entropy, g_full_kl, full_kl, backend):
    return logits.new_empty(logits.shape)


def zeros_if_none(grad, like):
    """Autograd hands ``None`` for an output nobody used; the kernels want a tensor."""
    return torch.zeros_like(like) if grad is None else grad
