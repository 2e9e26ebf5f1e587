"""The policy-loss formulas in PyTorch (``[N]`` work), declared once: every policy loss of verl 0.9.1's
``core_algos`` registry and every TRL 1.16 ``GRPOConfig.loss_type``.

``LOSS_TYPES`` maps each accepted name to its ``LossType``: the formula it runs and where the name comes from.
``DEFAULTS``, next to it, is the one table of what a name alone sets: for each loss type, its default of each
``policy_loss`` keyword that depends on the loss type (the aggregation, the dual clip, the log-ratio clamp,
``dr_grpo``'s horizon, and the loss type's own parameters, ``PARAMETERS``: keyword arguments with the upstream
names, validated here), each with its source in verl's or TRL's code. ``settings`` resolves them for one call.
``docs/api/losses.md`` is the table for users.

Every path uses ``token_terms`` for the loss value and the metrics; the two-pass route differentiates it by
autograd. The formulas of ``FUSED`` have a derivative w.r.t. a row's log-prob that depends on that row alone;
it is written out three times: ``SLOPES`` here (the reference backend's), ``row_g_logp`` in
``csrc/loss_coefficients.h`` and ``_row_g_logp`` in ``kltriton/kernels/loss/triton.py``;
``tests/kernels/test_loss_coefficients.py`` holds the three against each other and against autograd through
``token_terms`` / ``objective``. The formulas that need whole sequences (``SEQUENCE``) or batch statistics
(``BATCH``) live here only: ``kltriton.route.loss_route`` sends them to the two-pass route.

``hyperparameters`` is the float64 vector of the ``loss`` family, slots ``constants.HYPERPARAMETERS``:
``ratio_low = 1 - clip_low``, ``ratio_high = 1 + clip_high``, ``dual_clip`` (``inf`` off), ``kl_clamp``
(``inf`` off), ``log_ratio_clamp`` (the ratio is ``exp(clamp(logp - old, -c, c))``; ``inf``: no clamp), the loss
types' parameters by name (``delta``: ``inf`` off), and ``kl_ratio`` (1: the KL term is multiplied by the
importance ratio, TRL's ``use_bias_correction_kl``).
"""
import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from kltriton import estimators
from kltriton._values import check_float, constant_vector, runtime_scalar
from kltriton.kernels import constants
from kltriton.kernels.loss.weights import Sequences
from kltriton import collectives

GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the log of the GSPO token ratio at 10
VESPO_LOG_W_MIN = math.log(1e-8)  # TRL clamps VESPO's token log-ratios to +-20, its sequence log-weight to
VESPO_LOG_W_MAX = 20.0            # [log 1e-8, 20]
SLOT = {name: i for i, name in enumerate(constants.HYPERPARAMETERS)}


# --- the loss types -----------------------------------------------------------------------------

class Parameter(NamedTuple):
    """A loss type's own keyword argument: ``check_float``'s range, the names it is also accepted under, and for
    a string parameter its choices (its default is the loss type's, in ``DEFAULTS``)."""
    check: Dict[str, float]
    aliases: Tuple[str, ...] = ()
    choices: Tuple[str, ...] = ()
    doc: str = ""


PARAMETERS = {
    "delta": Parameter({"above": 0.0}, doc="TRL's two-sided clip (INTELLECT-2): the unclipped ratio is capped at "
                       "delta"),
    "tau_pos": Parameter({"above": 0.0}, ("sapo_temperature_pos",), doc="SAPO gate temperature, advantage > 0"),
    "tau_neg": Parameter({"above": 0.0}, ("sapo_temperature_neg",), doc="SAPO gate temperature, advantage <= 0"),
    "clip_ratio_c": Parameter({"above": 0.0}, doc="DPPO: the ratio weight is truncated at clip_ratio_c"),
    "dro_beta": Parameter({"above": 0.0}, doc="DRO: weight of the quadratic log-ratio penalty"),
    "clip_cov_ratio": Parameter({"above": 0.0}, doc="Clip-Cov: fraction of tokens whose gradient is cut"),
    "clip_cov_lb": Parameter({}, doc="Clip-Cov: covariance lower bound of the candidates"),
    "clip_cov_ub": Parameter({}, doc="Clip-Cov: covariance upper bound of the candidates"),
    "kl_cov_ratio": Parameter({"above": 0.0}, doc="KL-Cov: fraction of tokens that get the |log ratio| penalty"),
    "ppo_kl_coef": Parameter({}, doc="KL-Cov: weight of that penalty"),
    "vespo_k_pos": Parameter({}, doc="VESPO: power of the gamma weight, advantage >= 0"),
    "vespo_lambda_pos": Parameter({}, doc="VESPO: decay of the gamma weight, advantage >= 0"),
    "vespo_k_neg": Parameter({}, doc="VESPO: power of the gamma weight, advantage < 0"),
    "vespo_lambda_neg": Parameter({}, doc="VESPO: decay of the gamma weight, advantage < 0"),
    "bypass_loss_type": Parameter({}, choices=("ppo_clip", "reinforce"), doc="bypass_mode: verl's "
                                  "rollout_correction.loss_type"),
}


class LossType(NamedTuple):
    formula: str                    # the formula it runs (a key of FORMULAS)
    source: str                     # where the name comes from
    sequence_level: bool = False    # accepts importance_sampling_level="sequence" (TRL)
    all_sequences: bool = False     # its seq-mean divides by every sequence (TRL's .mean()), not the non-empty ones


