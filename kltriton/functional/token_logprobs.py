"""``token_logprobs``: log-prob (and entropy, and a trainer head's metrics) of the labelled token, one pass over the
vocab."""
from typing import NamedTuple, Optional, Sequence

import torch

from kltriton import route
from kltriton.front_door import enter, enter_plain
from kltriton.kernels import constants, statistics

# The per-token values ``outputs=`` may ask for besides the log-prob (TRL's ``FusedCausalLMOutput`` names).
OUTPUTS = ("entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
HEAD_OUTPUTS = OUTPUTS[1:]


class TokenOutputs(NamedTuple):
    """``token_logprobs(..., outputs=...)``: per-position values of shape ``S``; those not asked for are None."""
    logp: torch.Tensor                          # fp32, differentiable
    entropy: Optional[torch.Tensor] = None      # fp32, differentiable
    is_top1: Optional[torch.Tensor] = None      # bool, no gradient
    mean_logits: Optional[torch.Tensor] = None  # fp32, no gradient
    log_sum_sq_probs: Optional[torch.Tensor] = None  # fp32, no gradient


def _parse_outputs(outputs, return_entropy) -> frozenset:
    wanted = frozenset([outputs] if isinstance(outputs, str) else outputs)
    unknown = sorted(wanted - set(OUTPUTS))
    if unknown:
        raise ValueError(f"token_logprobs: unknown outputs {unknown}; choose among {list(OUTPUTS)} (the log-prob is "
                         "always computed)")
    if return_entropy:
        raise ValueError("token_logprobs: pass 'entropy' in outputs= rather than return_entropy=True with outputs=")
    return wanted


def token_logprobs(
    logits,
    labels,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    mask=None,
    cu_seqlens=None,
    shift_labels: bool = False,
    return_entropy: bool = False,
    backend: Optional[str] = None,
    process_group=None,
    vocab_start: Optional[int] = None,
    truncation=None,
    sequence_group=None,
    outputs: Optional[Sequence[str]] = None,
):
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``, without ``[N, V]`` temporaries.

    Args:
        logits: ``[..., V]`` fp32 / bf16 / fp16; any strides on the leading dims
            (``logits[:, :-1]`` is read in place); or a ``kltriton.LinearLogits`` (hidden states
            and an LM head: the logits are never built).
        labels: integer ``S = logits.shape[:-1]``; ``ignore_index`` marks unscored positions.
        mask: optional bool or integer ``S`` (a Hugging Face ``attention_mask`` as it is); 0 = not scored.
        temperature: ``T > 0``, finite: a python float, a 0-dim tensor, or a floating tensor of shape
            ``S`` (one per position); a tensor never recompiles under ``torch.compile``.
        cu_seqlens: optional ``[num_seqs + 1]`` offsets of packed sequences in ``[N, V]`` logits.
        shift_labels: ``labels`` are input ids; position ``t`` is scored on ``labels[t + 1]``
            of the same sequence (``mask[t + 1]`` decides), the last position of each is not.
        return_entropy: also return the entropy of ``softmax(logits[t] / T)``.
        backend: ``"triton" | "cpp" | "reference"``; default by device (``KLTRITON_BACKEND``).
        process_group: a ``torch.distributed`` group whose ranks each hold a contiguous vocab shard
            ``logits[..., V_local]`` or a ``LinearLogits`` with ``weight [V_local, H]`` (vocab-parallel);
            ``labels`` are then global ids. One all-gather of a few fp32 per row; the logits gradient
            needs no communication (a ``LinearLogits`` hidden gradient: one all-reduce).
        vocab_start: first global id of this rank's shard (default: the sum of the lower ranks'
            ``V_local``, learned with one small all-gather).
        truncation: a ``kltriton.Truncation``: the log-probs (and entropy) of the distribution the rollout
            engine sampled from, restricted to its kept set (top-k / top-p / min-p recomputed from these
            logits, or the engine's kept ids replayed): ``-inf`` where the label is outside the kept set (no
            gradient there), gradients zero outside the kept set. See ``docs/api/truncation.md``.
        sequence_group: a ``torch.distributed`` group whose ranks each hold a contiguous slice of the sequence
            dimension, in rank order (context parallel): ``[B, T_r]`` slices of a ``[B, T]`` batch (uneven allowed),
            or ``[N_r]`` slices of the packed token stream with ``cu_seqlens`` the global offsets (the same on every
            rank). Every rank gets the values of its own positions, equal to the unsplit call's; with
            ``shift_labels`` the last position's label and mask come from the next rank's slice (one all-gather of
            ``2 B`` int64 per rank), and learning the slice's start is one all-gather of 3 int64. A DTensor split on
            the sequence dimension (``Shard(1)`` of ``[B, T, V]``) is the same. See ``docs/api/context_parallel.md``.
        outputs: optional names among ``"entropy"``, ``"is_top1"``, ``"mean_logits"``, ``"log_sum_sq_probs"`` (a
            trainer head's metrics, TRL's ``FusedCausalLMOutput`` fields, in the same pass; not with
            ``return_entropy``): the call then returns a ``TokenOutputs``. ``is_top1``: the label is the argmax of
            the logits (bool; the first maximum wins a tie, as ``torch.argmax``); ``mean_logits``: the mean of
            ``logits / T`` over the ``V`` entries (a ``-inf`` entry makes it ``-inf``, as TRL's sum);
            ``log_sum_sq_probs``: ``log sum_v p_v^2`` of ``softmax(logits / T)``. No gradient; 0 / False where not
            scored. Dense logits, a ``LinearLogits`` and vocab shards; not with a truncation or the invariant mode
            yet. See ``docs/api/token_logprobs.md``.

    Returns:
        ``logp`` fp32 ``S`` (``<= 0``, exactly 0 where not scored), or ``(logp, entropy)``, or with ``outputs`` a
        ``TokenOutputs`` (the values not asked for None).
        Differentiable w.r.t. ``logits`` (gradient in ``logits.dtype``), or a ``LinearLogits``'
        hidden states, weight and bias.
    """
    if outputs is None and route.plain(logits, labels, mask, cu_seqlens, temperature, process_group, vocab_start,
                                       truncation, sequence_group):
        layout, kernel_temperature = enter_plain(logits, labels, temperature=temperature, ignore_index=ignore_index,
                                                 mask=mask, cu_seqlens=cu_seqlens, shift_labels=shift_labels,
                                                 backend=backend)
        stats = route.plain_statistics(logits, layout, kernel_temperature,
                                       constants.ENTROPY if return_entropy else 0, backend)
        logp = layout.shaped(stats.logp)
        return (logp, layout.shaped(stats.entropy)) if return_entropy else logp
    wanted = None if outputs is None else _parse_outputs(outputs, return_entropy)
    call = enter(logits, labels, temperature=temperature, ignore_index=ignore_index, mask=mask,
                 cu_seqlens=cu_seqlens, shift_labels=shift_labels, backend=backend, process_group=process_group,
                 vocab_start=vocab_start, truncation=truncation, sequence_group=sequence_group)
    if wanted is None:
        request = statistics.request(entropy=bool(return_entropy))
    else:
        request = statistics.request(entropy="entropy" in wanted, head=bool(wanted & set(HEAD_OUTPUTS)))
    stats = route.statistics(call, request)
    shape = call.layout.shape
    logp = call.layout.shaped(stats.logp)
    if wanted is None:
        return (logp, call.layout.shaped(stats.entropy)) if return_entropy else logp
    values = {name: getattr(stats, name).view(shape) for name in wanted if name != "mean_logits"}
    if "is_top1" in values:
        values["is_top1"] = values["is_top1"] == 1  # NaN (no distribution, or a label out of range): False
    if "mean_logits" in wanted:
        # The sum, kept times LOGIT_SUM_SCALE (merged over vocab pieces), times one factor: a finite mean never
        # overflows on the way.
        values["mean_logits"] = stats.sum_logits.view(shape) * (1 / (constants.LOGIT_SUM_SCALE * call.vocab))
    return TokenOutputs(logp, **values)
