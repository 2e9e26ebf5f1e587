"""Per-token KL estimators on ``d = logp - ref_logp`` (``[N]`` work, shared by every backend).

| estimator | value                 | aliases               |
|-----------|-----------------------|-----------------------|
| ``k1``    | ``d``                 | ``kl``                |
| ``abs``   | ``|d|``               |                       |
| ``k2``    | ``0.5 * d**2``        | ``mse``               |
| ``k3``    | ``exp(-d) + d - 1``   | ``low_var_kl``        |
| ``full``  | ``sum_v p_v (log p_v - log q_v)`` (from the kernel; needs reference logits) | |
"""
import torch

ESTIMATORS = ("k1", "abs", "k2", "k3", "full")
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def canonical(estimator) -> str:
    """The canonical name of ``estimator`` (an alias is accepted)."""
    if not isinstance(estimator, str):
        raise TypeError(f"estimator must be a str, got {type(estimator).__name__}")
    name = ALIASES.get(estimator, estimator)
    if name not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS} or an alias {tuple(ALIASES)}, got {estimator!r}")
    return name


def check_kl_clamp(kl_clamp):
    if kl_clamp is None:
        return None
    if isinstance(kl_clamp, torch.Tensor) or not isinstance(kl_clamp, (int, float)):
        raise TypeError(f"kl_clamp must be a python float or None, got {type(kl_clamp).__name__}")
    if not kl_clamp > 0:
        raise ValueError(f"kl_clamp must be > 0, got {kl_clamp}")
    return float(kl_clamp)


def unclamped(estimator: str, logp, ref_logp, full_kl):
    """The estimator's value before ``kl_clamp``."""
    if estimator == "full":
        return full_kl
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(-d) + d  # k3: exp(-d) - 1 + d, expm1 keeps small d accurate


def value(estimator: str, kl_clamp, logp, ref_logp, full_kl):
    """The estimator's value: always a new tensor (a custom op's outputs may not alias)."""
    kl = unclamped(estimator, logp, ref_logp, full_kl)
    if kl_clamp is not None:
        return kl.clamp(-kl_clamp, kl_clamp)
    return kl.clone() if kl is full_kl else kl


def grad_wrt_logp(estimator: str, kl_clamp, logp, ref_logp, full_kl, g_kl):
    """``(g_label, g_full)``: how ``g_kl`` reaches ``logp`` and, for ``full``, the full-KL term."""
    if kl_clamp is not None:
        inside = unclamped(estimator, logp, ref_logp, full_kl).abs() <= kl_clamp
        g_kl = torch.where(inside, g_kl, torch.zeros_like(g_kl))
    if estimator == "full":
        return None, g_kl
    d = logp - ref_logp
    if estimator == "k1":
        slope = torch.ones_like(d)
    elif estimator == "abs":
        slope = torch.sign(d)
    elif estimator == "k2":
        slope = d
    else:
        slope = -torch.expm1(-d)  # k3: 1 - exp(-d)
    return g_kl * slope, None
