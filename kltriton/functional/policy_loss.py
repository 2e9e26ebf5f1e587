"""``policy_loss``: every policy loss of verl 0.9.1's registry and of TRL 1.16's ``GRPOConfig.loss_type``,
straight from the logits.

``kltriton.route.loss_route`` picks the route. Fused (a loss whose derivative w.r.t. a row's log-prob depends on
that row alone, ``terms.FUSED``, at the token level): the ``loss`` op (``kltriton.ops.loss``) computes every row's
statistics and writes the loss's gradient w.r.t. the logits (or a ``LinearLogits`` policy's hidden states / weight /
bias) in the forward; the C++ and Triton kernels read each row from memory once for both, and the backward only
applies the upstream gradient. With ``token_mask_entropy_quantile`` the fused route takes two passes
(``kltriton.kernels.loss.masked``). Two-pass (sequence-level ratios and weights, batch selections, on-policy rollout
importance sampling, vocab-parallel logits, a truncation): the differentiable statistics, the formulas of
``kltriton.kernels.loss.terms`` in PyTorch, and autograd (the logits are read again in the backward). The ``[N]``
arithmetic around the formulas (aggregation and importance weights, metrics) is ``kernels.loss.weights``.
"""
import collections
from typing import NamedTuple, Optional

import torch

from kltriton import estimators, route
from kltriton._values import check_float, runtime_scalar
from kltriton.front_door import Call, check_group, enter, local_rows
from kltriton.kernels import SKIP, accumulation_dtype, constants, statistics
from kltriton.kernels.loss import LossInputs, terms, weights
from kltriton.kernels.loss.weights import IS_MODES, Sequences
from kltriton.kernels.layout import RowWeights

IS_LEVELS = ("token", "sequence")


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor          # [] the loss (differentiable w.r.t. the policy logits)
    logprobs: torch.Tensor      # S fp32 (detached)
    ref_logprobs: torch.Tensor  # S fp32, 0 without a reference
    kl: torch.Tensor            # S fp32, the KL term (times the ratio with use_bias_correction_kl), 0 without ref
    entropy: torch.Tensor       # S fp32 (0 with compute_entropy=False)
    ratio: torch.Tensor         # S fp32, the importance ratio (per sequence for sequence-level losses)
    metrics: dict               # name -> 0-dim fp32 tensor


# --- the options, checked -----------------------------------------------------------------------

class _Loss(NamedTuple):
    """What the loss computes, once its options are checked."""
    formula: str                       # a key of terms.FORMULAS (bypass_mode resolved)
    level: str                         # "token" / "sequence" importance sampling
    settings: terms.Settings           # the loss type's defaults and the keywords that override them
    hyperparameters: torch.Tensor                   # float64 hyperparameter vector (terms.hyperparameters)
    estimator: Optional[estimators.Estimator]
    kl_coef: float
    entropy_coef: float
    compute_entropy: bool
    quantile: Optional[float]          # TRL's entropy mask
    all_sequences: bool                # seq-mean over every sequence, empty ones too (TRL's .mean())
    quantile_group: object = None      # the ranks whose scored tokens the entropy mask's quantile is over


class _Sampling(NamedTuple):
    """Where the samples came from: the old and rollout log-probs, rollout importance sampling, the off-policy mask."""
    old: Optional[torch.Tensor]        # the argument as given (bypass_mode: the rollout's)
    rollout: Optional[torch.Tensor]
    is_mode: Optional[str]
    is_cap: Optional[float]
    is_min: Optional[float]
    off_policy: Optional[float]


def _check_choice(name, value, choices, allow_none=True):
    if value is None and allow_none:
        return
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}{' or None' if allow_none else ''}, got {value!r}")


_PLAIN = frozenset((bool, int, float, str, type(None), estimators.Estimator, torch.device))
_CHECKED = collections.OrderedDict()  # _options_key -> the checked _Loss, most recent last
CHECKED_CACHE_SIZE = 64


