"""``token_divergence``: per-token distillation divergences between a student and a teacher, from logits, hidden
states (``LinearLogits``) or a sparse top-k teacher (``TopK``), never building ``[N, V]`` besides the student's
logits gradient.

Dense teacher: forward KL ``KL(t || s)`` and reverse KL ``KL(s || t)`` are statistics of one streaming pass per row
(``stream`` family); the generalized JSD is a second pass after both log-sum-exps (``divergence`` family). ``TopK``
teacher: the student's streaming log-sum-exp plus a ``K``-column gather, then the divergence over ``K`` (+1) bins in
PyTorch (``[N, K]`` work). ``kltriton.route`` picks the route (``divergence_route``).
"""
from typing import Optional

import torch

from kltriton import route
from kltriton._inputs import checked_ids
from kltriton._values import check_float, runtime_scalar
from kltriton.front_door import enter
from kltriton.kernels import OUT_OF_RANGE, SKIP, accumulation_dtype
from kltriton.kernels.layout import RowWeights
from kltriton.kernels.loss import LossInputs, terms
from kltriton.kernels.loss.weights import Sequences

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
TAILS = ("bucket", "renormalize", "none")
REDUCTIONS = ("none", "batchmean", "sum", "mean")
# The fused loss kernel's hyperparameters for the full KL alone: no clamp, no ratio (python floats: a cached vector).
_KL_ONLY = dict(log_ratio_clamp=float("inf"), kl_clamp=float("inf"), kl_ratio=0.0)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _weights(reduction, scored, vocab, dtype, sequences: Sequences):
    """``[N]`` weights with ``loss = sum_n w_n D_n`` (TRL GKD's reductions over the scored positions): ``"sum"`` 1,
    ``"batchmean"`` 1 / count, ``"mean"`` 1 / (count * V) (TRL's ``mean`` is over the ``[count, V]`` elements); the
    count over every rank of a sequence group (``sequences``)."""
    valid = scored.to(dtype)
    if reduction == "sum":
        return valid
    count = sequences.total(valid).clamp(min=1)
    return valid / count if reduction == "batchmean" else valid / (count * vocab)


def _reverse_kl_loss(call, reduction, return_entropy):
    """The reverse KL's reduced loss as the loss family's fused kernel (a loss of the full-KL term alone: the
    ``"kl_only"`` formula): the targets with their weights (the layout op), then the statistics, the loss and the
    student's gradient in one pass per row and the ``terms`` kernel's sum; no ``[N]`` ops around them."""
    prepared = call.layout.weighted(RowWeights("token-sum" if reduction == "sum" else "token-mean", None, None, None,
                                               None, False, 1.0 / call.vocab if reduction == "mean" else 1.0, 0.0,
                                               accumulation_dtype(call.dtype)))
    adv, w_agg, w_pg, w_kl, w_ent = prepared.unbind()
    inputs = LossInputs(None, adv, w_pg, w_kl, w_ent, None, w_agg)
    hyperparameters = terms.hyperparameters(call.device, **_KL_ONLY)
    loss, stats, _, _ = route.fused_loss(call, inputs, hyperparameters, "kl_only", "full", False,
                                         with_entropy=return_entropy)
    return (loss, stats.entropy.view(call.layout.shape)) if return_entropy else loss


# --- a top-k teacher: [N, K] work -------------------------------------------------------------------------------

def _kl(log_a, log_b):
    """``KL(a || b)`` over the last dim of log-probabilities (sub-distributions allowed): ``sum_{a > 0} a (log a -
    log b)``, ``+inf`` where ``b`` has no mass under ``a``'s; finite gradients wherever the value is finite."""
    live = log_a > float("-inf")
    zero = torch.zeros((), dtype=log_a.dtype, device=log_a.device)
    la, lb = torch.where(live, log_a, zero), torch.where(live, log_b, zero)
    return torch.where(live, la.exp() * (la - lb), zero).sum(-1)


def _jsd(log_a, log_b, beta):
    """``beta KL(b || m) + (1 - beta) KL(a || m)``, ``m = beta b + (1 - beta) a``, of log-probabilities over the last
    dim (``a`` the student, ``b`` the teacher)."""
    either = (log_a > float("-inf")) | (log_b > float("-inf"))
    zero = torch.zeros((), dtype=log_a.dtype, device=log_a.device)
    log_m = torch.logaddexp(torch.where(either, log_a, zero) + torch.log1p(-beta),
                            torch.where(either, log_b, zero) + torch.log(beta))
    log_m = torch.where(either, log_m, torch.full_like(log_m, float("-inf")))
    return beta * _kl(log_b, log_m) + (1 - beta) * _kl(log_a, log_m)


