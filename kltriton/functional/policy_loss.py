"""``policy_loss``: the PPO / GRPO / DAPO / CISPO / GSPO policy loss straight from the logits.

``kltriton.route.loss_route`` picks the route. Fused (token-level losses, ``ppo`` and ``cispo``): the ``loss``
family as a custom op (``kltriton.ops.loss``) computes every row's statistics and writes the loss's gradient
w.r.t. the logits (or a ``LinearLogits`` policy's hidden states / weight / bias) in the forward; the C++ and
Triton kernels read each row from memory once for both, and the backward only applies the upstream gradient.
Two-pass (``gspo``, on-policy rollout importance sampling, vocab-parallel logits): the differentiable
statistics, the formulas of ``kltriton.kernels.loss.terms`` in PyTorch, and autograd (the logits are read
again in the backward).
"""
from typing import NamedTuple, Optional

import torch

from kltriton import estimators, route
from kltriton._inputs import build_layout, check_float, check_logits, check_temperature, runtime_scalar
from kltriton.functional.token_kl import ref_is_logits
from kltriton.kernels import SKIP, accumulation_dtype, statistics
from kltriton.kernels.loss import LossInputs, terms
from kltriton.linear_logits import is_linear
from kltriton.truncation import check_truncation

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor          # [] the loss (differentiable w.r.t. the policy logits)
    logprobs: torch.Tensor      # S fp32 (detached)
    ref_logprobs: torch.Tensor  # S fp32, 0 without a reference
    kl: torch.Tensor            # S fp32, the KL estimator's value, 0 without a reference
    entropy: torch.Tensor       # S fp32
    ratio: torch.Tensor         # S fp32, the importance ratio (per sequence for gspo)
    metrics: dict               # name -> 0-dim fp32 tensor


# --- argument checks ---------------------------------------------------------------------------