def _options_key(values: tuple):
    """A hashable key of a flat tuple of option values with their types (``1``, ``1.0`` and ``True`` are three keys):
    python scalars, strings, estimators and devices; None when a value is anything else (a tensor, a tuple)."""
    kinds = tuple(map(type, values))
    return (values, kinds) if _PLAIN.issuperset(kinds) else None


def _loss(call: Call, loss_type, loss_parameters, settings_given: dict, level, clip, kl, entropy) -> _Loss:
    """The checked ``_Loss``: ``settings_given`` the keywords ``terms.settings`` resolves, ``clip`` = ``(clip_low,
    clip_high)``, ``kl`` = ``(kl_coef, kl_estimator, kl_clamp, use_bias_correction_kl)``, ``entropy`` =
    ``(entropy_coef, compute_entropy, token_mask_entropy_quantile)``. A training loop passes the same options on
    every step: in eager calls the checked result of each set of python values is kept (``CHECKED_CACHE_SIZE``)."""
    if torch.compiler.is_compiling():
        return _check_loss(call, loss_type, loss_parameters, settings_given, level, clip, kl, entropy)
    # flat: the fixed-length options, then the loss type's own parameters as their count, names and values
    key = _options_key((call.device, call.ref is not None, call.ref_logprobs is not None, loss_type, level, *clip, *kl,
                        *entropy, *settings_given.values(), len(loss_parameters), *loss_parameters,
                        *loss_parameters.values()))
    checked = None if key is None else _CHECKED.get(key)
    if checked is None:
        checked = _check_loss(call, loss_type, loss_parameters, settings_given, level, clip, kl, entropy)
        if key is not None:
            _CHECKED[key] = checked
            if len(_CHECKED) > CHECKED_CACHE_SIZE:
                _CHECKED.popitem(last=False)
    return checked


def _check_loss(call: Call, loss_type, loss_parameters, settings_given: dict, level, clip, kl, entropy) -> _Loss:
    """``_loss`` without the cache."""
    spec = terms.loss_type_of(loss_type)
    settings = terms.settings(loss_type, loss_parameters, **settings_given)
    _check_choice("aggregation", settings.aggregation, constants.AGGREGATIONS)
    _check_choice("importance_sampling_level", level, IS_LEVELS, allow_none=False)
    if level == "sequence" and not spec.sequence_level:
        raise ValueError(f"importance_sampling_level='sequence' applies to the loss types with a TRL counterpart "
                         f"({tuple(k for k, v in terms.LOSS_TYPES.items() if v.sequence_level)}), not {loss_type!r}")
    clip_low = check_float("clip_low", clip[0], at_least=0.0)
    # CISPO's upper bound may lie below 1: TRL caps the ratio at epsilon_high itself (clip_high = epsilon_high - 1)
    clip_high = clip_low if clip[1] is None else check_float(
        "clip_high", clip[1], **({"above": -1.0} if spec.formula == "cispo" else {"at_least": 0.0}))
    kl_coef, kl_estimator, kl_clamp, bias_correction = kl
    kl_coef = check_float("kl_coef", kl_coef)
    kl_clamp = estimators.check_kl_clamp(kl_clamp)
    has_ref = call.ref is not None or call.ref_logprobs is not None
    if not has_ref and kl_coef != 0.0:
        raise ValueError("kl_coef != 0 needs ref (reference logits or log-probs)")
    estimator = estimators.parse(kl_estimator, ref_logits=call.ref is not None, argument="kl_estimator") \
        if has_ref else None
    entropy_coef, compute_entropy, quantile = entropy
    entropy_coef = check_float("entropy_coef", entropy_coef)
    quantile = check_float("token_mask_entropy_quantile", quantile, at_least=0.0, allow_none=True)
    if quantile is not None and quantile > 1.0:
        raise ValueError(f"token_mask_entropy_quantile must be in [0, 1], got {quantile}")
    if not compute_entropy and (entropy_coef != 0.0 or quantile is not None):
        raise ValueError("compute_entropy=False leaves no entropy for entropy_coef or token_mask_entropy_quantile")
    hyperparameters = terms.hyperparameters(call.device, ratio_low=1.0 - clip_low, ratio_high=1.0 + clip_high,
                                            dual_clip=settings.dual_clip, log_ratio_clamp=settings.log_ratio_clamp,
                                            kl_clamp=kl_clamp, kl_ratio=float(bool(bias_correction)),
                                            **{name: value for name, value in settings.parameters.items()
                                               if isinstance(value, float)})
    return _Loss(spec.formula, level, settings, hyperparameters, estimator, kl_coef, entropy_coef, bool(compute_entropy), quantile,
                 spec.all_sequences)