LOSS_TYPES = {
    "ppo": LossType("ppo", "kltriton: verl vanilla with TRL's delta", True),
    "vanilla": LossType("ppo", "verl", True),
    "grpo": LossType("ppo", "TRL", True, True),
    "bnpo": LossType("ppo", "TRL", True),
    "dapo": LossType("ppo", "TRL", True),
    "dr_grpo": LossType("ppo", "TRL", True, True),
    "luspo": LossType("ppo", "TRL", True, True),
    "cispo": LossType("cispo", "verl, TRL", True),
    "sapo": LossType("sapo", "verl, TRL", True),
    "gspo": LossType("gspo", "verl"),
    "gpg": LossType("gpg", "verl"),
    "dppo_tv": LossType("dppo_tv", "verl"),
    "dppo_kl": LossType("dppo_kl", "verl"),
    "dro": LossType("dro", "verl"),
    "clip_cov": LossType("clip_cov", "verl"),
    "kl_cov": LossType("kl_cov", "verl"),
    "geo_mean": LossType("geo_mean", "verl", all_sequences=True),
    "vespo": LossType("vespo", "TRL", True),
    "bypass_mode": LossType("bypass_mode", "verl"),
    "clipped_ratio": LossType("clipped_ratio", "torchrl CISPOLoss"),
}


class Default(NamedTuple):
    """A loss type's default of one ``policy_loss`` keyword, and where the trainer sets it."""
    value: object
    source: str


INF = math.inf
# Sources, in verl 0.9.1 and TRL 1.16 (file: field or function).
_ACTOR = "verl workers/config/actor.py ActorConfig"
_POLICY = "verl workers/config/actor.py PolicyLossConfig"
_ALGOS = "verl trainer/ppo/core_algos.py"
_GRPO_CONFIG = "TRL trainer/grpo_config.py GRPOConfig"
_TRL_LOSS = "TRL trainer/grpo_trainer.py GRPOTrainer._compute_loss"
_VERL_AGG = Default("token-mean", f"{_ACTOR}.loss_agg_mode")
_VERL_DUAL = Default(3.0, f"{_ACTOR}.clip_ratio_c")
_VERL_CLAMP = Default(20.0, f"{_ALGOS}: clamp(log_prob - old_log_prob, -20, 20)")
_TRL_CLAMP = Default(INF, f"{_TRL_LOSS}: exp(log_ratio), not clamped")
_REPORTED_CLAMP = Default(20.0, "kltriton: verl's clamp (the ratio is only reported)")
_NO_DELTA = Default(None, "kltriton: off (TRL's two-sided clip; verl has none)")
_DPPO_CAP = Default(3.0, f"{_ACTOR}.clip_ratio_c (core_algos' fallback of 20.0 applies only without that field)")
_TRL_ITEMS = Default("token-mean", f"{_TRL_LOSS}: / num_items_in_batch")
_TRL_PPO = dict(dual_clip=Default(INF, f"{_TRL_LOSS}: no dual clip"), log_ratio_clamp=_TRL_CLAMP,
                delta=Default(None, f"{_GRPO_CONFIG}.delta"))