def _check_per_token(name, tensor, shape, device, allow_none=True):
    if tensor is None:
        if allow_none:
            return None
        raise TypeError(f"{name} is required")
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor of shape {tuple(shape)}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (the logits' leading shape), got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but logits are on {device}")
    return tensor.detach().reshape(-1)


# --- sequence-level weights ---------------------------------------------------------------------

def _aggregation_weights(aggregation, scored, seq_index, num_seqs, horizon, dtype):
    """``[N]`` weights with ``agg(x) = sum_n w[n] * x[n]`` (verl ``agg_loss``, single process)."""
    valid = scored.to(dtype)
    if aggregation == "token-sum":
        return valid
    if aggregation == "token-mean":
        return valid / valid.sum().clamp(min=1)
    counts = torch.zeros(num_seqs, dtype=dtype, device=valid.device).index_add_(0, seq_index, valid)
    nonempty = (counts > 0).to(dtype).sum().clamp(min=1)
    if aggregation == "seq-mean-token-mean":
        return valid / counts.clamp(min=1)[seq_index] / nonempty
    weights = valid / nonempty
    return weights / horizon if aggregation == "seq-mean-token-sum-norm" else weights


def _default_horizon(layout, cu_seqlens, n, device):
    """The padded length: ``T`` of ``[B, T]``, the longest packed segment, or ``N`` for one flat sequence."""
    if len(layout.shape) >= 2:
        return runtime_scalar(layout.shape[-1], device)
    if cu_seqlens is not None and cu_seqlens.numel() > 1:
        return (cu_seqlens[1:] - cu_seqlens[:-1]).max().to(torch.float64)
    return runtime_scalar(max(n, 1), device)


def _importance_weights(old, rollout, is_mode, is_cap, scored, seq_index, num_seqs):
    """``(weights, masked, log_ratio)`` of rollout importance sampling (TRL's vLLM correction): the ratio
    ``exp(old - rollout)`` per token or per sequence, truncated at ``is_cap`` or zeroed above it."""
    diff = torch.where(scored & ~torch.isnan(old - rollout), old - rollout, torch.zeros_like(old))
    log_w = diff
    if is_mode is not None and is_mode.startswith("sequence"):
        per_seq = torch.zeros(num_seqs, dtype=diff.dtype, device=diff.device).index_add_(0, seq_index, diff)
        log_w = per_seq[seq_index]
    w = torch.exp(log_w)
    over = (w > is_cap) & scored
    if is_mode is None:
        weights = torch.ones_like(w)
    elif is_mode.endswith("truncate"):
        weights = torch.clamp(w, max=is_cap)
    else:
        weights = torch.where(w > is_cap, torch.zeros_like(w), w)
    return weights, over, diff


# --- metrics ------------------------------------------------------------------------------------

def _masked_mean(values, scored, count):
    return torch.where(scored, values, torch.zeros_like(values)).sum() / count


def _masked_extreme(values, scored, reduce, neutral):
    """``reduce`` (``amax`` / ``amin``) over the scored entries; ``neutral`` where there are none (an empty
    batch included: a reduction of zero elements has no value)."""
    fill = torch.full((1,), neutral, dtype=values.dtype, device=values.device)
    return reduce(torch.cat([torch.where(scored, values, fill), fill]))


def _metrics(token, scored, entropy, is_info):
    count = scored.float().sum().clamp(min=1)
    any_scored = scored.any()
    zero = torch.zeros((), dtype=torch.float32, device=scored.device)
    ratio = token.ratio.float()
    log_ratio = token.log_ratio.float()  # clamped to [-20, 20] except for gspo, as in verl
    metrics = {
        "clipfrac": _masked_mean(token.clipped.float(), scored, count),
        "clipfrac_lower": _masked_mean(token.clipped_lower.float(), scored, count),
        "ppo_kl": _masked_mean(-log_ratio, scored, count),
        "kl_mean": _masked_mean(token.kl.float().detach(), scored, count),
        "entropy_mean": _masked_mean(entropy.float().detach(), scored, count),
        "ratio_max": torch.where(any_scored, _masked_extreme(ratio, scored, torch.amax, float("-inf")), zero),
        "ratio_min": torch.where(any_scored, _masked_extreme(ratio, scored, torch.amin, float("inf")), zero),
    }
    if is_info is not None:
        weights, over, diff = is_info
        metrics["is_weight_mean"] = _masked_mean(weights.float(), scored, count)
        metrics["is_masked_frac"] = _masked_mean(over.float(), scored, count)
        metrics["mismatch_k3"] = _masked_mean((torch.expm1(diff) - diff).float(), scored, count)
    return {k: v.detach() for k, v in metrics.items()}


def _truncated_stats(logits, ref_logits, target, temperature, truncation, layout, full, backend, shard):
    """``(StreamStats, outside)`` of the two-pass route with a truncated policy: its ``logp`` / ``entropy`` by
    ``route.truncated_statistics``, the reference's log-probs by their own pass (no gradient); ``outside [N]``: the
    scored positions whose label is outside the kept set."""
    if full:
        raise ValueError("kl_estimator='full' (the KL over the whole vocabulary) is not defined with a truncation")
    stats = route.truncated_statistics(logits, target, temperature, truncation, layout,
                                       statistics.request(entropy=True), backend, shard)
    if ref_logits is not None:
        with torch.no_grad():
            ref = route.statistics(ref_logits, None, target, temperature, statistics.request(), backend, shard)
        stats = stats._replace(ref_logp=ref.logp, ref_lse=ref.lse)
    return stats, (target >= 0) & (stats.logp == float("-inf"))


# --- public function ----------------------------------------------------------------------------

def policy_loss(
    logits,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    ref=None,
    loss_type: str = "ppo",
    clip_low: float = 0.2,
    clip_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: Optional[float] = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: Optional[torch.Tensor] = None,
    is_mode: Optional[str] = None,
    is_cap: float = 2.0,
    aggregation: str = "token-mean",
    horizon=None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    shift_labels: bool = False,
    backend: Optional[str] = None,
    process_group=None,
    vocab_start: Optional[int] = None,
    truncation=None,
) -> PolicyLossOutput:
    """The policy loss ``agg(pg * is_weights) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``.

    Args:
        logits: policy logits ``[..., V]`` (``S = logits.shape[:-1]``, as ``token_logprobs``), or a
            ``kltriton.LinearLogits`` (hidden states and an LM head: the gradients w.r.t. hidden / weight /
            bias are produced in the forward too, per GEMM tile).
        labels, temperature, ignore_index, mask, cu_seqlens, shift_labels, backend: as in ``token_logprobs``.
        advantages: ``S`` (per token) or ``[num_seqs]`` (per sequence: rows of ``[B, T]``, segments of
            ``cu_seqlens``, or one for a flat ``[N]``).
        old_logprobs: ``S`` log-probs of the policy that sampled; ``None``: on-policy (ratio 1, live gradient).
        ref: reference logits (same shape as ``logits``, read in the same pass) or log-probs ``S``.
        loss_type: ``"ppo"`` (verl vanilla: ``clip_low``, ``clip_high`` (default ``clip_low``) and the dual
            clip ``dual_clip=c > 1`` for negative advantages; GRPO / DAPO are this), ``"gspo"``, ``"cispo"``.
        kl_coef, kl_estimator, kl_clamp: the KL penalty (estimators of ``token_kl``, and verl's
            straight-through ``"k3+"``-style names); needs ``ref`` when ``kl_coef != 0``.
        entropy_coef: weight of the entropy bonus (subtracted).
        rollout_logprobs, is_mode, is_cap: rollout importance sampling (``"token_truncate"``,
            ``"token_mask"``, ``"sequence_truncate"``, ``"sequence_mask"``; TRL's names) with weights
            ``exp(old - rollout)`` (summed over the sequence for ``sequence_*``) truncated at ``is_cap``
            or zeroed above it. Without ``is_mode`` the mismatch is only reported in the metrics.
        aggregation: verl ``agg_loss`` mode; ``horizon`` divides ``"seq-mean-token-sum-norm"`` (default:
            the padded length ``T``, the longest packed segment, or ``N``).
        process_group, vocab_start: vocab-parallel logits or ``LinearLogits`` weight shards (and the
            reference's), as in ``token_kl``: every rank gets the global loss and the gradient of its shard
            (the two-pass route).
        truncation: a ``kltriton.Truncation``: the new log-probs (and entropy) are of the truncated distribution
            the rollout engine sampled from, as in ``token_logprobs`` (the two-pass route). A position whose label is
            outside the kept set (log-prob ``-inf``) is dropped from the loss and the metrics, as a masked
            position is (its ``logprobs`` output stays ``-inf``, its ``ratio`` and ``kl`` are 0); the share of
            such positions among the scored ones is ``metrics["outside_support_frac"]``. No other position changes.

    Returns:
        ``PolicyLossOutput(loss, logprobs, ref_logprobs, kl, entropy, ratio, metrics)``: ``loss`` 0-dim,
        the others fp32 ``S`` (0 where not scored, detached), ``metrics`` 0-dim tensors: ``clipfrac``,
        ``clipfrac_lower``, ``ppo_kl``, ``kl_mean``, ``entropy_mean``, ``ratio_max``, ``ratio_min`` and, with
        ``rollout_logprobs``, ``is_weight_mean``, ``is_masked_frac``, ``mismatch_k3``.
    """
    if not is_linear(logits):
        check_logits(logits)
    device, shape = logits.device, logits.shape[:-1]
    if loss_type not in terms.LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {terms.LOSS_TYPES}, got {loss_type!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if is_mode is not None and is_mode not in IS_MODES:
        raise ValueError(f"is_mode must be one of {IS_MODES} or None, got {is_mode!r}")
    if is_mode is not None and rollout_logprobs is None:
        raise ValueError(f"is_mode={is_mode!r} needs rollout_logprobs")
    clip_low = check_float("clip_low", clip_low, at_least=0.0)
    clip_high = clip_low if clip_high is None else check_float("clip_high", clip_high, at_least=0.0)
    dual_clip = check_float("dual_clip", dual_clip, above=1.0, allow_none=True)
    if dual_clip is not None and loss_type != "ppo":
        raise ValueError(f"dual_clip applies to loss_type='ppo' only, got loss_type={loss_type!r}")
    kl_coef = check_float("kl_coef", kl_coef)
    entropy_coef = check_float("entropy_coef", entropy_coef)
    kl_clamp = estimators.check_kl_clamp(kl_clamp)
    is_cap = check_float("is_cap", is_cap, above=0.0)
    horizon = check_float("horizon", horizon, above=0.0, allow_none=True)

    with_ref_logits = ref is not None and ref_is_logits(logits, ref)
    if ref is None and kl_coef != 0.0:
        raise ValueError("kl_coef != 0 needs ref (reference logits or log-probs)")
    estimator = estimators.parse(kl_estimator, ref_logits=with_ref_logits, argument="kl_estimator") \
        if ref is not None else None
    estimator_name = estimator.name if estimator is not None else ""
    temperature = check_temperature(temperature, device, logits.shape[:-1])
    truncation = check_truncation(truncation)
    shard = route.shard(logits, process_group, vocab_start)
    layout = build_layout(logits, labels, ignore_index=ignore_index, mask=mask, cu_seqlens=cu_seqlens,
                          shift_labels=shift_labels, with_seq_index=True, shard=shard)
    target, seq_index, num_seqs = layout.target, layout.seq_index, layout.num_seqs
    n = target.numel()
    acc = accumulation_dtype(logits.dtype)

    if not isinstance(advantages, torch.Tensor) or not advantages.dtype.is_floating_point:
        raise TypeError("advantages must be a floating tensor of shape S or [num_seqs]")
    if advantages.device != device:
        raise ValueError(f"advantages is on {advantages.device} but logits are on {device}")
    if tuple(advantages.shape) == tuple(shape):
        adv = advantages.detach().reshape(-1).to(acc)
    elif advantages.dim() == 1 and advantages.shape[0] == num_seqs:
        adv = advantages.detach().to(acc)[seq_index]
    else:
        raise ValueError(f"advantages must have shape {tuple(shape)} or [num_seqs] = [{num_seqs}], "
                         f"got {tuple(advantages.shape)}")
    old = _check_per_token("old_logprobs", old_logprobs, shape, device)
    old = None if old is None else old.to(acc)
    rollout = _check_per_token("rollout_logprobs", rollout_logprobs, shape, device)
    ref_logp_given = None if ref is None or with_ref_logits else _check_per_token("ref", ref, shape, device).to(acc)

    scored = target != SKIP
    if ref_logp_given is not None:  # like every per-token output: 0 where not scored
        ref_logp_given = torch.where(scored, ref_logp_given, torch.zeros_like(ref_logp_given))
    horizon_t = runtime_scalar(horizon, device) if horizon is not None else _default_horizon(layout, cu_seqlens, n, device)
    agg_w = _aggregation_weights(aggregation, scored, seq_index, num_seqs, horizon_t.to(acc), acc)
    hp = terms.hyperparameters(device, ratio_low=runtime_scalar(1.0 - clip_low, device),
                               ratio_high=runtime_scalar(1.0 + clip_high, device),
                               dual_clip=runtime_scalar(dual_clip if dual_clip is not None else float("inf"), device),
                               kl_clamp=runtime_scalar(kl_clamp if kl_clamp is not None else float("inf"), device))
    w_kl = agg_w * runtime_scalar(kl_coef, device).to(acc)
    w_ent = agg_w * runtime_scalar(-entropy_coef, device).to(acc)
    ref_logits = (ref if is_linear(ref) else ref.detach()) if with_ref_logits else None
    full = estimator is not None and estimator.needs_ref_logits

    is_info = None
    fused = truncation is None and route.loss_route(logits, ref, loss_type, old is None and rollout is not None,
                                                    shard) == "fused"
    outside = None
    if fused:
        if rollout is not None:
            is_info = _importance_weights(old, rollout.to(acc), is_mode, is_cap, scored, seq_index, num_seqs)
        w_pg = agg_w if is_info is None else agg_w * is_info[0]
        inputs = LossInputs(old, adv, w_pg, w_kl, w_ent, ref_logp_given)
        loss, stats = route.fused_loss(logits, ref_logits, target, temperature, inputs, hp, loss_type, estimator_name,
                                       entropy_coef != 0.0, backend)
        logp, entropy = stats.logp, stats.entropy
    else:  # two passes: the differentiable statistics, the formulas in PyTorch, autograd
        wanted = statistics.request(entropy=True, ref=ref_logits is not None, full_kl=full)
        if truncation is not None:
            stats, outside = _truncated_stats(logits, ref_logits, target, temperature, truncation, layout, full,
                                              route.backend(backend, logits, ref_logits), shard)
            scored = scored & ~outside
            agg_w = _aggregation_weights(aggregation, scored, seq_index, num_seqs, horizon_t.to(acc), acc)
            w_kl = agg_w * runtime_scalar(kl_coef, device).to(acc)
            w_ent = agg_w * runtime_scalar(-entropy_coef, device).to(acc)
        else:
            stats = route.statistics(logits, ref_logits, target, temperature, wanted,
                                     route.backend(backend, logits, ref_logits), shard)
        logp, entropy = stats.logp, stats.entropy
        if rollout is not None:
            old_for_is = logp.detach() if old is None else old
            is_info = _importance_weights(old_for_is, rollout.to(acc), is_mode, is_cap, scored, seq_index, num_seqs)
        w_pg = agg_w if is_info is None else agg_w * is_info[0]
    ref_logp = stats.ref_logp if ref_logits is not None else (
        ref_logp_given if ref_logp_given is not None else torch.zeros_like(logp))
    reported_logp = logp
    if outside is not None:  # dropped positions: finite stand-ins (weight 0, no gradient) so no term is NaN
        stand_in = old if old is not None else torch.zeros_like(logp)
        logp = torch.where(outside, stand_in.to(logp.dtype), logp)
        ref_logp = torch.where(outside, stand_in.to(logp.dtype), ref_logp)
    token = terms.token_terms(loss_type, estimator, logp, ref_logp, stats.full_kl if full else None, old, adv, hp,
                              scored, seq_index, num_seqs)
    if outside is not None:
        zero = torch.zeros_like(token.ratio)
        token = token._replace(ratio=torch.where(outside, zero, token.ratio), kl=torch.where(outside, zero, token.kl))
    if not fused:
        loss = terms.objective(token, entropy, w_pg, w_kl, w_ent).sum()
    metrics = _metrics(token, scored, entropy, is_info)
    if outside is not None:
        metrics["outside_support_frac"] = (outside.float().sum() / (scored | outside).float().sum().clamp(min=1))
    view = lambda t: t.detach().float().view(shape)  # noqa: E731
    return PolicyLossOutput(loss, view(reported_logp), view(ref_logp), view(token.kl), view(entropy),
                            view(token.ratio), metrics)