def _sampling(loss: _Loss, old, rollout, is_mode, is_cap, is_min, off_policy) -> tuple:
    """``(loss, _Sampling)`` checked; verl's ``bypass_mode`` resolved (the old policy is the rollout's: PPO on that
    ratio, or REINFORCE with on-policy IS weights)."""
    _check_choice("is_mode", is_mode, IS_MODES)
    if is_mode is not None and rollout is None:
        raise ValueError(f"is_mode={is_mode!r} needs rollout_logprobs")
    is_cap = check_float("is_cap", is_cap, above=0.0, allow_none=True)
    is_min = check_float("is_min", is_min, at_least=0.0, allow_none=True)
    if is_mode is not None and is_mode.endswith("truncate") and is_cap is None and is_min is None:
        raise ValueError(f"is_mode={is_mode!r} needs is_cap or is_min")
    off_policy = check_float("off_policy_mask_threshold", off_policy, allow_none=True)
    if loss.formula == "bypass_mode":
        if rollout is None:
            raise ValueError("loss_type='bypass_mode' needs rollout_logprobs (the old policy is the rollout's)")
        if old is not None:
            raise ValueError("loss_type='bypass_mode' takes rollout_logprobs as the old log-probs; leave "
                             "old_logprobs None")
        if loss.settings.parameters["bypass_loss_type"] == "ppo_clip":
            return loss._replace(formula="ppo"), _Sampling(rollout, None, None, is_cap, is_min, off_policy)
        loss = loss._replace(formula="gpg")
    return loss, _Sampling(old, rollout, is_mode, is_cap, is_min, off_policy)


def _checked(name, tensor, call: Call, per_sequence: bool = False):
    """``(values, per_sequence)`` of a floating tensor of the leading shape ``S`` (a DTensor: its local rows), detached
    and flat: ``[N]``, or with ``per_sequence`` also one value per sequence, ``[num_seqs]`` or ``[B, 1]`` for ``S = [B,
    T]`` (TRL's sequence-level shape) as ``[num_seqs]``. None stays ``(None, False)``. No copy, no dtype change."""
    tensor = local_rows(tensor, name)
    if tensor is None:
        return None, False
    shape, layout = call.layout.shape, call.layout
    expected = lambda: f"S = {tuple(shape)}" + (f" or [num_seqs] = [{layout.num_seqs}]" if per_sequence else "")  # noqa: E731
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor of shape {expected()}")
    if tensor.device != call.device:
        raise ValueError(f"{name} is on {tensor.device} but logits are on {call.device}")
    if tensor.shape == shape:
        return tensor.detach().reshape(-1), False
    if per_sequence and tensor.dim() == 1 and tensor.shape[0] == layout.num_seqs:
        return tensor.detach(), True
    if per_sequence and len(shape) == 2 and tuple(tensor.shape) == (shape[0], 1):
        return tensor.detach().reshape(-1), True
    raise ValueError(f"{name} must have shape {expected()}, got {tuple(tensor.shape)}")


def _per_position(name, tensor, call: Call, acc, per_sequence: bool = False):
    """``[N]`` in ``acc`` from ``_checked``'s values, a per-sequence value repeated over its positions."""
    values, of_sequences = _checked(name, tensor, call, per_sequence)
    if values is None:
        return None
    return (values[call.layout.seq_index] if of_sequences else values).to(acc)


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


class _Denominators(NamedTuple):
    """The aggregations' given denominators (0-dim float64, None: counted) and seq-mean-token-sum-norm's horizon."""
    num_tokens: Optional[torch.Tensor]
    num_seqs_agg: Optional[torch.Tensor]
    horizon: Optional[torch.Tensor]