# What a loss type's name alone sets: keyword -> Default. A loss type reads only the keywords of its row (a
# dual_clip or log_ratio_clamp given to another is an error). A name both trainers register (cispo, sapo) takes
# verl's defaults (TRL's GRPOConfig would cap CISPO's ratio at epsilon_high = epsilon = 0.2). The keywords every
# loss type shares have one default for all, the same in verl and TRL: clip_low = clip_high = 0.2 (verl
# ActorConfig.clip_ratio / _low / _high; TRL GRPOConfig.epsilon, epsilon_high None = epsilon), no KL, no entropy
# bonus, the token-level ratio (TRL GRPOConfig.importance_sampling_level).
DEFAULTS = {
    "ppo": dict(aggregation=Default("token-mean", "kltriton (verl's agg_loss default)"),
                dual_clip=Default(INF, "kltriton: a dual clip only when given"),
                log_ratio_clamp=Default(20.0, "kltriton: verl's clamp"), delta=_NO_DELTA),
    "vanilla": dict(aggregation=_VERL_AGG, dual_clip=_VERL_DUAL, log_ratio_clamp=_VERL_CLAMP, delta=_NO_DELTA),
    "grpo": dict(aggregation=Default("seq-mean-token-mean", f"{_TRL_LOSS}: the sequences' token means, .mean()"),
                 **_TRL_PPO),
    "bnpo": dict(aggregation=Default("token-mean", f"{_TRL_LOSS}: / mask.sum()"), **_TRL_PPO),
    "dapo": dict(aggregation=_TRL_ITEMS, **_TRL_PPO),
    "dr_grpo": dict(aggregation=Default("seq-mean-token-sum-norm", f"{_TRL_LOSS}: / (B * max_completion_length)"),
                    horizon=Default(512.0, f"{_GRPO_CONFIG}.max_completion_length"), **_TRL_PPO),
    "luspo": dict(aggregation=Default("seq-mean-token-sum", f"{_TRL_LOSS}: .sum(-1).mean()"), **_TRL_PPO),
    "cispo": dict(aggregation=_VERL_AGG, log_ratio_clamp=_VERL_CLAMP),
    "sapo": dict(aggregation=Default("seq-mean-token-mean", f"{_ALGOS} compute_policy_loss_sapo (fixed)"),
                 log_ratio_clamp=_VERL_CLAMP, tau_pos=Default(1.0, f"{_ACTOR}.tau_pos"),
                 tau_neg=Default(1.05, f"{_ACTOR}.tau_neg")),
    "gspo": dict(aggregation=_VERL_AGG),
    "gpg": dict(aggregation=_VERL_AGG, log_ratio_clamp=_REPORTED_CLAMP),
    "dppo_tv": dict(aggregation=_VERL_AGG, log_ratio_clamp=_VERL_CLAMP, clip_ratio_c=_DPPO_CAP),
    "dppo_kl": dict(aggregation=_VERL_AGG, log_ratio_clamp=_VERL_CLAMP, clip_ratio_c=_DPPO_CAP),
    "dro": dict(aggregation=_VERL_AGG, log_ratio_clamp=_REPORTED_CLAMP,
                dro_beta=Default(None, f"{_POLICY}.dro_beta (required)")),
    "clip_cov": dict(aggregation=_VERL_AGG, clip_cov_ratio=Default(0.0002, f"{_POLICY}.clip_cov_ratio"),
                     clip_cov_lb=Default(1.0, f"{_POLICY}.clip_cov_lb"),
                     clip_cov_ub=Default(5.0, f"{_POLICY}.clip_cov_ub")),
    "kl_cov": dict(aggregation=_VERL_AGG, kl_cov_ratio=Default(0.0002, f"{_POLICY}.kl_cov_ratio"),
                   ppo_kl_coef=Default(0.1, f"{_POLICY}.ppo_kl_coef")),
    "geo_mean": dict(aggregation=Default("seq-mean-token-mean", f"{_ALGOS} compute_policy_loss_geo_mean: "
                                                                "torch.mean over the sequences")),
    "vespo": dict(aggregation=_TRL_ITEMS, log_ratio_clamp=_TRL_CLAMP,
                  **{name: Default(value, f"{_GRPO_CONFIG}.{name}") for name, value in
                     (("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0),
                      ("vespo_lambda_neg", 2.0))}),
    "bypass_mode": dict(aggregation=_VERL_AGG, dual_clip=_VERL_DUAL, log_ratio_clamp=_VERL_CLAMP,
                        bypass_loss_type=Default("ppo_clip", "verl trainer/config/algorithm.py "
                                                             "RolloutCorrectionConfig.loss_type")),
    "clipped_ratio": dict(aggregation=Default("token-mean", "torchrl objectives/llm/grpo.py GRPOLoss aggregation="
                                                            "'token_mean'"),
                          log_ratio_clamp=Default(INF, "torchrl objectives/llm/grpo.py: log_weight not clamped")),
}
assert set(DEFAULTS) == set(LOSS_TYPES)
# Formulas whose derivative w.r.t. a row's log-prob depends on that row alone: the fused kernels ("kl_only" is no
# loss type: the KL term's loss alone, token_divergence's).
FUSED = ("kl_only", "ppo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl", "dro", "clipped_ratio")
# Formulas that need whole sequences (a sequence ratio or weight) or the whole batch (a covariance selection)
# before any row's derivative: the two-pass route.
SEQUENCE = ("gspo", "geo_mean", "vespo")
BATCH = ("clip_cov", "kl_cov")


def loss_type_of(name) -> LossType:
    """The ``LossType`` of ``name``, or a ``ValueError`` listing the accepted names."""
    spec = LOSS_TYPES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got {name!r}")
    return spec


def own_parameters(loss_type: str) -> Tuple[str, ...]:
    """The loss type's own keyword arguments (``PARAMETERS``): those its row of ``DEFAULTS`` sets."""
    return tuple(name for name in DEFAULTS[loss_type] if name in PARAMETERS)


class Settings(NamedTuple):
    """A ``policy_loss`` call's loss-type-dependent keywords: the given ones, the loss type's defaults for the
    others (``DEFAULTS``)."""
    aggregation: str
    dual_clip: Optional[float]   # None: the formula has none; inf: off
    log_ratio_clamp: float       # inf: no clamp
    horizon: Optional[float]     # None: the padded length
    parameters: dict             # the loss type's own parameters: canonical name -> python float, str or None


def _limit(name, value, above):
    """A clip limit: a python float ``> above``, or ``math.inf`` (off)."""
    if isinstance(value, float) and not torch.compiler.is_compiling() and value == INF:
        return value
    return check_float(name, value, above=above)


def settings(loss_type: str, given: dict, *, aggregation=None, dual_clip=None, log_ratio_clamp=None,
             horizon=None) -> Settings:
    """The loss type's ``Settings``: each keyword given (not None) wins, the others take the loss type's default.
    ``given``: its own parameters as keyword arguments (canonical names or aliases). A keyword the loss type does not
    take is a ``TypeError`` (own parameters) or ``ValueError`` naming it; a value out of range a ``ValueError``."""
    loss_type_of(loss_type)
    defaults = DEFAULTS[loss_type]
    for name, value in (("dual_clip", dual_clip), ("log_ratio_clamp", log_ratio_clamp)):
        if value is not None and name not in defaults:
            takes = tuple(key for key, row in DEFAULTS.items() if name in row)
            raise ValueError(f"{name} applies to the loss types {takes}, not loss_type={loss_type!r}")
    default = {name: entry.value for name, entry in defaults.items()}
    dual_clip = default.get("dual_clip") if dual_clip is None else dual_clip
    log_ratio_clamp = default.get("log_ratio_clamp", INF) if log_ratio_clamp is None else log_ratio_clamp
    return Settings(default["aggregation"] if aggregation is None else aggregation,
                    None if dual_clip is None else _limit("dual_clip", dual_clip, 1.0),
                    _limit("log_ratio_clamp", log_ratio_clamp, 0.0),
                    default.get("horizon") if horizon is None else horizon,
                    _parameters(loss_type, given, default))


def _parameters(loss_type: str, given: dict, default: dict) -> dict:
    """``loss_type``'s own parameters (canonical name -> python float, str or None) from the keyword arguments
    ``given``, ``default`` filled in."""
    names = own_parameters(loss_type)
    by_alias = {alias: name for name in names for alias in (name, *PARAMETERS[name].aliases)}
    values = {}
    for key, value in given.items():
        name = by_alias.get(key)
        if name is None:
            takes = ", ".join(f"{n} (also {', '.join(PARAMETERS[n].aliases)})" if PARAMETERS[n].aliases else n
                              for n in names) or "no parameters of its own"
            raise TypeError(f"policy_loss() got an unexpected keyword argument {key!r}: loss_type={loss_type!r} "
                            f"takes {takes}")
        if name in values:
            raise TypeError(f"policy_loss() got {name!r} twice (under two of its names)")
        values[name] = value
    out = {}
    for name in names:
        param = PARAMETERS[name]
        value = values.get(name, default[name])
        if param.choices:
            if value not in param.choices:
                raise ValueError(f"{name} must be one of {param.choices}, got {value!r}")
            out[name] = value
        elif value is None and default[name] is None and name in values:
            out[name] = None  # an explicit None of an optional parameter: off
        elif value is None and name == "dro_beta":
            raise ValueError("loss_type='dro' needs dro_beta > 0 (verl's policy_loss.dro_beta)")
        else:
            out[name] = check_float(name, value, allow_none=True, **param.check)
    return out


_OFF = {name: 0.0 if name == "kl_ratio" else INF for name in constants.HYPERPARAMETERS}  # a slot's value when off


def hyperparameters(device, **values) -> torch.Tensor:
    """The float64 hyperparameter vector from ``values`` by slot name (each a python float, a 0-dim float64 tensor,
    or None); a slot not given (or None) is ``inf`` (off), except ``kl_ratio`` (0: off). In eager calls with python
    floats the vector of each set of values is made once per device and kept (``_inputs.runtime_scalar``'s cache):
    on a GPU every small tensor made per call is a kernel launch."""
    unknown = values.keys() - _OFF.keys()
    if unknown:
        raise KeyError(f"unknown hyperparameters {sorted(unknown)}; slots: {constants.HYPERPARAMETERS}")
    slots = [values.get(name) for name in _OFF]
    slots = [off if value is None else value for value, off in zip(slots, _OFF.values())]
    if not torch.compiler.is_compiling() and not any(isinstance(v, torch.Tensor) for v in slots):
        return constant_vector(slots, device)
    return torch.stack([v.to(device=device, dtype=torch.float64) if isinstance(v, torch.Tensor)
                        else runtime_scalar(v, device) for v in slots])


# --- per-token terms ----------------------------------------------------------------------------

class TokenTerms(NamedTuple):
    pg: torch.Tensor             # [N] policy-gradient loss per token (before weights)
    ratio: torch.Tensor          # [N] importance ratio (per sequence for sequence-level losses, broadcast)
    kl: torch.Tensor             # [N] KL term (the estimator's value, times the ratio with kl_ratio; 0 without)
    clipped: torch.Tensor        # [N] bool: verl's pg_clipfrac flag of the loss type
    clipped_lower: torch.Tensor  # [N] bool: verl's pg_clipfrac_lower flag
    log_ratio: torch.Tensor      # [N] what verl's ppo_kl averages the negative of
    seq_weight: Optional[torch.Tensor] = None  # [N] VESPO's gamma weight phi (per sequence, broadcast; every row)


class Batch(NamedTuple):
    """A formula's ``[N]`` inputs."""
    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    hyperparameters: torch.Tensor             # in logp's dtype
    scored: torch.Tensor         # bool
    sequences: Sequences         # the rows' sequences (and the sequence group): every per-sequence sum
    log_is: Optional[torch.Tensor]  # VESPO: log of the rollout IS weights per token (None: none)

    def param(self, name):
        return self.hyperparameters[SLOT[name]]

    @property
    def seq_index(self):
        return self.sequences.seq_index

    def seq_sums(self, *values):
        """``[num_seqs]`` each: the sums of ``values`` over each sequence's scored rows (every rank's under a
        sequence group: one all-reduce for all of them)."""
        stacked = torch.stack([torch.where(self.scored, v, torch.zeros_like(v)) for v in values])
        return self.sequences.sum(stacked).unbind()

    def seq_means(self, *values):
        """``[num_seqs]`` each: the means of ``values`` over each sequence's scored rows (0 without any)."""
        *sums, count = self.seq_sums(*values, torch.ones_like(self.logp))
        return [total / count.clamp(min=1) for total in sums]


def kl_term(estimator: Optional[estimators.Estimator], logp, ref_logp, full_kl, kl_clamp):
    """The estimator's value clamped to ``[-kl_clamp, kl_clamp]`` (a 0-dim tensor, ``inf``: off); 0 without an
    estimator."""
    if estimator is None:
        return torch.zeros_like(logp)
    return estimator.value(logp, ref_logp, full_kl, kl_clamp)


def _clamp_log_ratio(log_ratio, clamp):
    """``log_ratio`` clamped to ``[-clamp, clamp]`` (``clamp`` a 0-dim tensor, ``inf``: unchanged)."""
    return torch.clamp(log_ratio, -clamp, clamp)


def _token_ratio(b: Batch):
    """The ratio ``exp(clamp(logp - old, -c, c))`` (verl: ``c = 20``; TRL, torchrl: none) and that clamped
    log-ratio."""
    log_ratio = _clamp_log_ratio(b.logp - b.old, b.param("log_ratio_clamp"))
    return torch.exp(log_ratio), log_ratio


def _sequence_ratio(b: Batch):
    """TRL's ``importance_sampling_level="sequence"``: ``exp`` of the mean log-ratio of the sequence's scored
    tokens (clamped like the token ratio), differentiable through every one of them, broadcast."""
    mean, = b.seq_means(b.logp - b.old)
    return torch.exp(_clamp_log_ratio(mean, b.param("log_ratio_clamp")))[b.seq_index]


def _no(b: Batch):
    return torch.zeros_like(b.scored)


def ppo(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_vanilla`` (dual clip ``dual_clip`` for negative advantages) and TRL's GRPO
    family (``delta`` caps the unclipped ratio: ``-min(min(r, delta) A, clip(r) A)``)."""
    low, high, dual, delta = (b.param(name) for name in ("ratio_low", "ratio_high", "dual_clip", "delta"))
    adv = b.adv
    pg1 = -adv * torch.minimum(ratio, delta)
    pg2 = -adv * torch.clamp(ratio, low, high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * dual
    negative = adv < 0
    pg = torch.where(negative, torch.minimum(clip1, pg3), clip1)
    return pg, ratio, pg2 > pg1, (clip1 > pg3) & negative, log_ratio


def cispo(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_cispo``: ``-sg(clip(ratio)) * A * logp`` (TRL's CISPO is this with
    ``clip_low = 1``, ``clip_high = epsilon_high - 1``)."""
    clipped = torch.clamp(ratio, b.param("ratio_low"), b.param("ratio_high"))
    pg = -clipped.detach() * b.adv * b.logp
    return pg, ratio, ratio != clipped, _no(b), log_ratio


def clipped_ratio(b: Batch, ratio, log_ratio):
    """torchrl ``CISPOLoss``: ``-clip(r, 1 - clip_low, 1 + clip_high) * A``, differentiable through the ratio
    inside the range (verl's and TRL's ``cispo`` detach the clipped ratio and multiply by ``logp`` instead)."""
    clipped = torch.clamp(ratio, b.param("ratio_low"), b.param("ratio_high"))
    return -clipped * b.adv, ratio, ratio != clipped, _no(b), log_ratio


def sapo(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_sapo`` / TRL ``sapo``: the soft gate ``sigmoid(tau (r - 1)) * 4 / tau`` with
    ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``: ``-gate * A``."""
    tau = torch.where(b.adv > 0, b.param("tau_pos"), b.param("tau_neg"))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return -gate * b.adv, ratio, _no(b), _no(b), log_ratio


def gpg(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_gpg``: ``-logp * A``."""
    return -b.logp * b.adv, ratio, _no(b), _no(b), log_ratio


def _dppo_valid(b: Batch, binary_kl: bool):
    """DPPO's trust region per token (detached): the TV (``p - p_old``) or binary-KL divergence within
    ``clip_high`` (``A > 0``) / ``clip_low`` (``A <= 0``)."""
    clip_low, clip_high = 1 - b.param("ratio_low"), b.param("ratio_high") - 1
    p, p_old = torch.exp(b.logp.detach()), torch.exp(b.old)
    if binary_kl:
        div = p_old * (b.old - b.logp.detach()) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        positive, negative = (div <= clip_high) | (p <= p_old), (div <= clip_low) | (p >= p_old)
    else:
        positive, negative = (p - p_old) <= clip_high, (p - p_old) >= -clip_low
    return torch.where(b.adv > 0, positive, negative)


def _dppo(binary_kl: bool):
    def dppo(b: Batch, ratio, log_ratio):
        """verl ``compute_policy_loss_dppo_tv`` / ``_dppo_kl``: ``-A * sg(min(r, clip_ratio_c)) * logp`` inside
        the divergence trust region, 0 outside (``clip_low`` / ``clip_high`` are the divergence bounds)."""
        cap = b.param("clip_ratio_c")
        valid = _dppo_valid(b, binary_kl)
        pg = -b.adv * torch.clamp(ratio, max=cap).detach() * b.logp * valid.to(b.logp.dtype)
        return pg, ratio, ~valid, (ratio > cap) & valid, log_ratio
    return dppo


def dro(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_dro``: ``-(logp * A - dro_beta / 2 * (logp - old)**2)``."""
    d = b.logp - b.old
    pg = -(b.logp * b.adv - 0.5 * b.param("dro_beta") * d.square())
    return pg, ratio, _no(b), _no(b), d


def gspo(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_gspo``: the token ratio ``sg(s_i) * p / sg(p)`` with ``s_i`` the geometric
    mean ratio of the sequence's scored tokens."""
    d = torch.where(b.scored, b.logp - b.old, torch.zeros_like(b.logp))
    seq_log_ratio, = b.seq_means(d.detach())
    token_log_ratio = b.logp - b.logp.detach() + seq_log_ratio.detach()[b.seq_index]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    pg1 = -b.adv * ratio
    pg2 = -b.adv * torch.clamp(ratio, b.param("ratio_low"), b.param("ratio_high"))
    return torch.maximum(pg1, pg2), ratio, pg2 > pg1, _no(b), d


def _masked_mean(values, scored):
    return torch.where(scored, values, torch.zeros_like(values)).sum() / scored.sum().clamp(min=1)


def clip_cov(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_clip_cov``: PPO's clipped surrogate (no log-ratio clamp, no dual clip) whose
    gradient is cut on ``max(int(clip_cov_ratio * tokens), 1)`` tokens drawn at random (``torch.randperm``, as
    verl) among the unclipped ones with ``clip_cov_lb < cov < clip_cov_ub``, ``cov = (A - mean A) (logp - mean
    logp)``. Reads the token count on the host, as verl does."""
    d = b.logp - b.old
    ratio = torch.exp(d)
    pg1 = -b.adv * ratio
    pg2 = -b.adv * torch.clamp(ratio, b.param("ratio_low"), b.param("ratio_high"))
    clip_by_origin = (pg2 > pg1) & b.scored
    cov = (b.adv - _masked_mean(b.adv, b.scored)) * (b.logp.detach() - _masked_mean(b.logp.detach(), b.scored))
    candidates = b.scored & ~clip_by_origin & (cov < b.param("clip_cov_ub")) & (cov > b.param("clip_cov_lb"))
    picked = torch.nonzero(candidates).squeeze(-1)
    clip_num = max(int(b.param("clip_cov_ratio").item() * int(b.scored.sum().item())), 1)
    if picked.numel():
        picked = picked[torch.randperm(picked.numel())[:min(clip_num, picked.numel())].to(picked.device)]
    cut = torch.zeros_like(b.scored).index_fill(0, picked, True)
    pg = torch.maximum(pg1, pg2) * (~cut).to(b.logp.dtype)
    return pg, ratio, cut, _no(b), d


def kl_cov(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_kl_cov``: ``-A * r`` (no clip), plus ``ppo_kl_coef * |logp - old|`` on the
    ``max(1, int(tokens * kl_cov_ratio))`` scored tokens of largest ``cov = (A - mean A) (logp - mean logp)``
    (``torch.topk``). Reads the token count on the host, as verl does."""
    d = b.logp - b.old
    ratio = torch.exp(d)
    pg = -b.adv * ratio
    index = torch.nonzero(b.scored).squeeze(-1)
    if index.numel():
        adv, logp = b.adv[index], b.logp.detach()[index]
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = max(1, int(index.numel() * b.param("kl_cov_ratio").item()))
        picked = index[torch.topk(cov, k, largest=True).indices]
        penalized = torch.zeros_like(b.scored).index_fill(0, picked, True)
        pg = torch.where(penalized, pg + b.param("ppo_kl_coef") * d.abs(), pg)
    return pg, ratio, _no(b), _no(b), -d.abs()


def geo_mean(b: Batch, ratio, log_ratio):
    """verl ``compute_policy_loss_geo_mean`` (GMPO): per sequence ``-mean(A) * exp(mean(sign(A) min(sign(A) d,
    sign(A) clip(d, -clip_low, clip_high))))`` with ``d = logp - old``, broadcast over the sequence's tokens
    (verl averages it over the sequences: aggregate with ``seq-mean-token-mean``)."""
    d = b.logp - b.old
    clipped = torch.clamp(d, b.param("ratio_low") - 1, b.param("ratio_high") - 1)  # [-clip_low, clip_high]
    sign = torch.sign(b.adv)
    d_min = sign * torch.minimum(sign * d, sign * clipped)
    mean_d_min, mean_adv = b.seq_means(d_min, b.adv)
    ratio = torch.exp(mean_d_min)[b.seq_index]
    adv = mean_adv[b.seq_index]
    moved = d != clipped
    return -adv * ratio, ratio, moved & (b.adv > 0), moved & (b.adv < 0), d


def vespo(b: Batch, ratio, log_ratio):
    """TRL ``vespo``: ``-sg(phi) * A * logp`` with the gamma weight ``phi = exp(lambda + k log w - lambda w)`` of
    the sequence weight ``w = exp(sum clamp(logp - old, +-20) + sum log IS)`` (``log w`` clamped to
    ``[log 1e-8, 20]``), ``k, lambda`` by the advantage's sign (``>= 0``: ``_pos``)."""
    with torch.no_grad():
        parts = [torch.clamp(b.logp - b.old, -VESPO_LOG_W_MAX, VESPO_LOG_W_MAX)]
        if b.log_is is not None:
            parts.append(torch.clamp(b.log_is, VESPO_LOG_W_MIN, VESPO_LOG_W_MAX))
        sums = b.seq_sums(*parts)
        log_w = sums[0] if len(sums) == 1 else sums[0] + sums[1]
        log_w = torch.clamp(log_w, VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)[b.seq_index]
        nonneg = b.adv >= 0
        k = torch.where(nonneg, b.param("vespo_k_pos"), b.param("vespo_k_neg"))
        lam = torch.where(nonneg, b.param("vespo_lambda_pos"), b.param("vespo_lambda_neg")).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * b.adv * b.logp, ratio, _no(b), _no(b), log_ratio, phi


def kl_only(b: Batch, ratio, log_ratio):
    """No policy-gradient term: a loss of the KL term alone (``token_divergence``'s reverse KL on the fused kernel)."""
    return torch.zeros_like(b.logp), ratio, _no(b), _no(b), log_ratio


FORMULAS = {"kl_only": kl_only, "ppo": ppo, "cispo": cispo, "sapo": sapo, "gpg": gpg, "dppo_tv": _dppo(False), "dppo_kl": _dppo(True),
            "dro": dro, "clipped_ratio": clipped_ratio, "gspo": gspo, "clip_cov": clip_cov, "kl_cov": kl_cov,
            "geo_mean": geo_mean, "vespo": vespo}
assert set(FORMULAS) == set(FUSED + SEQUENCE + BATCH)


def token_terms(loss_type, estimator, logp, ref_logp, full_kl, old, adv, hyperparameters, scored, seq_index=None,
                num_seqs=1, *, level: str = "token", log_is=None, sequence_group=None) -> TokenTerms:
    """Per-token terms on ``[N]`` tensors; ``old`` None means on-policy (``old = logp.detach()``). ``loss_type``:
    a name of ``LOSS_TYPES`` or a formula (``bypass_mode`` is resolved by ``policy_loss`` first). ``level``:
    ``"sequence"`` replaces the token ratio by the sequence's (TRL). ``log_is``: VESPO's log IS weights.
    ``sequence_group``: the ranks that hold the other slices of these sequences (``policy_loss``'s): every
    per-sequence sum is over them (``weights.Sequences``), one all-reduce each."""
    formula = FORMULAS[LOSS_TYPES[loss_type].formula if loss_type in LOSS_TYPES else loss_type]
    hyperparameters = hyperparameters.to(logp.dtype)
    old = logp.detach() if old is None else old
    if seq_index is None:
        seq_index = torch.zeros_like(scored, dtype=torch.long)
    b = Batch(logp, old, adv, hyperparameters, scored, Sequences(seq_index, num_seqs, group=sequence_group), log_is)
    ratio, log_ratio = _token_ratio(b)
    if level == "sequence":
        ratio = _sequence_ratio(b)
    pg, ratio, clipped, lower, log_ratio, *weight = formula(b, ratio, log_ratio)
    kl = kl_term(estimator, logp, ref_logp, full_kl, hyperparameters[SLOT["kl_clamp"]])
    kl = kl * torch.where(hyperparameters[SLOT["kl_ratio"]] != 0, ratio, torch.ones_like(ratio))  # TRL's bias-corrected KL
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return TokenTerms(torch.where(scored, pg, zero), torch.where(scored, ratio, zero), torch.where(scored, kl, zero),
                      clipped & scored, lower & scored, torch.where(scored, log_ratio, zero),
                      weight[0] if weight else None)


def objective(terms: TokenTerms, entropy, w_pg, w_kl, w_ent):
    """``[N]``: ``w_pg * pg + w_kl * kl + w_ent * entropy``; the loss is its sum."""
    return w_pg * terms.pg + w_kl * terms.kl + w_ent * entropy


def entropy_keep(entropy, scored, quantile, group=None):
    """``(keep, threshold)``: ``keep`` ``[N]`` bool, the scored rows whose entropy is at least ``threshold``, the
    ``quantile`` of the scored rows' entropies (0-dim fp32; TRL's ``get_high_entropy_mask``: ``torch.quantile``'s
    linear interpolation, ``>=``), with no host sync. ``quantile`` a python float in ``[0, 1]``; no row is kept
    when none is scored. ``group``: the quantile of the scored rows of every rank of the group (TRL gathers every
    process's; a sequence group's ranks hold the batch): their entropies are gathered (``collectives.gather_padded``:
    two all-gathers, the lengths read on the host)."""
    values = torch.where(scored, entropy.float(), torch.full_like(entropy, float("inf"), dtype=torch.float32))
    if group is not None:

        values = collectives.gather_padded(values, float("inf"), group)
    ordered = torch.sort(values).values
    count = (values != float("inf")).sum() if group is not None else scored.sum()
    rank = (count - 1).clamp(min=0).to(torch.float32) * quantile
    below = rank.floor().long()
    above = rank.ceil().long()
    low, high = ordered.gather(0, below.reshape(1)), ordered.gather(0, above.reshape(1))
    threshold = torch.lerp(low, high, (rank - below.to(torch.float32)).reshape(1))
    return scored & (entropy.float() >= threshold), threshold.reshape(())


# --- the derivative per row of the FUSED formulas -----------------------------------------------

def _ratio_slope(logp, old, hyperparameters):
    """``(d, r, dr)``: ``d = logp - old``, the ratio ``r = exp(clamp(d, -c, c))`` (``c`` the ``log_ratio_clamp``
    slot) and ``d r / d logp`` (0 beyond the clamp)."""
    d = logp - old
    clamp = hyperparameters[SLOT["log_ratio_clamp"]]
    ratio = torch.exp(_clamp_log_ratio(d, clamp))
    return d, ratio, torch.where(d.abs() <= clamp, ratio, torch.zeros_like(ratio))


def _chain(g, d_ratio):
    """``g * d_ratio``; a zero ``g`` stays 0 where an unclamped ratio overflows to ``+inf`` (C++ ``Ratio::chain``)."""
    return torch.where(g == 0, torch.zeros_like(g), g * d_ratio)


def _ppo_slope(logp, old, adv, hyperparameters):
    """``d pg / d logp`` of ``ppo`` per row. At an exact tie of the max / min the unclipped branch takes the whole
    gradient (autograd would split it; equal where both branches have the same slope)."""
    low, high, dual, delta = (hyperparameters[SLOT[name]] for name in ("ratio_low", "ratio_high", "dual_clip", "delta"))
    _, ratio, d_ratio = _ratio_slope(logp, old, hyperparameters)
    pg1, pg2 = -adv * torch.minimum(ratio, delta), -adv * torch.clamp(ratio, low, high)
    zero = torch.zeros_like(logp)
    unclipped = torch.where(ratio <= delta, -adv, zero)
    in_range = torch.where((ratio >= low) & (ratio <= high), -adv, zero)
    g_ratio = torch.where(pg1 >= pg2, unclipped, in_range)
    g_ratio = torch.where((adv < 0) & (torch.maximum(pg1, pg2) > -adv * dual), zero, g_ratio)  # the dual clip holds
    return _chain(g_ratio, d_ratio)


def _cispo_slope(logp, old, adv, hyperparameters):
    """``d pg / d logp`` of ``cispo``: ``-sg(clip(ratio)) * A``."""
    _, ratio, _ = _ratio_slope(logp, old, hyperparameters)
    return -torch.clamp(ratio, hyperparameters[SLOT["ratio_low"]], hyperparameters[SLOT["ratio_high"]]) * adv


def _clipped_ratio_slope(logp, old, adv, hyperparameters):
    """``d pg / d logp`` of ``clipped_ratio``: ``-A * r`` inside the clip range, 0 outside."""
    _, ratio, d_ratio = _ratio_slope(logp, old, hyperparameters)
    inside = (ratio >= hyperparameters[SLOT["ratio_low"]]) & (ratio <= hyperparameters[SLOT["ratio_high"]])
    return torch.where(inside, _chain(-adv, d_ratio), torch.zeros_like(ratio))


def _sapo_slope(logp, old, adv, hyperparameters):
    """``d pg / d logp`` of ``sapo``: ``-A * 4 sigmoid'(tau (r - 1)) * r``."""
    _, ratio, d_ratio = _ratio_slope(logp, old, hyperparameters)
    tau = torch.where(adv > 0, hyperparameters[SLOT["tau_pos"]], hyperparameters[SLOT["tau_neg"]])
    s = torch.sigmoid(tau * (ratio - 1))
    return _chain(-adv * 4 * s * (1 - s), d_ratio)


def _gpg_slope(logp, old, adv, hyperparameters):
    return -adv


def _dppo_slope(binary_kl: bool):
    def slope(logp, old, adv, hyperparameters):
        _, ratio, _ = _ratio_slope(logp, old, hyperparameters)
        b = Batch(logp, old, adv, hyperparameters, torch.ones_like(logp, dtype=torch.bool), Sequences(None, 1), None)
        valid = _dppo_valid(b, binary_kl).to(logp.dtype)
        return -adv * torch.clamp(ratio, max=hyperparameters[SLOT["clip_ratio_c"]]) * valid
    return slope


def _dro_slope(logp, old, adv, hyperparameters):
    return -adv + hyperparameters[SLOT["dro_beta"]] * (logp - old)


# d pg / d logp per row of the formulas in FUSED, written out (the C++ and Triton kernels compute the same).
SLOPES = {"kl_only": lambda logp, old, adv, hyperparameters: torch.zeros_like(logp), "ppo": _ppo_slope, "cispo": _cispo_slope, "sapo": _sapo_slope, "gpg": _gpg_slope,
          "dppo_tv": _dppo_slope(False), "dppo_kl": _dppo_slope(True), "dro": _dro_slope,
          "clipped_ratio": _clipped_ratio_slope}
assert set(SLOPES) == set(FUSED)


def coefficients(loss_type, estimator: Optional[estimators.Estimator], logp, ref_logp, inputs, hyperparameters, full_kl=None):
    """``(d loss / d logp, d loss / d full_kl)`` per row (``[N]``) for a formula of ``FUSED``; ``d loss / d
    entropy`` is ``inputs.w_ent``. With ``kl_ratio`` the KL term is ``kl * r``: its slope is ``kl' r + kl dr``.
    ``tests/kernels/test_loss_coefficients.py`` holds it against autograd through ``objective`` and against the
    C++ and Triton kernels."""
    hyperparameters = hyperparameters.to(logp.dtype)
    old = logp if inputs.old_logp is None else inputs.old_logp
    g_logp = inputs.w_pg * SLOPES[loss_type](logp, old, inputs.advantages, hyperparameters)
    if estimator is None:
        return g_logp, None
    _, ratio, d_ratio = _ratio_slope(logp, old, hyperparameters)
    corrected = hyperparameters[SLOT["kl_ratio"]] != 0
    kl_weight = torch.where(corrected, ratio, torch.ones_like(ratio))
    kl_clamp = hyperparameters[SLOT["kl_clamp"]]
    if estimator.needs_ref_logits:  # the full KL's own gradient goes through its statistic; 0 where clamped
        if full_kl is None:
            return g_logp, inputs.w_kl * kl_weight
        value = torch.clamp(full_kl, -kl_clamp, kl_clamp)
        g_logp = g_logp + torch.where(corrected, inputs.w_kl * value * d_ratio, torch.zeros_like(g_logp))
        return g_logp, torch.where(full_kl.abs() > kl_clamp, torch.zeros_like(g_logp), inputs.w_kl * kl_weight)
    slope = estimator.slope(logp - ref_logp, kl_clamp) * kl_weight
    value = kl_term(estimator, logp, ref_logp, None, kl_clamp).detach()
    slope = slope + torch.where(corrected, value * d_ratio, torch.zeros_like(slope))
    return g_logp + inputs.w_kl * slope, None
