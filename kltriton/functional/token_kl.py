"""``token_kl``: per-token KL between the policy and a reference, from logits or log-probs.

With reference logits, one kernel reads each row of both logits once and yields both
log-probs (and, for ``"full"``, the exact KL over the vocab); with reference log-probs,
only the policy row is read. The estimator is ``[N]`` work on the kernel's results.
"""
from typing import NamedTuple, Optional

import torch

from kltriton import estimators, route
from kltriton._inputs import LOGIT_DTYPES, build_layout, check_logits, check_temperature
from kltriton.kernels import statistics
from kltriton.linear_logits import is_linear
from kltriton.truncation import check_truncation


class KLOutput(NamedTuple):
    kl: torch.Tensor            # S fp32
    logprobs: torch.Tensor      # S fp32
    ref_logprobs: torch.Tensor  # S fp32


def ref_is_logits(logits: torch.Tensor, ref) -> bool:
    """Whether ``ref`` holds reference logits (``[..., V]``, a tensor or ``LinearLogits``) or
    reference log-probs (``S``)."""
    if is_linear(ref):  # either dtype: the linear family folds fp32 tiles of both sides
        if ref.shape != logits.shape:
            raise ValueError(f"ref must have the logits' shape {tuple(logits.shape)}, got {tuple(ref.shape)}")
        if ref.device != logits.device:
            raise ValueError(f"ref is on {ref.device} but logits are on {logits.device}")
        return True
    if not isinstance(ref, torch.Tensor):
        raise TypeError(f"ref must be a torch.Tensor of reference logits or log-probs, got {type(ref).__name__}")
    if not ref.dtype.is_floating_point:
        raise TypeError(f"ref must be floating point, got {ref.dtype}")
    if ref.device != logits.device:
        raise ValueError(f"ref is on {ref.device} but logits are on {logits.device}")
    if ref.shape == logits.shape:
        # Any logits dtype, also one other than the policy's (a bf16 policy, an fp32 reference);
        # float64 only with float64 logits (the reference backend).
        if ref.dtype not in LOGIT_DTYPES or (ref.dtype == torch.float64) != (logits.dtype == torch.float64):
            raise TypeError(f"ref logits must be float32, bfloat16 or float16 (float64 only with float64 logits), "
                            f"got {ref.dtype} with logits {logits.dtype}")
        return True
    if ref.shape == logits.shape[:-1]:
        return False
    raise ValueError(f"ref must be reference logits of shape {tuple(logits.shape)} or reference log-probs "
                     f"of shape {tuple(logits.shape[:-1])}, got {tuple(ref.shape)}")


def kl_of_target(logits, ref, target, temperature, estimator: estimators.Estimator, kl_clamp, backend,
                 shard=None, truncation=None, layout=None):
    """``(kl, logp, ref_logp)`` as flat ``[N]`` tensors for a validated ``target``; differentiable
    w.r.t. ``logits`` (the kernel's statistics, then the estimator in PyTorch). With a ``truncation`` (and the
    call's ``layout``), the policy's log-probs are of its truncated distribution."""
    if truncation is not None:
        return _truncated_kl(logits, ref, target, temperature, estimator, kl_clamp, backend, shard, truncation, layout)
    if ref.dim() == logits.dim():
        wanted = statistics.request(ref=True, full_kl=estimator.needs_ref_logits)
        stats = route.statistics(logits, ref, target, temperature, wanted, backend, shard)
        ref_logp = stats.ref_logp
    else:
        stats = route.statistics(logits, None, target, temperature, statistics.request(), backend, shard)
        ref_flat = ref.detach().reshape(-1).to(stats.logp.dtype)
        ref_logp = torch.where(target >= 0, ref_flat, torch.zeros_like(ref_flat))
    kl = estimator.value(stats.logp, ref_logp, stats.full_kl, kl_clamp)
    return kl, stats.logp, ref_logp