def _denominators(call: Call, loss: _Loss, modes, cu_seqlens, batch_num_tokens, global_batch_size) -> _Denominators:
    """``modes``: the aggregation modes of the call's terms (the default horizon only for the one that reads it)."""
    layout, device = call.layout, call.device
    num_seqs_agg = _denominator("global_batch_size", global_batch_size, device)
    if num_seqs_agg is None and loss.all_sequences:  # TRL's .mean() over the sequences, empty ones included
        num_seqs_agg = runtime_scalar(max(layout.num_seqs, 1), device)
    horizon = check_float("horizon", loss.settings.horizon, above=0.0, allow_none=True)
    if horizon is not None:
        horizon = runtime_scalar(horizon, device)
    elif "seq-mean-token-sum-norm" in modes:
        horizon = weights.default_horizon(layout.shape, cu_seqlens, device, call.split)
    return _Denominators(_denominator("batch_num_tokens", batch_num_tokens, device), num_seqs_agg, horizon)


def _sequences(call: Call, denominators: _Denominators) -> Sequences:
    layout = call.layout
    return Sequences(layout.seq_index, layout.num_seqs, denominators.horizon, denominators.num_tokens,
                     denominators.num_seqs_agg, call.sequence_group, layout.position)


# --- the two routes -----------------------------------------------------------------------------

class _Aggregations(NamedTuple):
    """The terms' aggregation modes, and how they weigh the rows."""
    every: str                     # every term's (``aggregation``)
    pg: Optional[str]              # the policy term's own (verl's sapo / geo_mean), else ``every``
    entropy: Optional[str]         # the entropy bonus's over the local tokens (TRL), else the policy term's
    geo_mean: bool                 # geo_mean's policy term: seq-mean over the local sequences (verl's torch.mean)

    def counted(self, rows, sequences: Sequences, dtype) -> Optional[weights.RowCounts]:
        """``rows`` counted (one all-reduce under a sequence group) when an aggregation needs the counts."""
        modes = {self.every, self.pg or self.every, self.entropy or self.every}
        return None if modes == {"token-sum"} else weights.row_counts(rows, sequences, dtype)

    def weights(self, rows, sequences: Sequences, dtype, counts):
        """``(every, pg)``: the ``[N]`` weights of every term and of the policy term over ``rows`` (``counts``:
        ``counted(rows)``)."""
        every = weights.aggregation_weights(self.every, rows, sequences, dtype, counts=counts)
        if self.pg is None:
            return every, every
        pg_sequences = sequences._replace(num_seqs_agg=runtime_scalar(max(sequences.num_seqs, 1),
                                                                      rows.device)) if self.geo_mean else sequences
        return every, weights.aggregation_weights(self.pg, rows, pg_sequences, dtype, counts=counts)

    def entropy_weights(self, rows, sequences: Sequences, dtype, counts):
        """The entropy bonus's ``[N]`` weights over ``rows`` (the kept rows with the entropy mask, TRL)."""
        if self.entropy is None:
            return weights.aggregation_weights(self.every, rows, sequences, dtype, counts=counts)
        return weights.aggregation_weights(self.entropy, rows, sequences, dtype, own_denominators=False,
                                           counts=counts)


class _Rows(NamedTuple):
    """The ``[N]`` inputs of the loss."""
    adv: torch.Tensor
    old: Optional[torch.Tensor]
    ref_logp: Optional[torch.Tensor]   # given reference log-probs (0 where not scored)
    scored: torch.Tensor               # bool
    pg_weight: torch.Tensor            # the policy term's factor known before the logits are read
    log_is: Optional[torch.Tensor]     # VESPO's log IS weights


class _Result(NamedTuple):
    stats: statistics.StreamStats
    scored: torch.Tensor               # the rows in the loss (a truncation drops the labels outside its kept set)
    outside: Optional[torch.Tensor]    # those dropped rows
    pg_weight: torch.Tensor
    keep: Optional[torch.Tensor]       # TRL's entropy mask
    threshold: Optional[torch.Tensor]
    importance: Optional[weights.ImportanceWeights]
    loss: Optional[torch.Tensor]       # the fused route's loss (None: the formulas give it)
    counts: Optional[weights.RowCounts]  # the scored rows counted, when the route counted them


