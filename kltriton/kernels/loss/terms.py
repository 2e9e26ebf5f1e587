"""The policy-loss formulas in PyTorch (``[N]`` work), declared once: every policy loss of verl 0.9.1's
``core_algos`` registry and every TRL 1.16 ``GRPOConfig.loss_type``.

``LOSS_TYPES`` maps each accepted name to its ``LossType``: the formula it runs, where the name comes from,
its default aggregation and its own parameters (``PARAMETERS``: keyword arguments of ``policy_loss`` with the
upstream names, validated here). ``docs/api/losses.md`` is the table for users.

Every path uses ``token_terms`` for the loss value and the metrics; the two-pass route differentiates it by
autograd. The formulas of ``FUSED`` have a derivative w.r.t. a row's log-prob that depends on that row alone;
it is written out three times: ``SLOPES`` here (the reference backend's), ``row_g_logp`` in
``csrc/loss_coefficients.h`` and ``_row_g_logp`` in ``kltriton/kernels/loss/triton.py``;
``tests/kernels/test_loss_coefficients.py`` holds the three against each other and against autograd through
``token_terms`` / ``objective``. The formulas that need whole sequences (``SEQUENCE``) or batch statistics
(``BATCH``) live here only: ``kltriton.route.loss_route`` sends them to the two-pass route.

``hyperparameters`` is the float64 vector of the ``loss`` family, slots ``constants.HYPERPARAMETERS``:
``ratio_low = 1 - clip_low``, ``ratio_high = 1 + clip_high``, ``dual_clip`` (``inf`` off), ``kl_clamp``
(``inf`` off), the loss types' parameters by name (``delta``: ``inf`` off), and ``kl_ratio`` (1: the KL term
is multiplied by the importance ratio, TRL's ``use_bias_correction_kl``).
"""
import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from kltriton import estimators
from kltriton._inputs import check_float
from kltriton.kernels import constants

LOG_RATIO_CLAMP = constants.LOG_RATIO_CLAMP
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the log of the GSPO token ratio at 10
VESPO_LOG_W_MIN = math.log(1e-8)  # TRL clamps VESPO's sequence log-weight to [log 1e-8, 20]
SLOT = {name: i for i, name in enumerate(constants.HYPERPARAMETERS)}


# --- the loss types -----------------------------------------------------------------------------

class Parameter(NamedTuple):
    """A loss type's own keyword argument: its default (``None``: required), ``check_float``'s range, the
    names it is also accepted under, and for a string parameter its choices."""
    default: object
    check: Dict[str, float]
    aliases: Tuple[str, ...] = ()
    choices: Tuple[str, ...] = ()
    doc: str = ""


PARAMETERS = {
    "delta": Parameter(None, {"above": 0.0}, doc="TRL's two-sided clip (INTELLECT-2): the unclipped ratio is capped "
                       "at delta"),
    "tau_pos": Parameter(1.0, {"above": 0.0}, ("sapo_temperature_pos",), doc="SAPO gate temperature, advantage > 0"),
    "tau_neg": Parameter(1.05, {"above": 0.0}, ("sapo_temperature_neg",), doc="SAPO gate temperature, advantage <= 0"),
    "clip_ratio_c": Parameter(20.0, {"above": 0.0}, doc="DPPO: the ratio weight is truncated at clip_ratio_c"),
    "dro_beta": Parameter(None, {"above": 0.0}, doc="DRO: weight of the quadratic log-ratio penalty"),
    "clip_cov_ratio": Parameter(0.0002, {"above": 0.0}, doc="Clip-Cov: fraction of tokens whose gradient is cut"),
    "clip_cov_lb": Parameter(1.0, {}, doc="Clip-Cov: covariance lower bound of the candidates"),
    "clip_cov_ub": Parameter(5.0, {}, doc="Clip-Cov: covariance upper bound of the candidates"),
    "kl_cov_ratio": Parameter(0.0002, {"above": 0.0}, doc="KL-Cov: fraction of tokens that get the |log ratio| "
                              "penalty"),
    "ppo_kl_coef": Parameter(0.1, {}, doc="KL-Cov: weight of that penalty"),
    "vespo_k_pos": Parameter(2.0, {}, doc="VESPO: power of the gamma weight, advantage >= 0"),
    "vespo_lambda_pos": Parameter(3.0, {}, doc="VESPO: decay of the gamma weight, advantage >= 0"),
    "vespo_k_neg": Parameter(3.0, {}, doc="VESPO: power of the gamma weight, advantage < 0"),
    "vespo_lambda_neg": Parameter(2.0, {}, doc="VESPO: decay of the gamma weight, advantage < 0"),
    "bypass_loss_type": Parameter("ppo_clip", {}, choices=("ppo_clip", "reinforce"),
                                  doc="bypass_mode: verl's rollout_correction.loss_type"),
}