def _truncated_kl(logits, ref, target, temperature, estimator, kl_clamp, backend, shard, truncation, layout):
    """``kl_of_target`` with the policy truncated (the reference is not): the policy's statistics by
    ``route.truncated_statistics``, the reference's by its own pass. Where the label is outside the policy's
    kept set (``logp = -inf``) the KL is the estimator's limit: ``-inf`` for k1, ``+inf`` for the others."""
    if estimator.needs_ref_logits:
        raise ValueError("estimator='full' (the KL over the whole vocabulary) is not defined with a truncation; "
                         "use a per-token estimator")
    stats = route.truncated_statistics(logits, target, temperature, truncation, layout, statistics.request(),
                                       backend, shard)
    if ref.dim() == logits.dim():
        with torch.no_grad():
            ref_logp = route.statistics(ref, None, target, temperature, statistics.request(), backend, shard).logp
    else:
        ref_flat = ref.detach().reshape(-1).to(stats.logp.dtype)
        ref_logp = torch.where(target >= 0, ref_flat, torch.zeros_like(ref_flat))
    kl = estimator.value(stats.logp, ref_logp, None, kl_clamp)
    outside = stats.logp == float("-inf")
    limit = float("inf") if kl_clamp is None else float(kl_clamp)
    kl = torch.where(outside & torch.isnan(kl), torch.full_like(kl, limit), kl)
    return kl, stats.logp, ref_logp


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
    process_group=None,
    vocab_start: Optional[int] = None,
    truncation=None,
) -> KLOutput:
    """Per-token KL of the policy against a reference at the labelled tokens.

    Args:
        logits: policy logits ``[..., V]`` (fp32 / bf16 / fp16, leading dims may be strided), or
            a ``kltriton.LinearLogits`` (hidden states and an LM head, never projected to ``[N, V]``).
        ref: reference logits of the same shape, in any logits dtype (a tensor or ``LinearLogits``,
            read in the same pass, as they are: a bf16 policy may have an fp32 reference), or reference
            log-probs of shape ``S = logits.shape[:-1]`` (scored elsewhere).
        labels, mask, ignore_index, cu_seqlens, shift_labels, temperature, backend:
            as in ``token_logprobs``; the temperature applies to both models.
        estimator: ``"k1"`` (``d = logp - ref_logp``), ``"abs"``, ``"k2"`` (``d**2 / 2``),
            ``"k3"`` (``exp(-d) + d - 1``), ``"full"`` (exact KL over the vocab; needs
            reference logits), the aliases ``"kl"``, ``"mse"``, ``"low_var_kl"``, or verl's
            straight-through ``"k1+"``, ``"kl+"``, ``"abs+"``, ``"k3+"``, ``"low_var_kl+"`` (the value
            of the name without ``+``, the gradient of ``"k2"``).
        kl_clamp: clamp the estimator's value to ``[-kl_clamp, kl_clamp]``.
        process_group: a ``torch.distributed`` group whose ranks each hold a contiguous vocab shard
            ``logits[..., V_local]`` or a ``LinearLogits`` with ``weight [V_local, H]`` (and ``ref``, when
            logits, likewise) (vocab-parallel); ``labels`` are then global ids. One all-gather of a few
            fp32 per row; the logits gradient needs no communication (a ``LinearLogits`` hidden
            gradient: one all-reduce).
        vocab_start: first global id of this rank's shard (default: the sum of the lower ranks'
            ``V_local``, learned with one small all-gather).
        truncation: a ``kltriton.Truncation`` for the policy side (the reference stays untruncated), as in
            ``token_logprobs``; where the label is outside the kept set the KL is ``-inf`` (k1) or ``+inf``.
            Not with ``"full"``.

    Returns:
        ``KLOutput(kl, logprobs, ref_logprobs)``, each fp32 ``S``, 0 where not scored.
        Differentiable w.r.t. the policy ``logits`` (or ``LinearLogits`` hidden / weight / bias) only.
    """
    if not is_linear(logits):
        check_logits(logits)
    estimator = estimators.parse(estimator, ref_logits=ref_is_logits(logits, ref))
    kl_clamp = estimators.check_kl_clamp(kl_clamp)
    temperature = check_temperature(temperature, logits.device, logits.shape[:-1])
    truncation = check_truncation(truncation)
    shard = route.shard(logits, process_group, vocab_start)
    layout = build_layout(logits, labels, ignore_index=ignore_index, mask=mask, cu_seqlens=cu_seqlens,
                          shift_labels=shift_labels, shard=shard, with_seq_index=truncation is not None)
    kl, logp, ref_logp = kl_of_target(logits, ref, layout.target, temperature, estimator, kl_clamp,
                                      route.backend(backend, logits, ref), shard, truncation, layout)
    return KLOutput(kl.view(layout.shape), logp.view(layout.shape), ref_logp.view(layout.shape))
