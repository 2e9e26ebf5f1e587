"""``policy_loss``: every policy loss of verl 0.9.1's registry and of TRL 1.16's ``GRPOConfig.loss_type``,
straight from the logits.

``kltriton.route.loss_route`` picks the route. Fused (a loss whose derivative w.r.t. a row's log-prob depends on
that row alone, ``terms.FUSED``, at the token level): the ``loss`` family as a custom op (``kltriton.ops.loss``)
computes every row's statistics and writes the loss's gradient w.r.t. the logits (or a ``LinearLogits``
policy's hidden states / weight / bias) in the forward; the C++ and Triton kernels read each row from memory
once for both, and the backward only applies the upstream gradient. With ``token_mask_entropy_quantile`` the
fused route takes two passes (``kltriton.kernels.loss.masked``): the fused kernel without the masked terms,
the batch quantile of the entropies, then the masked terms' gradient added on the kept rows only.
Two-pass (sequence-level ratios and weights, batch selections, on-policy rollout importance sampling,
vocab-parallel logits): the differentiable statistics, the formulas of ``kltriton.kernels.loss.terms`` in
PyTorch, and autograd (the logits are read again in the backward).
"""
from typing import NamedTuple, Optional

import torch

from kltriton import estimators, route
from kltriton._inputs import check_float, runtime_scalar
from kltriton.front_door import enter, local_rows
from kltriton.kernels import SKIP, accumulation_dtype, statistics
from kltriton.kernels.loss import LossInputs, terms

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_LEVELS = ("token", "sequence")


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor          # [] the loss (differentiable w.r.t. the policy logits)
    logprobs: torch.Tensor      # S fp32 (detached)
    ref_logprobs: torch.Tensor  # S fp32, 0 without a reference
    kl: torch.Tensor            # S fp32, the KL term (times the ratio with use_bias_correction_kl), 0 without a reference
    entropy: torch.Tensor       # S fp32 (0 with compute_entropy=False)
    ratio: torch.Tensor         # S fp32, the importance ratio (per sequence for sequence-level losses)
    metrics: dict               # name -> 0-dim fp32 tensor


# --- argument checks ---------------------------------------------------------------------------

def _check_per_token(name, tensor, shape, device, allow_none=True):
    tensor = local_rows(tensor, name)
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


def _per_token_or_sequence(name, tensor, shape, device, num_seqs, seq_index, acc):
    """``[N]`` from a tensor of shape ``S``, ``[num_seqs]``, or ``[B, 1]`` for ``S = [B, T]`` (TRL's sequence-level
    shape)."""
    tensor = local_rows(tensor, name)
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor of shape S or [num_seqs]")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but logits are on {device}")
    if tuple(tensor.shape) == tuple(shape):
        return tensor.detach().reshape(-1).to(acc)
    if tensor.dim() == 1 and tensor.shape[0] == num_seqs:
        return tensor.detach().to(acc)[seq_index]
    if len(shape) == 2 and tuple(tensor.shape) == (shape[0], 1):
        return tensor.detach().expand(shape).reshape(-1).to(acc)
    raise ValueError(f"{name} must have shape {tuple(shape)} or [num_seqs] = [{num_seqs}], got {tuple(tensor.shape)}")