class LossType(NamedTuple):
    formula: str                    # the formula it runs (a key of FORMULAS)
    source: str                     # where the name comes from
    aggregation: str                # its default aggregation (verl agg_loss mode)
    parameters: Tuple[str, ...]     # its own keyword arguments (PARAMETERS)
    sequence_level: bool = False    # accepts importance_sampling_level="sequence" (TRL)
    all_sequences: bool = False     # its seq-mean divides by every sequence (TRL's .mean()), not the non-empty ones


_PPO = ("delta",)
LOSS_TYPES = {
    "ppo": LossType("ppo", "kltriton: verl vanilla with TRL's delta", "token-mean", _PPO, True),
    "vanilla": LossType("ppo", "verl", "token-mean", _PPO, True),
    "grpo": LossType("ppo", "TRL", "seq-mean-token-mean", _PPO, True, True),
    "bnpo": LossType("ppo", "TRL", "token-mean", _PPO, True),
    "dapo": LossType("ppo", "TRL", "token-mean", _PPO, True),
    "dr_grpo": LossType("ppo", "TRL", "seq-mean-token-sum-norm", _PPO, True, True),
    "luspo": LossType("ppo", "TRL", "seq-mean-token-sum", _PPO, True, True),
    "cispo": LossType("cispo", "verl, TRL", "token-mean", (), True),
    "sapo": LossType("sapo", "verl, TRL", "seq-mean-token-mean", ("tau_pos", "tau_neg"), True),
    "gspo": LossType("gspo", "verl", "token-mean", ()),
    "gpg": LossType("gpg", "verl", "token-mean", ()),
    "dppo_tv": LossType("dppo_tv", "verl", "token-mean", ("clip_ratio_c",)),
    "dppo_kl": LossType("dppo_kl", "verl", "token-mean", ("clip_ratio_c",)),
    "dro": LossType("dro", "verl", "token-mean", ("dro_beta",)),
    "clip_cov": LossType("clip_cov", "verl", "token-mean", ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
    "kl_cov": LossType("kl_cov", "verl", "token-mean", ("kl_cov_ratio", "ppo_kl_coef")),
    "geo_mean": LossType("geo_mean", "verl", "seq-mean-token-mean", (), all_sequences=True),
    "vespo": LossType("vespo", "TRL", "token-mean", ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                     "vespo_lambda_neg"), True),
    "bypass_mode": LossType("bypass_mode", "verl", "token-mean", ("bypass_loss_type",)),
    "clipped_ratio": LossType("clipped_ratio", "torchrl CISPOLoss", "token-mean", ()),
}
# Formulas whose derivative w.r.t. a row's log-prob depends on that row alone: the fused kernels.
FUSED = ("ppo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl", "dro", "clipped_ratio")
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


def loss_parameters(loss_type: str, given: dict) -> dict:
    """``loss_type``'s parameters (canonical name -> python float or str) from the keyword arguments ``given``
    (canonical names or aliases), defaults filled in. A keyword the loss type does not take is a
    ``TypeError`` naming it and the loss type's parameters; a value out of range a ``ValueError``."""
    spec = loss_type_of(loss_type)
    by_alias = {alias: name for name in spec.parameters for alias in (name, *PARAMETERS[name].aliases)}
    values = {}
    for key, value in given.items():
        name = by_alias.get(key)
        if name is None:
            takes = ", ".join(f"{n} (also {', '.join(PARAMETERS[n].aliases)})" if PARAMETERS[n].aliases else n
                              for n in spec.parameters) or "no parameters of its own"
            raise TypeError(f"policy_loss() got an unexpected keyword argument {key!r}: loss_type={loss_type!r} "
                            f"takes {takes}")
        if name in values:
            raise TypeError(f"policy_loss() got {name!r} twice (under two of its names)")
        values[name] = value
    out = {}
    for name in spec.parameters:
        param = PARAMETERS[name]
        value = values.get(name, param.default)
        if param.choices:
            if value not in param.choices:
                raise ValueError(f"{name} must be one of {param.choices}, got {value!r}")
            out[name] = value
        elif value is None and param.default is None and name in values:
            out[name] = None  # an explicit None of an optional parameter: off
        elif value is None and name == "dro_beta":
            raise ValueError("loss_type='dro' needs dro_beta > 0 (verl's policy_loss.dro_beta)")
        else:
            out[name] = check_float(name, value, allow_none=True, **param.check)
    return out


