"""``token_logprobs``: log-prob (and entropy) of the labelled token, one pass over the vocab."""
from typing import Optional, Tuple

import torch

from kltriton import _backends
from kltriton._inputs import build_layout, check_logits, check_temperature, stats_dtype
from kltriton.ops.stream_backward import stream_backward, zeros_if_none


@torch.library.custom_op("kltriton::token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: torch.Tensor,   # [..., V]
    target: torch.Tensor,   # [N] int64 (see kltriton.kernels)
    temperature: torch.Tensor,  # 0-dim float64
    with_entropy: bool,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(logp [N], entropy [N] or [0], lse [N])``, all fp32."""
    stats = _backends.module(backend).forward(logits, None, target, temperature, with_entropy, False)
    return stats.logp, stats.entropy, stats.lse


@_token_logprobs_op.register_fake
def _(logits, target, temperature, with_entropy, backend):
    n = target.shape[0]
    new = lambda size: logits.new_empty(size, dtype=stats_dtype(logits))  # noqa: E731
    return new(n), new(n if with_entropy else 0), new(n)


def _setup_context(ctx, inputs, output):
    logits, target, temperature, with_entropy, backend = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, target, temperature, lse, entropy)
    ctx.with_entropy, ctx.backend = with_entropy, backend


def _backward(ctx, g_logp, g_entropy, g_lse):
    logits, target, temperature, lse, entropy = ctx.saved_tensors
    grad = stream_backward(
        logits, None, target, temperature, lse, None,
        zeros_if_none(g_logp, lse),
        zeros_if_none(g_entropy, lse) if ctx.with_entropy else None,
        entropy if ctx.with_entropy else None,
        None, None, ctx.backend,
    )
    return grad, None, None, None, None


_token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    shift_labels: bool = False,
    return_entropy: bool = False,
    backend: Optional[str] = None,
):
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``, without ``[N, V]`` temporaries.

    Args:
        logits: ``[..., V]`` fp32 / bf16 / fp16; any strides on the leading dims
            (``logits[:, :-1]`` is read in place).
        labels: integer ``S = logits.shape[:-1]``; ``ignore_index`` marks unscored positions.
        mask: optional bool ``S``; False = not scored.
        cu_seqlens: optional ``[num_seqs + 1]`` offsets of packed sequences in ``[N, V]`` logits.
        shift_labels: ``labels`` are input ids; position ``t`` is scored on ``labels[t + 1]``
            of the same sequence (``mask[t + 1]`` decides), the last position of each is not.
        return_entropy: also return the entropy of ``softmax(logits[t] / T)``.
        backend: ``"triton" | "cpp" | "reference"``; default by device (``KLTRITON_BACKEND``).

    Returns:
        ``logp`` fp32 ``S`` (``<= 0``, exactly 0 where not scored), or ``(logp, entropy)``.
        Differentiable w.r.t. ``logits`` (gradient in ``logits.dtype``).
    """
    check_logits(logits)
    temperature = check_temperature(temperature, logits.device)
    layout = build_layout(logits, labels, ignore_index=ignore_index, mask=mask,
                          cu_seqlens=cu_seqlens, shift_labels=shift_labels)
    backend = _backends.resolve(backend, logits)
    logp, entropy, _ = _token_logprobs_op(logits, layout.target, temperature, bool(return_entropy), backend)
    logp = logp.view(layout.shape)
    return (logp, entropy.view(layout.shape)) if return_entropy else logp
