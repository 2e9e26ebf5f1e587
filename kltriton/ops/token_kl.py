"""``token_kl``: per-token KL between the policy and a reference, from logits or log-probs.

With reference logits, one kernel reads each row of both logits once and yields both
log-probs (and, for ``"full"``, the exact KL over the vocab); with reference log-probs,
only the policy row is read. The estimator is ``[N]`` work on the kernel's results.
"""
from typing import NamedTuple, Optional, Tuple

import torch

from kltriton import _backends, estimators
from kltriton._inputs import build_layout, check_logits, check_temperature, stats_dtype
from kltriton.ops.stream_backward import stream_backward, zeros_if_none


class KLOutput(NamedTuple):
    kl: torch.Tensor            # S fp32
    logprobs: torch.Tensor      # S fp32
    ref_logprobs: torch.Tensor  # S fp32


def ref_is_logits(logits: torch.Tensor, ref) -> bool:
    """Whether ``ref`` holds reference logits (``[..., V]``) or reference log-probs (``S``)."""
    if not isinstance(ref, torch.Tensor):
        raise TypeError(f"ref must be a torch.Tensor of reference logits or log-probs, got {type(ref).__name__}")
    if not ref.dtype.is_floating_point:
        raise TypeError(f"ref must be floating point, got {ref.dtype}")
    if ref.device != logits.device:
        raise ValueError(f"ref is on {ref.device} but logits are on {logits.device}")
    if ref.shape == logits.shape:
        if ref.dtype != logits.dtype:
            raise TypeError(f"ref logits must have the logits' dtype {logits.dtype}, got {ref.dtype}")
        return True
    if ref.shape == logits.shape[:-1]:
        return False
    raise ValueError(f"ref must be reference logits of shape {tuple(logits.shape)} or reference log-probs "
                     f"of shape {tuple(logits.shape[:-1])}, got {tuple(ref.shape)}")


def check_estimator(estimator, kl_clamp, with_ref_logits):
    name = estimators.canonical(estimator)
    if name == "full" and not with_ref_logits:
        raise ValueError("estimator='full' needs reference logits in ref, not reference log-probs")
    return name, estimators.check_kl_clamp(kl_clamp)


def kl_forward(logits, ref, target, estimator, kl_clamp, temperature, backend):
    """``(kl, logp, ref_logp, lse, ref_lse, full_kl)``, flat fp32 ``[N]`` (the last two may be ``[0]``)."""
    kernels = _backends.module(backend)
    if ref.dim() == logits.dim():
        stats = kernels.forward(logits, ref, target, temperature, False, estimator == "full")
        ref_logp, ref_lse = stats.ref_logp, stats.ref_lse
    else:
        stats = kernels.forward(logits, None, target, temperature, False, False)
        ref_flat = ref.reshape(-1).to(stats.logp.dtype)
        ref_logp = torch.where(target >= 0, ref_flat, torch.zeros_like(ref_flat))
        ref_lse = stats.ref_lse
    kl = estimators.value(estimator, kl_clamp, stats.logp, ref_logp, stats.full_kl)
    return kl, stats.logp, ref_logp, stats.lse, ref_lse, stats.full_kl


def kl_forward_fake(logits, ref, target, estimator):
    n = target.shape[0]
    new = lambda size: logits.new_empty(size, dtype=stats_dtype(logits))  # noqa: E731
    with_ref_logits = ref.dim() == logits.dim()
    return (new(n), new(n), new(n), new(n), new(n if with_ref_logits else 0),
            new(n if estimator == "full" else 0))


def kl_backward(logits, ref, target, estimator, kl_clamp, temperature, backend,
                logp, ref_logp, lse, ref_lse, full_kl, g_kl, g_logp):
    """Gradient w.r.t. the policy logits given the gradients of ``kl`` and ``logp`` (``[N]``)."""
    g_label, g_full = estimators.grad_wrt_logp(estimator, kl_clamp, logp, ref_logp, full_kl, g_kl)
    if g_label is not None:
        g_logp = g_logp + g_label
    full = g_full is not None
    return stream_backward(
        logits, ref if full else None, target, temperature, lse, ref_lse if full else None,
        g_logp, None, None, g_full, full_kl if full else None, backend,
    )