def hyperparameters(device, **values) -> torch.Tensor:
    """The float64 hyperparameter vector from ``values`` by slot name (each a 0-dim float64 tensor, a float, or
    None); a slot not given (or None) is ``inf`` (off), except ``kl_ratio`` (0: off)."""
    unknown = set(values) - set(SLOT)
    if unknown:
        raise KeyError(f"unknown hyperparameters {sorted(unknown)}; slots: {constants.HYPERPARAMETERS}")
    off = {"kl_ratio": 0.0}

    def slot(name):
        value = values.get(name)
        if value is None:
            value = off.get(name, float("inf"))
        if isinstance(value, torch.Tensor):
            return value.to(device=device, dtype=torch.float64)
        return torch.ones((), dtype=torch.float64, device=device) * value

    return torch.stack([slot(name) for name in constants.HYPERPARAMETERS])


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
    hp: torch.Tensor             # in logp's dtype
    scored: torch.Tensor         # bool
    seq_index: torch.Tensor      # [N] sequence of each row
    num_seqs: int
    log_is: Optional[torch.Tensor]  # VESPO: log of the rollout IS weights per token (None: none)

    def param(self, name):
        return self.hp[SLOT[name]]

    def seq_sum(self, values):
        """``[num_seqs]``: the sum of ``values`` over each sequence's scored rows."""
        zeros = torch.zeros(self.num_seqs, dtype=values.dtype, device=values.device)
        return zeros.index_add(0, self.seq_index, torch.where(self.scored, values, torch.zeros_like(values)))

    def seq_count(self):
        return self.seq_sum(torch.ones_like(self.logp))


def kl_term(estimator: Optional[estimators.Estimator], logp, ref_logp, full_kl, kl_clamp):
    """The estimator's value clamped to ``[-kl_clamp, kl_clamp]`` (a 0-dim tensor, ``inf``: off); 0 without an
    estimator."""
    if estimator is None:
        return torch.zeros_like(logp)
    return estimator.value(logp, ref_logp, full_kl, kl_clamp)


def _token_ratio(b: Batch):
    """verl's ratio: ``exp(clamp(logp - old, -20, 20))`` and that clamped log-ratio."""
    log_ratio = torch.clamp(b.logp - b.old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio), log_ratio