def _fused(call: Call, loss: _Loss, sampling: _Sampling, rows: _Rows, aggregations, sequences, acc) -> _Result:
    """The ``loss`` op: statistics, loss and gradient in one forward."""
    pg_weight, importance = rows.pg_weight, None
    if sampling.rollout is not None:
        importance = weights.importance_weights(rows.old, sampling.rollout, sampling.is_mode, sampling.is_cap,
                                                sampling.is_min, rows.scored, sequences)
        pg_weight = pg_weight * importance.weights
    counts = aggregations.counted(rows.scored, sequences, acc)
    agg_w, agg_pg = aggregations.weights(rows.scored, sequences, acc, counts)
    w_ent = aggregations.entropy_weights(rows.scored, sequences, acc, counts) * runtime_scalar(-loss.entropy_coef,
                                                                                                 call.device).to(acc)
    w_kl = agg_w * runtime_scalar(loss.kl_coef, call.device).to(acc)
    inputs = LossInputs(rows.old, rows.adv, agg_pg * pg_weight, w_kl, w_ent, rows.ref_logp)
    value, stats, threshold, _ = route.fused_loss(call, inputs, loss.hyperparameters, loss.formula,
                                               loss.estimator.name if loss.estimator else "", loss.entropy_coef != 0.0,
                                               with_entropy=loss.compute_entropy, entropy_quantile=loss.quantile)
    keep = None if loss.quantile is None else rows.scored & (stats.entropy >= threshold)
    pg_weight = pg_weight if keep is None else pg_weight * keep.to(acc)
    return _Result(stats, rows.scored, None, pg_weight, keep, threshold, importance, value, counts)


def _two_pass(call: Call, loss: _Loss, sampling: _Sampling, rows: _Rows, sequences, acc) -> _Result:
    """The differentiable statistics; the weights that need the new log-probs; the formulas and autograd later."""
    exact_kl = loss.estimator is not None and loss.estimator.needs_ref_logits
    scored, outside = rows.scored, None
    if call.truncation is not None:
        if exact_kl:
            raise ValueError("kl_estimator='full' (the KL over the whole vocabulary) is not defined with a "
                             "truncation")
        stats = route.statistics(call, statistics.request(entropy=True))
        if call.ref is not None:
            ref = route.reference_statistics(call, statistics.request())
            stats = stats._replace(ref_logp=ref.logp, ref_lse=ref.lse)
        outside = (call.layout.target >= 0) & (stats.logp == float("-inf"))
        scored = scored & ~outside
    else:
        stats = route.statistics(call, statistics.request(entropy=loss.compute_entropy, ref=call.ref is not None,
                                                          full_kl=exact_kl))
    logp, pg_weight, importance, keep, threshold = stats.logp, rows.pg_weight, None, None, None
    if sampling.rollout is not None:
        importance = weights.importance_weights(logp.detach() if rows.old is None else rows.old, sampling.rollout,
                                                sampling.is_mode, sampling.is_cap, sampling.is_min, scored, sequences)
        pg_weight = pg_weight * importance.weights
    if sampling.off_policy is not None:
        behaviour = sampling.rollout if sampling.rollout is not None else (
            logp.detach() if rows.old is None else rows.old)
        pg_weight = pg_weight * weights.off_policy_keep(rows.adv, logp, behaviour, sampling.off_policy, scored,
                                                        sequences).to(acc)
    if loss.quantile is not None:
        keep, threshold = terms.entropy_keep(stats.entropy.detach(), scored, loss.quantile, loss.quantile_group)
        pg_weight = pg_weight * keep.to(acc)
    return _Result(stats, scored, outside, pg_weight, keep, threshold, importance, None, None)