def _log_tail(log_p, covered):
    """``log(1 - sum exp(log_p))`` over the last dim (float64), ``-inf`` where that mass is 0 (clamped) or the ids
    cover the whole vocabulary; finite gradients."""
    rest = -torch.expm1(torch.logsumexp(log_p, -1))
    has_mass = (rest > 0) & ~covered
    safe = torch.where(has_mass, rest, torch.ones_like(rest))
    return torch.where(has_mass, safe.log(), torch.full_like(rest, float("-inf")))


def topk_divergence(student_logp, teacher_logp, valid, kind, beta, tail, vocab, min_logprob=None):
    """``[N]`` divergence of ``kind`` over a top-k teacher's bins from the student's and teacher's log-probs at the
    ``K`` ids (``[N, K]``; ``valid``: not padding); ``beta`` a 0-dim float64 tensor (data).

    ``tail``: ``"bucket"`` adds one bin holding each side's remaining mass (``1 - sum``; empty when the ids cover the
    whole vocabulary), ``"renormalize"`` restricts both to the ids and renormalizes, ``"none"`` sums the ``K`` terms
    alone (verl's ``forward_kl_topk``: not a divergence of distributions, it may be negative). Computed in float64.
    """
    ninf = torch.full((), float("-inf"), dtype=torch.float64, device=valid.device)
    ls, lt = student_logp.double(), teacher_logp.double()
    if min_logprob is not None:
        ls, lt = ls.clamp(min=min_logprob), lt.clamp(min=min_logprob)
    ls, lt = torch.where(valid, ls, ninf), torch.where(valid, lt, ninf)
    if tail == "renormalize":
        ls = ls - torch.logsumexp(ls, -1, keepdim=True)
        lt = lt - torch.logsumexp(lt, -1, keepdim=True)
        empty = ~valid.any(-1, keepdim=True)  # no ids: two empty distributions, no divergence
        ls, lt = torch.where(empty, ninf, ls), torch.where(empty, ninf, lt)
    elif tail == "bucket":
        covered = valid.sum(-1) >= vocab
        ls = torch.cat([ls, _log_tail(ls, covered)[:, None]], -1)
        lt = torch.cat([lt, _log_tail(lt, covered)[:, None]], -1)
    if kind == "forward_kl":
        return _kl(lt, ls)
    if kind == "reverse_kl":
        return _kl(ls, lt)
    return _jsd(ls, lt, beta)


# --- public function ----------------------------------------------------------------------------------------------