@torch.library.custom_op("kltriton::token_kl", mutates_args=())
def _token_kl_op(
    logits: torch.Tensor,       # [..., V]
    ref: torch.Tensor,          # [..., V] reference logits, or S reference log-probs
    target: torch.Tensor,       # [N] int64
    estimator: str,
    kl_clamp: Optional[float],
    temperature: torch.Tensor,  # 0-dim float64
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return kl_forward(logits, ref, target, estimator, kl_clamp, temperature, backend)


@_token_kl_op.register_fake
def _(logits, ref, target, estimator, kl_clamp, temperature, backend):
    return kl_forward_fake(logits, ref, target, estimator)


def _setup_context(ctx, inputs, output):
    logits, ref, target, estimator, kl_clamp, temperature, backend = inputs
    _, logp, ref_logp, lse, ref_lse, full_kl = output
    ctx.save_for_backward(logits, ref, target, temperature, logp, ref_logp, lse, ref_lse, full_kl)
    ctx.args = (estimator, kl_clamp, backend)


def _backward(ctx, g_kl, g_logp, g_ref_logp, g_lse, g_ref_lse, g_full_kl):
    logits, ref, target, temperature, logp, ref_logp, lse, ref_lse, full_kl = ctx.saved_tensors
    estimator, kl_clamp, backend = ctx.args
    grad = kl_backward(logits, ref, target, estimator, kl_clamp, temperature, backend, logp, ref_logp, lse, ref_lse, full_kl,
                       zeros_if_none(g_kl, lse), zeros_if_none(g_logp, lse))
    return grad, None, None, None, None, None, None


_token_kl_op.register_autograd(_backward, setup_context=_setup_context)


def token_kl(
    logits: torch.Tensor,
    ref: torch.Tensor,
    labels: torch.Tensor,
    *,
    estimator: str = "k1",
    kl_clamp: Optional[float] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    shift_labels: bool = False,
    backend: Optional[str] = None,
) -> KLOutput:
    """Per-token KL of the policy against a reference at the labelled tokens.

    Args:
        logits: policy logits ``[..., V]`` (fp32 / bf16 / fp16, leading dims may be strided).
        ref: reference logits of the same shape (read in the same pass), or reference
            log-probs of shape ``S = logits.shape[:-1]`` (scored elsewhere).
        labels, mask, ignore_index, cu_seqlens, shift_labels, temperature, backend:
            as in ``token_logprobs``; the temperature applies to both models.
        estimator: ``"k1"`` (``d = logp - ref_logp``), ``"abs"``, ``"k2"`` (``d**2 / 2``),
            ``"k3"`` (``exp(-d) + d - 1``), ``"full"`` (exact KL over the vocab; needs
            reference logits), or the aliases ``"kl"``, ``"mse"``, ``"low_var_kl"``.
        kl_clamp: clamp the estimator's value to ``[-kl_clamp, kl_clamp]``.

    Returns:
        ``KLOutput(kl, logprobs, ref_logprobs)``, each fp32 ``S``, 0 where not scored.
        Differentiable w.r.t. the policy ``logits`` only.
    """
    check_logits(logits)
    with_ref_logits = ref_is_logits(logits, ref)
    estimator, kl_clamp = check_estimator(estimator, kl_clamp, with_ref_logits)
    temperature = check_temperature(temperature, logits.device)
    layout = build_layout(logits, labels, ignore_index=ignore_index, mask=mask,
                          cu_seqlens=cu_seqlens, shift_labels=shift_labels)
    backend = _backends.resolve(backend, logits)
    kl, logp, ref_logp, *_ = _token_kl_op(logits, ref.detach(), layout.target, estimator, kl_clamp, temperature, backend)
    return KLOutput(kl.view(layout.shape), logp.view(layout.shape), ref_logp.view(layout.shape))