def _rows(call: Call, loss: _Loss, sampling: _Sampling, advantages, rollout_is_weights, acc) -> _Rows:
    """The loss's ``[N]`` inputs, checked (DTensors: their local rows)."""
    adv = _per_position("advantages", advantages, call, acc, per_sequence=True)
    if adv is None:
        raise TypeError("advantages must be a floating tensor of shape S or [num_seqs]")
    scored = call.layout.target != SKIP
    given_is = _per_position("rollout_is_weights", rollout_is_weights, call, acc, per_sequence=True)
    pg_weight, log_is = torch.ones_like(adv), None
    if given_is is not None:  # VESPO reads them inside its sequence weight; geo_mean as their geometric mean
        if loss.formula == "vespo":
            log_is = torch.log(given_is)
        elif loss.formula == "geo_mean":
            pg_weight = weights.geometric_mean_per_sequence(given_is, scored, _sequences_of(call))
        else:
            pg_weight = given_is
    ref_logp = None if call.ref_logprobs is None else call.ref_logprobs.to(acc)
    if ref_logp is not None:  # like every per-token output: 0 where not scored
        ref_logp = torch.where(scored, ref_logp, torch.zeros_like(ref_logp))
    return _Rows(adv, _per_position("old_logprobs", sampling.old, call, acc), ref_logp, scored, pg_weight, log_is)


def _sequences_of(call: Call) -> Sequences:
    """The rows' sequences alone (geo_mean's per-sequence mean needs no denominators)."""
    return Sequences(call.layout.seq_index, call.layout.num_seqs, group=call.sequence_group)


def _per_token(values, layout):
    """``[N]`` values as a per-token output: fp32 of the layout's leading shape, no gradient (a view where it is
    that)."""
    if values.requires_grad:
        values = values.detach()
    return layout.shaped(values if values.dtype == torch.float32 else values.float())


def _one_pass(call: Call, loss: _Loss, old_logprobs, advantages, denominators: _Denominators) -> "PolicyLossOutput":
    """The fused route of the common call (token-level ratio, one aggregation for every term, no rollout importance
    sampling, entropy mask or sequence group) as kernels alone: the targets with the rows' inputs, the loss with its
    gradient, its per-token terms and metrics (``route.weighted_loss``: one C++ op for local dense logits); no
    ``[N]`` ops around them."""
    layout = call.layout
    adv, per_sequence = _checked("advantages", advantages, call, per_sequence=True)
    if adv is None:
        raise TypeError("advantages must be a floating tensor of shape S or [num_seqs]")
    old, _ = _checked("old_logprobs", old_logprobs, call)
    weights = RowWeights(loss.settings.aggregation, *denominators, adv, per_sequence, loss.kl_coef, loss.entropy_coef,
                         accumulation_dtype(call.dtype))
    value, stats, out = route.weighted_loss(call, weights, old, loss.hyperparameters, loss.formula,
                                            loss.estimator.name if loss.estimator else "", loss.entropy_coef != 0.0,
                                            loss.compute_entropy)
    view = lambda t: _per_token(t, layout)  # noqa: E731
    zeros = lambda: torch.zeros(layout.shape, dtype=torch.float32, device=call.device)  # noqa: E731
    if call.ref is not None:
        ref_logp = view(stats.ref_logp)
    elif call.ref_logprobs is not None:  # like every per-token output: 0 where not scored
        ref_logp = view(torch.where(layout.target != SKIP, call.ref_logprobs.float(), 0.0))
    else:
        ref_logp = zeros()
    entropy = view(stats.entropy) if loss.compute_entropy else zeros()
    return PolicyLossOutput(value, view(stats.logp), ref_logp, view(out.kl), entropy, view(out.ratio),
                            dict(zip(constants.LOSS_METRICS, out.metrics.unbind())))


# --- the output ---------------------------------------------------------------------------------