def token_divergence(
    student,
    teacher,
    labels: torch.Tensor,
    *,
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    temperature=1.0,
    tail: str = "bucket",
    reduction: str = "none",
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    shift_labels: bool = False,
    return_entropy: bool = False,
    backend: Optional[str] = None,
    process_group=None,
    vocab_start: Optional[int] = None,
    sequence_group=None,
):
    """Per-token divergence between the student's and the teacher's next-token distributions (distillation).

    Args:
        student: logits ``[..., V]`` (fp32 / bf16 / fp16, leading dims may be strided) or a ``kltriton.LinearLogits``
            (hidden states and an LM head, never projected to ``[N, V]``). The gradient reaches it (logits, or
            hidden / weight / bias).
        teacher: logits of the same shape (any logits dtype), a ``LinearLogits``, or a ``kltriton.TopK(ids,
            logprobs)`` (``[*S, K]``, a sparse teacher). No gradient reaches it.
        labels, mask, ignore_index, cu_seqlens, shift_labels: as in ``token_logprobs``; they only say which
            positions are scored (the label itself is not used).
        divergence: ``"forward_kl"`` = ``KL(t || s)``, ``"reverse_kl"`` = ``KL(s || t)`` (the exact KL of
            ``token_kl(estimator="full")``), ``"jsd"`` = ``beta KL(t || m) + (1 - beta) KL(s || m)`` with
            ``m = beta t + (1 - beta) s`` (TRL's ``GKDTrainer.generalized_jsd_loss`` per token; ``beta`` 0 and 1 give
            the forward and reverse KL exactly). With a dense teacher the JSD reads each row twice: its mixture needs
            both log-sum-exps first (the statistics pass, then the JSD pass).
        beta: the JSD's weight in ``[0, 1]``: data, a new value never recompiles.
        temperature: divides the student's and the teacher's logits (TRL's GKD convention); a float, a 0-dim tensor
            or one per position. For a ``TopK`` teacher it applies to the student only.
        tail: for a ``TopK`` teacher (ignored otherwise): ``"bucket"`` (the ``K`` ids plus one bin holding each
            side's remaining mass, ``1 - sum t_k`` and ``1 - sum s_k``, ``s`` the student's full softmax),
            ``"renormalize"`` (both sides restricted to the ``K`` ids and renormalized), or ``"none"`` (the ``K`` ids'
            terms alone, verl 0.9.1's ``forward_kl_topk``; may be negative).
        reduction: ``"none"`` (per position, shape ``S``), or a 0-dim loss with TRL GKD's meaning: ``"batchmean"``
            (sum over the scored positions / their count), ``"sum"``, ``"mean"`` (sum / (count * V), TRL's mean over
            the ``[count, V]`` elements). With a dense teacher and no vocab sharding the student's gradient is
            written in the forward (the backward only scales it; for ``LinearLogits`` the logits tiles are not
            projected again). A batch with no scored position gives 0 (TRL's ``"mean"`` gives NaN).
        return_entropy: also return the student's entropy ``S`` (fp32, of ``softmax(student / T)``, no gradient: a
            metric) from the same pass.
        backend: as in ``token_logprobs``.
        process_group, vocab_start: vocab-parallel student and teacher (logits shards or ``LinearLogits`` weight
            shards; ``TopK`` ids are global), as in ``token_kl``: ``O(N)`` values exchanged per rank and pass (the JSD
            pass one more all-reduce of two per row, a ``TopK`` teacher ``K`` per row).
        sequence_group: context parallel, as in ``token_logprobs``: each rank holds a contiguous slice of the
            sequence dimension of the student and the teacher. ``reduction="none"``: this rank's positions; a
            reduction: the whole batch's loss on every rank (its count one all-reduce, the sum one more), whose
            gradient w.r.t. this rank's student is that of the whole loss (as ``policy_loss``'s).

    Returns:
        fp32 ``S`` (0 where not scored, NaN where the label is out of range with validation off) for
        ``reduction="none"``, else a 0-dim loss; with ``return_entropy``, ``(divergence, entropy)``. A teacher with
        zero mass where the student has mass gives ``+inf`` reverse KL (never NaN); ``-inf`` and ``finfo.min`` logits
        are normal input.
    """
    _check_choice("divergence", divergence, DIVERGENCES)
    _check_choice("tail", tail, TAILS)
    _check_choice("reduction", reduction, REDUCTIONS)
    beta = check_float("beta", beta, at_least=0.0)
    if not torch.compiler.is_compiling() and beta > 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    call = enter(student, labels, ref=teacher, ref_forms=("logits", "topk"), names=("student", "teacher"),
                 temperature=temperature, ignore_index=ignore_index, mask=mask, cu_seqlens=cu_seqlens,
                 shift_labels=shift_labels, backend=backend, process_group=process_group, vocab_start=vocab_start,
                 sequence_group=sequence_group)
    kind = divergence
    if divergence == "jsd" and beta in (0.0, 1.0):  # TRL's beta = 0 / 1: exactly the forward / reverse KL
        kind = "forward_kl" if beta == 0.0 else "reverse_kl"
    if (kind == "reverse_kl" and reduction != "none" and call.topk is None and call.sequence_group is None
            and route.divergence_route(call, reduction) == "fused" and route.loss_route(call, "kl_only", False) == "fused"):
        return _reverse_kl_loss(call, reduction, return_entropy)
    target, shape = call.layout.target, call.layout.shape
    scored = target != SKIP
    acc = accumulation_dtype(call.dtype)
    sequences = Sequences(call.layout.seq_index, call.layout.num_seqs, group=call.sequence_group)
    weight = None if reduction == "none" else _weights(reduction, scored, call.vocab, acc, sequences)
    beta_t = runtime_scalar(beta, call.device)

    if call.topk is not None:
        # ids in [-1, V), checked without a host read on a device (``bad_rows``: scored as NaN)
        ids, bad_rows = checked_ids(call.topk.ids.reshape(-1, call.topk.ids.shape[-1]).long(), call.vocab, "TopK")
        student_logp, entropy = route.columns(call, ids, return_entropy)
        value = topk_divergence(student_logp, call.topk.logprobs.detach().reshape(ids.shape), ids >= 0, kind, beta_t,
                                tail, call.vocab, call.topk.min_logprob).to(acc)
        value = torch.where(scored, value, torch.zeros_like(value))
        nan_rows = target == OUT_OF_RANGE if bad_rows is None else (target == OUT_OF_RANGE) | (bad_rows & scored)
        value = torch.where(nan_rows, torch.full_like(value, float("nan")), value)
        loss = None if weight is None else (weight * value).sum()
    elif route.divergence_route(call, reduction) == "fused":
        loss, value, entropy = route.divergence_loss(call, kind, beta_t, weight, return_entropy)
    else:
        value, entropy = route.divergence(call, kind, beta_t, return_entropy)
        loss = None if weight is None else (weight * value).sum()
    if loss is not None:  # the whole batch's loss on every rank (under a sequence group)
        loss = sequences.across(loss, replicated=True)
    out = value.view(shape) if loss is None else loss
    return (out, entropy.detach().view(shape)) if return_entropy else out