def _sequence_ratio(b: Batch):
    """TRL's ``importance_sampling_level="sequence"``: ``exp`` of the mean log-ratio of the sequence's scored
    tokens (clamped to +-20 like the token ratio), differentiable through every one of them, broadcast."""
    mean = b.seq_sum(b.logp - b.old) / b.seq_count().clamp(min=1)
    return torch.exp(torch.clamp(mean, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[b.seq_index]


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
    seq_log_ratio = b.seq_sum(d) / b.seq_count().clamp(min=1)
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
    count = b.seq_count().clamp(min=1)
    ratio = torch.exp(b.seq_sum(d_min) / count)[b.seq_index]
    adv = (b.seq_sum(b.adv) / count)[b.seq_index]
    moved = d != clipped
    return -adv * ratio, ratio, moved & (b.adv > 0), moved & (b.adv < 0), d


def vespo(b: Batch, ratio, log_ratio):
    """TRL ``vespo``: ``-sg(phi) * A * logp`` with the gamma weight ``phi = exp(lambda + k log w - lambda w)`` of
    the sequence weight ``w = exp(sum clamp(logp - old, +-20) + sum log IS)`` (``log w`` clamped to
    ``[log 1e-8, 20]``), ``k, lambda`` by the advantage's sign (``>= 0``: ``_pos``)."""
    with torch.no_grad():
        log_w = b.seq_sum(torch.clamp(b.logp - b.old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        if b.log_is is not None:
            log_w = log_w + b.seq_sum(torch.clamp(b.log_is, VESPO_LOG_W_MIN, LOG_RATIO_CLAMP))
        log_w = torch.clamp(log_w, VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)[b.seq_index]
        nonneg = b.adv >= 0
        k = torch.where(nonneg, b.param("vespo_k_pos"), b.param("vespo_k_neg"))
        lam = torch.where(nonneg, b.param("vespo_lambda_pos"), b.param("vespo_lambda_neg")).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * b.adv * b.logp, ratio, _no(b), _no(b), log_ratio, phi


FORMULAS = {"ppo": ppo, "cispo": cispo, "sapo": sapo, "gpg": gpg, "dppo_tv": _dppo(False), "dppo_kl": _dppo(True),
            "dro": dro, "clipped_ratio": clipped_ratio, "gspo": gspo, "clip_cov": clip_cov, "kl_cov": kl_cov,
            "geo_mean": geo_mean, "vespo": vespo}
assert set(FORMULAS) == set(FUSED + SEQUENCE + BATCH)


def token_terms(loss_type, estimator, logp, ref_logp, full_kl, old, adv, hp, scored, seq_index=None,
                num_seqs=1, *, level: str = "token", log_is=None) -> TokenTerms:
    """Per-token terms on ``[N]`` tensors; ``old`` None means on-policy (``old = logp.detach()``). ``loss_type``:
    a name of ``LOSS_TYPES`` or a formula (``bypass_mode`` is resolved by ``policy_loss`` first). ``level``:
    ``"sequence"`` replaces the token ratio by the sequence's (TRL). ``log_is``: VESPO's log IS weights."""
    formula = FORMULAS[LOSS_TYPES[loss_type].formula]
    hp = hp.to(logp.dtype)
    old = logp.detach() if old is None else old
    if seq_index is None:
        seq_index = torch.zeros_like(scored, dtype=torch.long)
    b = Batch(logp, old, adv, hp, scored, seq_index, num_seqs, log_is)
    ratio, log_ratio = _token_ratio(b)
    if level == "sequence":
        ratio = _sequence_ratio(b)
    pg, ratio, clipped, lower, log_ratio, *weight = formula(b, ratio, log_ratio)
    kl = kl_term(estimator, logp, ref_logp, full_kl, hp[SLOT["kl_clamp"]])
    kl = kl * torch.where(hp[SLOT["kl_ratio"]] != 0, ratio, torch.ones_like(ratio))  # TRL's bias-corrected KL
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return TokenTerms(torch.where(scored, pg, zero), torch.where(scored, ratio, zero), torch.where(scored, kl, zero),
                      clipped & scored, lower & scored, torch.where(scored, log_ratio, zero),
                      weight[0] if weight else None)


def objective(terms: TokenTerms, entropy, w_pg, w_kl, w_ent):
    """``[N]``: ``w_pg * pg + w_kl * kl + w_ent * entropy``; the loss is its sum."""
    return w_pg * terms.pg + w_kl * terms.kl + w_ent * entropy


def entropy_keep(entropy, scored, quantile):
    """``(keep, threshold)``: ``keep`` ``[N]`` bool, the scored rows whose entropy is at least ``threshold``, the
    ``quantile`` of the scored rows' entropies (0-dim fp32; TRL's ``get_high_entropy_mask``: ``torch.quantile``'s
    linear interpolation, ``>=``), with no host sync. ``quantile`` a python float in ``[0, 1]``; no row is kept
    when none is scored."""
    values = torch.where(scored, entropy.float(), torch.full_like(entropy, float("inf"), dtype=torch.float32))
    ordered = torch.sort(values).values
    count = scored.sum()
    rank = (count - 1).clamp(min=0).to(torch.float32) * quantile
    below = rank.floor().long()
    above = rank.ceil().long()
    low, high = ordered.gather(0, below.reshape(1)), ordered.gather(0, above.reshape(1))
    threshold = torch.lerp(low, high, (rank - below.to(torch.float32)).reshape(1))
    return scored & (entropy.float() >= threshold), threshold.reshape(())


# --- the derivative per row of the FUSED formulas -----------------------------------------------

def _ratio_slope(logp, old):
    """``(d, r, dr)``: ``d = logp - old``, verl's clamped ratio ``r`` and ``d r / d logp`` (0 beyond the
    clamp)."""
    d = logp - old
    ratio = torch.exp(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return d, ratio, torch.where(d.abs() <= LOG_RATIO_CLAMP, ratio, torch.zeros_like(ratio))


def _ppo_slope(logp, old, adv, hp):
    """``d pg / d logp`` of ``ppo`` per row. At an exact tie of the max / min the unclipped branch takes the whole
    gradient (autograd would split it; equal where both branches have the same slope)."""
    low, high, dual, delta = (hp[SLOT[name]] for name in ("ratio_low", "ratio_high", "dual_clip", "delta"))
    _, ratio, d_ratio = _ratio_slope(logp, old)
    pg1, pg2 = -adv * torch.minimum(ratio, delta), -adv * torch.clamp(ratio, low, high)
    zero = torch.zeros_like(logp)
    unclipped = torch.where(ratio <= delta, -adv, zero)
    in_range = torch.where((ratio >= low) & (ratio <= high), -adv, zero)
    g_ratio = torch.where(pg1 >= pg2, unclipped, in_range)
    g_ratio = torch.where((adv < 0) & (torch.maximum(pg1, pg2) > -adv * dual), zero, g_ratio)  # the dual clip holds
    return g_ratio * d_ratio


def _cispo_slope(logp, old, adv, hp):
    """``d pg / d logp`` of ``cispo``: ``-sg(clip(ratio)) * A``."""
    _, ratio, _ = _ratio_slope(logp, old)
    return -torch.clamp(ratio, hp[SLOT["ratio_low"]], hp[SLOT["ratio_high"]]) * adv


def _clipped_ratio_slope(logp, old, adv, hp):
    """``d pg / d logp`` of ``clipped_ratio``: ``-A * r`` inside the clip range, 0 outside."""
    _, ratio, d_ratio = _ratio_slope(logp, old)
    inside = (ratio >= hp[SLOT["ratio_low"]]) & (ratio <= hp[SLOT["ratio_high"]])
    return torch.where(inside, -adv * d_ratio, torch.zeros_like(ratio))


def _sapo_slope(logp, old, adv, hp):
    """``d pg / d logp`` of ``sapo``: ``-A * 4 sigmoid'(tau (r - 1)) * r``."""
    _, ratio, d_ratio = _ratio_slope(logp, old)
    tau = torch.where(adv > 0, hp[SLOT["tau_pos"]], hp[SLOT["tau_neg"]])
    s = torch.sigmoid(tau * (ratio - 1))
    return -adv * 4 * s * (1 - s) * d_ratio


def _gpg_slope(logp, old, adv, hp):
    return -adv


def _dppo_slope(binary_kl: bool):
    def slope(logp, old, adv, hp):
        _, ratio, _ = _ratio_slope(logp, old)
        b = Batch(logp, old, adv, hp, torch.ones_like(logp, dtype=torch.bool), None, 1, None)
        valid = _dppo_valid(b, binary_kl).to(logp.dtype)
        return -adv * torch.clamp(ratio, max=hp[SLOT["clip_ratio_c"]]) * valid
    return slope


def _dro_slope(logp, old, adv, hp):
    return -adv + hp[SLOT["dro_beta"]] * (logp - old)


# d pg / d logp per row of the formulas in FUSED, written out (the C++ and Triton kernels compute the same).
SLOPES = {"ppo": _ppo_slope, "cispo": _cispo_slope, "sapo": _sapo_slope, "gpg": _gpg_slope,
          "dppo_tv": _dppo_slope(False), "dppo_kl": _dppo_slope(True), "dro": _dro_slope,
          "clipped_ratio": _clipped_ratio_slope}
assert set(SLOPES) == set(FUSED)


def coefficients(loss_type, estimator: Optional[estimators.Estimator], logp, ref_logp, inputs, hp, full_kl=None):
    """``(d loss / d logp, d loss / d full_kl)`` per row (``[N]``) for a formula of ``FUSED``; ``d loss / d
    entropy`` is ``inputs.w_ent``. With ``kl_ratio`` the KL term is ``kl * r``: its slope is ``kl' r + kl dr``.
    ``tests/kernels/test_loss_coefficients.py`` holds it against autograd through ``objective`` and against the
    C++ and Triton kernels."""
    hp = hp.to(logp.dtype)
    old = logp if inputs.old_logp is None else inputs.old_logp
    g_logp = inputs.w_pg * SLOPES[loss_type](logp, old, inputs.advantages, hp)
    if estimator is None:
        return g_logp, None
    _, ratio, d_ratio = _ratio_slope(logp, old)
    corrected = hp[SLOT["kl_ratio"]] != 0
    kl_weight = torch.where(corrected, ratio, torch.ones_like(ratio))
    kl_clamp = hp[SLOT["kl_clamp"]]
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
