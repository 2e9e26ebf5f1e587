"""``token_kl``: per-token KL between the policy and a reference, from logits or log-probs.

With reference logits, one kernel reads each row of both logits once and yields both
log-probs (and, for ``"full"``, the exact KL over the vocab); with reference log-probs,
only the policy row is read. The estimator is one ``[N]`` kernel after it (the ``epilogue`` family).
"""
import math
from typing import NamedTuple, Optional

import torch

from kltriton import estimators, route
from kltriton.front_door import Call, enter
from kltriton.kernels import statistics
from kltriton.kernels.epilogue import KlReward, KlValues, Rows
from kltriton.ops import epilogue as epilogue_ops


class KLOutput(NamedTuple):
    kl: torch.Tensor            # S fp32
    logprobs: torch.Tensor      # S fp32
    ref_logprobs: torch.Tensor  # S fp32


def rows_of(call: Call) -> Rows:
    """The call's sequences as the epilogue kernels walk them: rows of the last leading dim, or packed segments."""
    shape = call.layout.shape
    seq_len = shape[-1] if len(shape) >= 2 else shape.numel()
    return Rows(call.layout.num_seqs, seq_len, call.layout.cu_seqlens)


def kl_of_call(call: Call, estimator: estimators.Estimator, kl_clamp, shaping=None, score_clip=None):
    """``(KlReward, logp, ref_logp)`` as flat ``[N]`` tensors, differentiable w.r.t. the policy: the kernel's
    statistics, then the ``epilogue`` op (the estimator, and with ``shaping`` the rewards and sequence means). With a
    truncation the policy's log-probs are of its truncated distribution and the reference's come from their own pass;
    where the label is outside the policy's kept set (``logp = -inf``) the KL is the estimator's limit: ``-inf`` for k1,
    ``+inf`` for the others."""
    if call.truncation is not None and estimator.needs_ref_logits:
        raise ValueError("estimator='full' (the KL over the whole vocabulary) is not defined with a truncation; "
                         "use a per-token estimator")
    if call.ref is not None and call.truncation is None:
        stats = route.statistics(call, statistics.request(ref=True, full_kl=estimator.needs_ref_logits))
        ref_logp = stats.ref_logp
    else:
        stats = route.statistics(call, statistics.request())
        ref_logp = route.reference_statistics(call, statistics.request()).logp if call.ref is not None else None
    given = ref_logp is None
    target = call.layout.target  # read after the statistics, which may have made it (``route.statistics``)
    out = epilogue_ops.kl_reward(KlValues(stats.logp, stats.full_kl if estimator.needs_ref_logits else None),
                                 call.ref_logprobs if given else ref_logp, given, target, rows_of(call),
                                 estimator.name, math.inf if kl_clamp is None else kl_clamp, shaping,
                                 math.inf if score_clip is None else score_clip, route.backend(call, "epilogue"))
    out = KlReward(*out)
    if given:
        ref_logp = out.ref_logp
    if call.truncation is not None:
        limit = float("inf") if kl_clamp is None else float(kl_clamp)
        kl = out.kl
        out = out._replace(kl=torch.where((stats.logp == float("-inf")) & torch.isnan(kl), torch.full_like(kl, limit),
                                          kl))
    return out, stats.logp, ref_logp


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
    sequence_group=None,
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
        sequence_group: context parallel, as in ``token_logprobs``: each rank holds a contiguous slice of the
            sequence dimension (of the policy and the reference alike) and gets its positions' values.

    Returns:
        ``KLOutput(kl, logprobs, ref_logprobs)``, each fp32 ``S``, 0 where not scored.
        Differentiable w.r.t. the policy ``logits`` (or ``LinearLogits`` hidden / weight / bias) only.
    """
    call = enter(logits, labels, ref=ref, temperature=temperature, ignore_index=ignore_index, mask=mask,
                 cu_seqlens=cu_seqlens, shift_labels=shift_labels, backend=backend, process_group=process_group,
                 vocab_start=vocab_start, truncation=truncation, sequence_group=sequence_group)
    estimator = estimators.parse(estimator, ref_logits=call.ref is not None)
    out, logp, ref_logp = kl_of_call(call, estimator, estimators.check_kl_clamp(kl_clamp))
    shaped = call.layout.shaped
    return KLOutput(shaped(out.kl), shaped(logp), shaped(ref_logp))