def _denominator(name, value, device):
    """A user-given aggregation denominator (verl's ``batch_num_tokens`` / ``global_batch_size``): a positive
    python number or a 0-dim tensor (no host read), as float64; None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return runtime_scalar(check_float(name, value, above=0.0), device)


# --- sequence-level weights ---------------------------------------------------------------------

def _aggregation_weights(aggregation, scored, seq_index, num_seqs, horizon, dtype, num_tokens=None, num_seqs_agg=None):
    """``[N]`` weights with ``agg(x) = sum_n w[n] * x[n]`` (verl ``agg_loss``): ``num_tokens`` / ``num_seqs_agg``
    replace the token-mean / seq-mean denominators (verl's ``batch_num_tokens`` / ``global_batch_size``)."""
    valid = scored.to(dtype)
    if aggregation == "token-sum":
        return valid
    if aggregation == "token-mean":
        return valid / (valid.sum().clamp(min=1) if num_tokens is None else num_tokens.to(dtype))
    counts = torch.zeros(num_seqs, dtype=dtype, device=valid.device).index_add_(0, seq_index, valid)
    sequences = (counts > 0).to(dtype).sum().clamp(min=1) if num_seqs_agg is None else num_seqs_agg.to(dtype)
    if aggregation == "seq-mean-token-mean":
        return valid / counts.clamp(min=1)[seq_index] / sequences
    weights = valid / sequences
    return weights / horizon if aggregation == "seq-mean-token-sum-norm" else weights


def _default_horizon(layout, cu_seqlens, n, device):
    """The padded length: ``T`` of ``[B, T]``, the longest packed segment, or ``N`` for one flat sequence."""
    if len(layout.shape) >= 2:
        return runtime_scalar(layout.shape[-1], device)
    if cu_seqlens is not None and cu_seqlens.numel() > 1:
        return (cu_seqlens[1:] - cu_seqlens[:-1]).max().to(torch.float64)
    return runtime_scalar(max(n, 1), device)


def _importance_weights(old, rollout, is_mode, is_cap, is_min, scored, seq_index, num_seqs):
    """``(weights, masked, log_ratio)`` of rollout importance sampling (TRL's vLLM correction): the ratio
    ``exp(old - rollout)`` per token or per sequence, clamped to ``[is_min, is_cap]`` or zeroed outside it."""
    diff = torch.where(scored & ~torch.isnan(old - rollout), old - rollout, torch.zeros_like(old))
    log_w = diff
    if is_mode is not None and is_mode.startswith("sequence"):
        per_seq = torch.zeros(num_seqs, dtype=diff.dtype, device=diff.device).index_add_(0, seq_index, diff)
        log_w = per_seq[seq_index]
    w = torch.exp(log_w)
    high = float("inf") if is_cap is None else is_cap
    low = float("-inf") if is_min is None else is_min
    outside = ((w > high) | (w < low)) & scored
    if is_mode is None:
        weights = torch.ones_like(w)
    elif is_mode.endswith("truncate"):
        weights = torch.clamp(w, min=is_min, max=is_cap)
    else:
        weights = torch.where((w > high) | (w < low), torch.zeros_like(w), w)
    return weights, outside, diff


def _off_policy_keep(adv, logp, sampling, threshold, scored, seq_index, num_seqs):
    """TRL's off-policy sequence mask (DeepSeek-V3.2): keep a token when its advantage is ``>= 0`` or its sequence's
    mean ``sampling - logp`` (NaN counted as 0) is at most ``threshold``."""
    kl = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
    zeros = torch.zeros(num_seqs, dtype=kl.dtype, device=kl.device)
    total = zeros.index_add(0, seq_index, torch.where(scored, kl, torch.zeros_like(kl)))
    count = zeros.index_add(0, seq_index, scored.to(kl.dtype)).clamp(min=1)
    return (adv >= 0) | ((total / count)[seq_index] <= threshold)


def _geometric_mean_per_sequence(weights, scored, seq_index, num_seqs):
    """verl geo_mean's reading of token IS weights: ``exp(mean over the sequence of log(w + 1e-10))``."""
    logs = torch.where(scored, torch.log(weights + 1e-10), torch.zeros_like(weights))
    zeros = torch.zeros(num_seqs, dtype=weights.dtype, device=weights.device)
    count = zeros.index_add(0, seq_index, scored.to(weights.dtype)).clamp(min=1)
    return torch.exp(zeros.index_add(0, seq_index, logs) / count)[seq_index]


# --- metrics ------------------------------------------------------------------------------------

def _masked_mean(values, scored, count):
    return torch.where(scored, values, torch.zeros_like(values)).sum() / count


def _masked_extreme(values, scored, reduce, neutral):
    """``reduce`` (``amax`` / ``amin``) over the scored entries; ``neutral`` where there are none (an empty
    batch included: a reduction of zero elements has no value)."""
    fill = torch.full((1,), neutral, dtype=values.dtype, device=values.device)
    return reduce(torch.cat([torch.where(scored, values, fill), fill]))


def _metrics(token, scored, entropy, is_info, parts, extra):
    count = scored.float().sum().clamp(min=1)
    any_scored = scored.any()
    zero = torch.zeros((), dtype=torch.float32, device=scored.device)
    ratio = token.ratio.float()
    log_ratio = token.log_ratio.float()
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
    metrics.update({name: value.float() for name, value in parts.items()})
    metrics.update(extra)
    return {k: v.detach() for k, v in metrics.items()}


def _truncated_stats(call, full):
    """``(StreamStats, outside)`` of the two-pass route with a truncated policy: its ``logp`` / ``entropy`` of the
    truncated distribution, the reference's log-probs by their own pass (no gradient); ``outside [N]``: the scored
    positions whose label is outside the kept set."""
    if full:
        raise ValueError("kl_estimator='full' (the KL over the whole vocabulary) is not defined with a truncation")
    stats = route.statistics(call, statistics.request(entropy=True))
    if call.ref is not None:
        ref = route.reference_statistics(call, statistics.request())
        stats = stats._replace(ref_logp=ref.logp, ref_lse=ref.lse)
    return stats, (call.layout.target >= 0) & (stats.logp == float("-inf"))


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
    log_ratio_clamp: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: Optional[float] = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: Optional[torch.Tensor] = None,
    is_mode: Optional[str] = None,
    is_cap: Optional[float] = 2.0,
    aggregation: Optional[str] = None,
    horizon=None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    shift_labels: bool = False,
    backend: Optional[str] = None,
    process_group=None,
    vocab_start: Optional[int] = None,
    importance_sampling_level: str = "token",
    use_bias_correction_kl: bool = False,
    token_mask_entropy_quantile: Optional[float] = None,
    off_policy_mask_threshold: Optional[float] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    is_min: Optional[float] = None,
    entropy_aggregation: Optional[str] = None,
    pg_aggregation: Optional[str] = None,
    batch_num_tokens=None,
    global_batch_size=None,
    compute_entropy: bool = True,
    truncation=None,
    **loss_parameters,
) -> PolicyLossOutput:
    """The policy loss ``agg(pg * weights) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``.

    Args:
        logits: policy logits ``[..., V]`` (``S = logits.shape[:-1]``, as ``token_logprobs``), or a
            ``kltriton.LinearLogits`` (hidden states and an LM head: the gradients w.r.t. hidden / weight /
            bias are produced in the forward too, per GEMM tile; an LM head that does not require grad gets none).
        labels, temperature, ignore_index, mask, cu_seqlens, shift_labels, backend: as in ``token_logprobs``.
        advantages: ``S`` (per token) or ``[num_seqs]`` (per sequence: rows of ``[B, T]``, segments of
            ``cu_seqlens``, or one for a flat ``[N]``).
        old_logprobs: ``S`` log-probs of the policy that sampled; ``None``: on-policy (ratio 1, live gradient).
        ref: reference logits (same shape as ``logits``, read in the same pass) or log-probs ``S``.
        loss_type: a policy loss of verl 0.9.1's registry (``"vanilla"``, ``"dppo_tv"``, ``"dppo_kl"``, ``"gspo"``,
            ``"sapo"``, ``"gpg"``, ``"clip_cov"``, ``"kl_cov"``, ``"geo_mean"``, ``"dro"``, ``"cispo"``,
            ``"bypass_mode"``) or a TRL 1.16 ``loss_type`` (``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``,
            ``"cispo"``, ``"sapo"``, ``"luspo"``, ``"vespo"``), or ``"ppo"`` (``"vanilla"``'s formula, a dual clip
            only when given): formulas, sources and parameters in ``docs/api/losses.md``. A name alone takes its
            trainer's defaults (verl's ``ActorConfig``, TRL's ``GRPOConfig``; ``cispo`` and ``sapo``, in both,
            verl's): the keywords left None below, and the loss type's own parameters, take the loss type's default
            (``terms.DEFAULTS``, the table of ``docs/api/losses.md``); a keyword given always wins. ``clip_low`` /
            ``clip_high`` (default ``clip_low``) are verl's ``clip_ratio_low`` / ``_high`` (TRL's ``epsilon`` /
            ``epsilon_high``).
        dual_clip: verl's ``clip_ratio_c`` of the PPO formula: for ``A < 0`` the loss is at most ``-A * dual_clip``
            (``> 1``); ``math.inf``: no dual clip. None: the loss type's (3.0 for ``vanilla`` and ``bypass_mode``,
            as verl's ``ActorConfig``; none for ``ppo`` and TRL's names).
        log_ratio_clamp: the ratio is ``exp(clamp(logp - old, -c, c))`` (``> 0``); ``math.inf``: no clamp. None:
            the loss type's (20 for verl's names and ``ppo``, as verl; none for TRL's names and ``clipped_ratio``,
            as TRL and torchrl).
        **loss_parameters: the loss type's own parameters under their upstream names (``delta``, ``tau_pos`` /
            ``sapo_temperature_pos``, ``tau_neg``, ``clip_ratio_c`` (DPPO), ``dro_beta``, ``clip_cov_ratio``,
            ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``vespo_k_pos``, ...,
            ``bypass_loss_type``); a keyword the loss type does not take is a ``TypeError``.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (TRL: the ratio of a sequence is the exp of the
            mean log-ratio of its scored tokens, for every token of it; two-pass).
        kl_coef, kl_estimator, kl_clamp: the KL penalty (estimators of ``token_kl``, and verl's
            straight-through ``"k3+"``-style names); needs ``ref`` when ``kl_coef != 0``.
        use_bias_correction_kl: multiply the KL term by the importance ratio (TRL, DeepSeek-V3.2).
        entropy_coef: weight of the entropy bonus (subtracted). ``entropy_aggregation``: its aggregation over the
            local tokens (TRL: ``"token-mean"``); default the policy term's, with its denominators (verl).
        token_mask_entropy_quantile: ``q`` keeps the policy-gradient term (and the entropy bonus, as TRL) on the
            scored tokens whose entropy is at least the ``q`` quantile of the batch's scored entropies (TRL's
            ``top_entropy_quantile = 1 - q``). Fused: two passes over the logits, the second over the kept
            rows only.
        off_policy_mask_threshold: TRL's off-policy sequence mask: drops the policy term of a token with a
            negative advantage whose sequence's mean ``sampling - logp`` exceeds it (``sampling``:
            ``rollout_logprobs``, else ``old_logprobs``); two-pass.
        rollout_logprobs, is_mode, is_cap, is_min: rollout importance sampling (``"token_truncate"``,
            ``"token_mask"``, ``"sequence_truncate"``, ``"sequence_mask"``; TRL's names, ``is_cap`` /
            ``is_min`` its ``vllm_importance_sampling_clip_max`` / ``_min``) with weights ``exp(old - rollout)``
            (summed over the sequence for ``sequence_*``) clamped to ``[is_min, is_cap]`` or zeroed outside.
            Without ``is_mode`` the mismatch is only reported in the metrics.
        rollout_is_weights: precomputed importance weights (verl's ``rollout_is_weights``, TRL's
            ``importance_sampling_ratio``): ``S``, ``[num_seqs]`` or ``[B, 1]``, multiply the policy term (VESPO:
            enter its sequence weight; geo_mean: as their per-sequence geometric mean, as verl).
        aggregation: verl ``agg_loss`` mode (default: the loss type's, ``docs/api/losses.md``) of every term;
            ``pg_aggregation`` another one for the policy term alone (verl's ``sapo`` and ``geo_mean`` fix theirs,
            while its KL and entropy terms follow ``loss_agg_mode``; ``geo_mean``'s is over the local sequences,
            as verl's ``torch.mean``); ``horizon``
            divides ``"seq-mean-token-sum-norm"`` (verl's ``loss_scale_factor``; default the loss type's: 512 for
            ``dr_grpo``, TRL's ``max_completion_length``, else the padded length ``T``, the longest packed segment,
            or ``N``); ``batch_num_tokens`` / ``global_batch_size`` replace the
            token-mean / seq-mean denominators (verl's ``global_batch_info``; numbers or 0-dim tensors).
        compute_entropy: False skips the entropy (its output and ``entropy_mean`` are 0); needs no entropy term.
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
        ``clipfrac_lower``, ``ppo_kl`` (verl's flags of the loss type), ``kl_mean``, ``entropy_mean``,
        ``ratio_max``, ``ratio_min``, ``pg_loss``, ``kl_loss``, ``entropy_loss`` (the aggregated terms, before
        their coefficients), with ``rollout_logprobs``: ``is_weight_mean``, ``is_masked_frac``, ``mismatch_k3``;
        with the entropy mask ``entropy_threshold``; with VESPO ``vespo_phi_mean``.
    """
    call = enter(logits, labels, ref=ref, temperature=temperature, ignore_index=ignore_index, mask=mask,
                 cu_seqlens=cu_seqlens, shift_labels=shift_labels, backend=backend, process_group=process_group,
                 vocab_start=vocab_start, truncation=truncation, with_seq_index=True)
    device, shape, layout = call.device, call.layout.shape, call.layout
    spec = terms.loss_type_of(loss_type)
    aggregation, dual_clip, log_ratio_clamp, horizon, params = terms.settings(  # None: the loss type's default
        loss_type, loss_parameters, aggregation=aggregation, dual_clip=dual_clip, log_ratio_clamp=log_ratio_clamp,
        horizon=horizon)
    for name, value in (("aggregation", aggregation), ("entropy_aggregation", entropy_aggregation),
                        ("pg_aggregation", pg_aggregation)):
        if value is not None and value not in AGGREGATIONS:
            raise ValueError(f"{name} must be one of {AGGREGATIONS}, got {value!r}")
    if is_mode is not None and is_mode not in IS_MODES:
        raise ValueError(f"is_mode must be one of {IS_MODES} or None, got {is_mode!r}")
    if is_mode is not None and rollout_logprobs is None:
        raise ValueError(f"is_mode={is_mode!r} needs rollout_logprobs")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {importance_sampling_level!r}")
    sequence_level = importance_sampling_level == "sequence"
    if sequence_level and not spec.sequence_level:
        raise ValueError(f"importance_sampling_level='sequence' applies to the loss types with a TRL counterpart "
                         f"({tuple(k for k, v in terms.LOSS_TYPES.items() if v.sequence_level)}), not {loss_type!r}")
    formula = spec.formula
    clip_low = check_float("clip_low", clip_low, at_least=0.0)
    # CISPO's upper bound may lie below 1: TRL caps the ratio at epsilon_high itself (clip_high = epsilon_high - 1)
    clip_high = clip_low if clip_high is None else check_float(
        "clip_high", clip_high, **({"above": -1.0} if formula == "cispo" else {"at_least": 0.0}))
    kl_coef = check_float("kl_coef", kl_coef)
    entropy_coef = check_float("entropy_coef", entropy_coef)
    kl_clamp = estimators.check_kl_clamp(kl_clamp)
    is_cap = check_float("is_cap", is_cap, above=0.0, allow_none=True)
    is_min = check_float("is_min", is_min, at_least=0.0, allow_none=True)
    if is_mode is not None and is_mode.endswith("truncate") and is_cap is None and is_min is None:
        raise ValueError(f"is_mode={is_mode!r} needs is_cap or is_min")
    horizon = check_float("horizon", horizon, above=0.0, allow_none=True)
    quantile = check_float("token_mask_entropy_quantile", token_mask_entropy_quantile, at_least=0.0,
                           allow_none=True)
    if quantile is not None and quantile > 1.0:
        raise ValueError(f"token_mask_entropy_quantile must be in [0, 1], got {quantile}")
    off_policy = check_float("off_policy_mask_threshold", off_policy_mask_threshold, allow_none=True)
    if not compute_entropy and (entropy_coef != 0.0 or quantile is not None):
        raise ValueError("compute_entropy=False leaves no entropy for entropy_coef or token_mask_entropy_quantile")
    num_tokens = _denominator("batch_num_tokens", batch_num_tokens, device)
    num_seqs_agg = _denominator("global_batch_size", global_batch_size, device)

    # verl's bypass mode: the old policy is the rollout's; PPO on that ratio, or REINFORCE with on-policy IS weights
    if formula == "bypass_mode":
        if rollout_logprobs is None:
            raise ValueError("loss_type='bypass_mode' needs rollout_logprobs (the old policy is the rollout's)")
        if old_logprobs is not None:
            raise ValueError("loss_type='bypass_mode' takes rollout_logprobs as the old log-probs; leave "
                             "old_logprobs None")
        if params["bypass_loss_type"] == "ppo_clip":
            formula, old_logprobs, rollout_logprobs, is_mode = "ppo", rollout_logprobs, None, None
        else:
            formula = "gpg"

    with_ref_logits = call.ref is not None
    if ref is None and kl_coef != 0.0:
        raise ValueError("kl_coef != 0 needs ref (reference logits or log-probs)")
    estimator = estimators.parse(kl_estimator, ref_logits=with_ref_logits, argument="kl_estimator") \
        if ref is not None else None
    estimator_name = estimator.name if estimator is not None else ""
    target, seq_index, num_seqs = layout.target, layout.seq_index, layout.num_seqs
    n = target.numel()
    acc = accumulation_dtype(call.dtype)

    if not isinstance(advantages, torch.Tensor) or not advantages.dtype.is_floating_point:
        raise TypeError("advantages must be a floating tensor of shape S or [num_seqs]")
    per_sequence_advantages = tuple(local_rows(advantages, "advantages").shape) != tuple(shape)
    adv = _per_token_or_sequence("advantages", advantages, shape, device, num_seqs, seq_index, acc)
    old = _check_per_token("old_logprobs", old_logprobs, shape, device)
    old = None if old is None else old.to(acc)
    rollout = _check_per_token("rollout_logprobs", rollout_logprobs, shape, device)
    rollout = None if rollout is None else rollout.to(acc)
    given_is = None if rollout_is_weights is None else _per_token_or_sequence(
        "rollout_is_weights", rollout_is_weights, shape, device, num_seqs, seq_index, acc)
    ref_logp_given = None if call.ref_logprobs is None else call.ref_logprobs.to(acc)

    scored = target != SKIP
    if num_seqs_agg is None and spec.all_sequences:  # TRL's .mean() over the sequences, empty ones included
        num_seqs_agg = runtime_scalar(max(num_seqs, 1), device)
    if ref_logp_given is not None:  # like every per-token output: 0 where not scored
        ref_logp_given = torch.where(scored, ref_logp_given, torch.zeros_like(ref_logp_given))
    horizon_t = runtime_scalar(horizon, device) if horizon is not None else _default_horizon(layout, cu_seqlens, n, device)

    def aggregation_weights(rows):
        """``(agg_w, agg_pg)``: every term's ``[N]`` aggregation weights over ``rows``, and the policy term's."""
        every = _aggregation_weights(aggregation, rows, seq_index, num_seqs, horizon_t.to(acc), acc, num_tokens,
                                     num_seqs_agg)
        if pg_aggregation is None:
            return every, every
        return every, _aggregation_weights(pg_aggregation, rows, seq_index, num_seqs, horizon_t.to(acc), acc,
                                           num_tokens, runtime_scalar(max(num_seqs, 1), device)
                                           if formula == "geo_mean" else num_seqs_agg)

    agg_w, agg_pg = aggregation_weights(scored)
    hp = terms.hyperparameters(device, ratio_low=runtime_scalar(1.0 - clip_low, device),
                               ratio_high=runtime_scalar(1.0 + clip_high, device),
                               dual_clip=None if dual_clip is None else runtime_scalar(dual_clip, device),
                               log_ratio_clamp=runtime_scalar(log_ratio_clamp, device),
                               kl_clamp=None if kl_clamp is None else runtime_scalar(kl_clamp, device),
                               kl_ratio=runtime_scalar(float(bool(use_bias_correction_kl)), device),
                               **{name: runtime_scalar(value, device) for name, value in params.items()
                                  if isinstance(value, float)})
    w_kl = agg_w * runtime_scalar(kl_coef, device).to(acc)
    full = estimator is not None and estimator.needs_ref_logits

    # Per-row policy-term weights known before the logits are read: the given IS weights (VESPO reads them inside
    # its sequence weight; geo_mean as their per-sequence geometric mean).
    pg_weight = torch.ones_like(agg_pg)
    log_is = None
    if given_is is not None:
        if formula == "vespo":
            log_is = torch.log(given_is)
        elif formula == "geo_mean":
            pg_weight = _geometric_mean_per_sequence(given_is, scored, seq_index, num_seqs)
        else:
            pg_weight = given_is

    on_policy_is = old is None and rollout is not None
    whole_sequences = (sequence_level or on_policy_is or off_policy is not None
                       or (quantile is not None and entropy_coef != 0.0))
    fused = route.loss_route(call, formula, whole_sequences) == "fused"
    minus_entropy_coef = runtime_scalar(-entropy_coef, device).to(acc)

    def entropy_aggregation_weights(keep):
        """The entropy bonus's ``[N]`` aggregation weights, over the kept rows with the entropy mask (TRL): the
        policy term's aggregation and denominators (verl), or ``entropy_aggregation`` over the local tokens."""
        if entropy_aggregation is None:
            if keep is None:
                return agg_w
            return _aggregation_weights(aggregation, keep, seq_index, num_seqs, horizon_t.to(acc), acc, num_tokens,
                                        num_seqs_agg)
        rows = scored if keep is None else keep
        return _aggregation_weights(entropy_aggregation, rows, seq_index, num_seqs, horizon_t.to(acc), acc)

    is_info, keep, threshold, outside = None, None, None, None
    if fused:
        if rollout is not None:
            is_info = _importance_weights(old, rollout, is_mode, is_cap, is_min, scored, seq_index, num_seqs)
            pg_weight = pg_weight * is_info[0]
        w_pg = agg_pg * pg_weight
        w_ent = entropy_aggregation_weights(None) * minus_entropy_coef
        inputs = LossInputs(old, adv, w_pg, w_kl, w_ent, ref_logp_given)
        loss, stats, threshold = route.fused_loss(call, inputs, hp, formula, estimator_name, entropy_coef != 0.0,
                                                  with_entropy=compute_entropy, entropy_quantile=quantile)
        logp, entropy = stats.logp, stats.entropy
        if quantile is not None:
            keep = scored & (entropy >= threshold)
            w_pg = w_pg * keep.to(acc)
    else:  # two passes: the differentiable statistics, the formulas in PyTorch, autograd
        wanted = statistics.request(entropy=compute_entropy, ref=with_ref_logits, full_kl=full)
        if call.truncation is not None:
            stats, outside = _truncated_stats(call, full)
            scored = scored & ~outside
            agg_w, agg_pg = aggregation_weights(scored)
            w_kl = agg_w * runtime_scalar(kl_coef, device).to(acc)
        else:
            stats = route.statistics(call, wanted)
        logp = stats.logp
        entropy = stats.entropy if compute_entropy else torch.zeros_like(logp)
        if rollout is not None:
            old_for_is = logp.detach() if old is None else old
            is_info = _importance_weights(old_for_is, rollout, is_mode, is_cap, is_min, scored, seq_index, num_seqs)
            pg_weight = pg_weight * is_info[0]
        if off_policy is not None:
            sampling = rollout if rollout is not None else (logp.detach() if old is None else old)
            pg_weight = pg_weight * _off_policy_keep(adv, logp, sampling, off_policy, scored, seq_index,
                                                     num_seqs).to(acc)
        if quantile is not None:
            keep, threshold = terms.entropy_keep(entropy.detach(), scored, quantile)
            pg_weight = pg_weight * keep.to(acc)
        w_pg = agg_pg * pg_weight
    if not compute_entropy:
        entropy = torch.zeros_like(logp)
    ent_agg = entropy_aggregation_weights(keep)
    w_ent = ent_agg * minus_entropy_coef
    ref_logp = stats.ref_logp if with_ref_logits else (
        ref_logp_given if ref_logp_given is not None else torch.zeros_like(logp))
    reported_logp = logp
    if outside is not None:  # dropped positions: finite stand-ins (weight 0, no gradient) so no term is NaN
        stand_in = old if old is not None else torch.zeros_like(logp)
        logp = torch.where(outside, stand_in.to(logp.dtype), logp)
        ref_logp = torch.where(outside, stand_in.to(logp.dtype), ref_logp)
    token = terms.token_terms(formula, estimator, logp, ref_logp, stats.full_kl if full else None, old, adv, hp,
                              scored, seq_index, num_seqs, level=importance_sampling_level, log_is=log_is)
    if outside is not None:
        zero = torch.zeros_like(token.ratio)
        token = token._replace(ratio=torch.where(outside, zero, token.ratio), kl=torch.where(outside, zero, token.kl))
    if not fused:
        loss = terms.objective(token, entropy, w_pg, w_kl, w_ent).sum()
    parts = {"pg_loss": (w_pg * token.pg).sum(), "kl_loss": (agg_w * token.kl).sum(),
             "entropy_loss": (ent_agg * entropy).sum()}
    extra = {}
    if quantile is not None:
        extra["entropy_threshold"] = threshold.float().reshape(())
    if token.seq_weight is not None:  # TRL's vespo/phi_seq_mean: over the sequences with per-sequence advantages
        if per_sequence_advantages:  # phi is the same on every row of a sequence (1 for a sequence without rows)
            phi = token.seq_weight.new_ones(num_seqs).scatter(0, seq_index, token.seq_weight)
            extra["vespo_phi_mean"] = phi.float().mean() if num_seqs else phi.float().sum()
        else:
            extra["vespo_phi_mean"] = _masked_mean(token.seq_weight.float(), scored, scored.float().sum().clamp(min=1))
    if outside is not None:
        extra["outside_support_frac"] = outside.float().sum() / (scored | outside).float().sum().clamp(min=1)
    metrics = _metrics(token, scored, entropy, is_info, parts, extra)
    view = lambda t: t.detach().float().view(shape)  # noqa: E731
    return PolicyLossOutput(loss, view(reported_logp), view(ref_logp), view(token.kl), view(entropy),
                            view(token.ratio), metrics)