def _output(call: Call, loss: _Loss, rows: _Rows, result: _Result, aggregations, sequences, per_sequence_adv, acc):
    """The per-token terms, the loss (two-pass: from the formulas), the metrics and the outputs."""
    stats, scored, outside = result.stats, result.scored, result.outside
    logp = stats.logp
    entropy = stats.entropy if loss.compute_entropy else torch.zeros_like(logp)
    counts = result.counts if result.counts is not None else aggregations.counted(scored, sequences, acc)
    agg_w, agg_pg = aggregations.weights(scored, sequences, acc, counts)
    entropy_rows = scored if result.keep is None else result.keep
    ent_agg = aggregations.entropy_weights(entropy_rows, sequences, acc, counts if result.keep is None else
                                           aggregations.counted(entropy_rows, sequences, acc))
    w_pg = agg_pg * result.pg_weight
    w_kl = agg_w * runtime_scalar(loss.kl_coef, call.device).to(acc)
    ref_logp = stats.ref_logp if call.ref is not None else (
        rows.ref_logp if rows.ref_logp is not None else torch.zeros_like(logp))
    reported_logp = logp
    if outside is not None:  # dropped positions: finite stand-ins (weight 0, no gradient) so no term is NaN
        stand_in = rows.old if rows.old is not None else torch.zeros_like(logp)
        logp = torch.where(outside, stand_in.to(logp.dtype), logp)
        ref_logp = torch.where(outside, stand_in.to(logp.dtype), ref_logp)
    exact_kl = loss.estimator is not None and loss.estimator.needs_ref_logits
    token = terms.token_terms(loss.formula, loss.estimator, logp, ref_logp, stats.full_kl if exact_kl else None, rows.old,
                              rows.adv, loss.hyperparameters, scored, sequences.seq_index, sequences.num_seqs, level=loss.level,
                              log_is=rows.log_is, sequence_group=sequences.group)
    if outside is not None:
        zero = torch.zeros_like(token.ratio)
        token = token._replace(ratio=torch.where(outside, zero, token.ratio), kl=torch.where(outside, zero, token.kl))
    value = result.loss
    if value is None:
        w_ent = ent_agg * runtime_scalar(-loss.entropy_coef, call.device).to(acc)
        value = terms.objective(token, entropy, w_pg, w_kl, w_ent).sum()
    # the whole batch's loss on every rank (under a sequence group), its gradient that of the whole loss
    value = sequences.across(value, replicated=True)
    # metrics: sums over the rows (of every rank under a sequence group), or given as they are
    sums = {"pg_loss": ((w_pg * token.pg).sum(), None), "kl_loss": ((agg_w * token.kl).sum(), None),
            "entropy_loss": ((ent_agg * entropy).sum(), None)}
    given = {}
    if loss.quantile is not None:
        given["entropy_threshold"] = result.threshold.float().reshape(())
    if token.seq_weight is not None:  # TRL's vespo/phi_seq_mean: over the sequences with per-sequence advantages
        if per_sequence_adv:  # phi is the same on every row of a sequence (1 for a sequence without rows)
            phi = sequences.of_each(token.seq_weight, 1.0)
            given["vespo_phi_mean"] = phi.float().mean() if sequences.num_seqs else phi.float().sum()
        else:
            seq_weight = token.seq_weight.float()
            sums["vespo_phi_mean"] = (torch.where(scored, seq_weight, torch.zeros_like(seq_weight)).sum(),
                                      scored.float().sum())
    if outside is not None:
        sums["outside_support_frac"] = (outside.float().sum(), (scored | outside).float().sum())
    metrics = weights.metrics(token, scored, entropy, result.importance, sums, given, sequences)
    view = lambda t: _per_token(t, call.layout)  # noqa: E731
    return PolicyLossOutput(value, view(reported_logp), view(ref_logp), view(token.kl), view(entropy),
                            view(token.ratio), metrics)


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
    sequence_group=None,
    entropy_quantile_group=None,
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
        sequence_group: context parallel: a ``torch.distributed`` group whose ranks each hold a contiguous slice of
            every sequence, in rank order (``[B, T_r]``, uneven allowed, or ``[N_r]`` of the packed stream with the
            global ``cu_seqlens``), with every per-position input (labels, mask, advantages ``S``, old / rollout /
            reference log-probs) sliced alike and per-sequence ones (``[num_seqs]`` advantages) whole. Every rank
            gets the loss of the whole batch (the same value) and the metrics of the whole batch; the per-token
            outputs are this rank's positions'. The gradient w.r.t. this rank's logits (or hidden states) is that of
            the global loss: call ``backward()`` on every rank, and the parameter gradient of the global loss is the
            sum of the ranks' (all-reduce parameter gradients with SUM over the group; a data-parallel wrapper that
            averages over a group containing it: multiply the loss by the group's size). Every sequence-level
            quantity (sequence ratios, ``seq-mean-*`` and token-mean counts, sequence IS, the off-policy mask,
            VESPO's and geo_mean's weights, the default horizon) is one all-reduce over the group; the entropy
            mask's quantile is over every rank's tokens. Not with ``clip_cov`` / ``kl_cov`` (batch selections). A
            DTensor split on the sequence dimension (``Shard(1)`` of ``[B, T, V]``) is the same. See
            ``docs/api/context_parallel.md``.
        entropy_quantile_group: the ranks whose scored tokens ``token_mask_entropy_quantile``'s quantile is over
            (TRL's ``top_entropy_quantile`` on several processes: the data-parallel group); the rest of the loss
            stays this rank's. Default: the ``sequence_group`` (the batch), else this rank's tokens. The quantile
            gathers the scored entropies (two all-gathers, a host sync) and takes the two-pass route.

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
                 vocab_start=vocab_start, truncation=truncation, sequence_group=sequence_group)
    loss = _loss(call, loss_type, loss_parameters, dict(aggregation=aggregation, dual_clip=dual_clip,
                                                        log_ratio_clamp=log_ratio_clamp, horizon=horizon),
                 importance_sampling_level, (clip_low, clip_high),
                 (kl_coef, kl_estimator, kl_clamp, use_bias_correction_kl),
                 (entropy_coef, compute_entropy, token_mask_entropy_quantile))
    if call.sequence_group is not None and loss.formula in terms.BATCH:
        raise ValueError(f"loss_type={loss_type!r} selects tokens over the whole batch (its covariance), which a "
                         "sequence_group does not take: gather the sequences on every rank first")
    if entropy_quantile_group is not None:
        check_group(entropy_quantile_group, "entropy_quantile_group")
    quantile_group = call.sequence_group if entropy_quantile_group is None else entropy_quantile_group
    if quantile_group is not None:
        loss = loss._replace(quantile_group=quantile_group)
    _check_choice("entropy_aggregation", entropy_aggregation, constants.AGGREGATIONS)
    _check_choice("pg_aggregation", pg_aggregation, constants.AGGREGATIONS)
    aggregations = _Aggregations(loss.settings.aggregation, pg_aggregation, entropy_aggregation,
                                 loss.formula == "geo_mean")
    loss, sampling = _sampling(loss, old_logprobs, rollout_logprobs, is_mode, is_cap, is_min,
                               off_policy_mask_threshold)
    acc = accumulation_dtype(call.dtype)
    denominators = _denominators(call, loss, set(aggregations[:3]), cu_seqlens, batch_num_tokens, global_batch_size)
    if (sampling.rollout is None and sampling.off_policy is None and loss.quantile is None and loss.level == "token"
            and call.sequence_group is None and rollout_is_weights is None and pg_aggregation is None
            and entropy_aggregation is None and route.loss_route(call, loss.formula, False) == "fused"):
        return _one_pass(call, loss, sampling.old, advantages, denominators)
    sampling = sampling._replace(rollout=_per_position("rollout_logprobs", sampling.rollout, call, acc))
    sequences = _sequences(call, denominators)
    rows = _rows(call, loss, sampling, advantages, rollout_is_weights, acc)
    whole_sequences = (loss.level == "sequence" or (rows.old is None and sampling.rollout is not None)
                       or sampling.off_policy is not None or (loss.quantile is not None and loss.entropy_coef != 0.0)
                       or (loss.quantile is not None and loss.quantile_group is not None))
    if route.loss_route(call, loss.formula, whole_sequences) == "fused":
        result = _fused(call, loss, sampling, rows, aggregations, sequences, acc)
    else:
        result = _two_pass(call, loss, sampling, rows, sequences, acc)
    per_sequence_adv = tuple(local_rows(advantages, "advantages").shape) != tuple(call.layout.shape)
    return _output(call, loss, rows, result, aggregations, sequences, per_sequence_adv, acc)
