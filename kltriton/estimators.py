"""Per-token KL estimators on ``d = logp - ref_logp`` (``[N]`` PyTorch work, shared by every backend).

| estimator | value                 | aliases               |
|-----------|-----------------------|-----------------------|
| ``k1``    | ``d``                 | ``kl``                |
| ``abs``   | ``|d|``               |                       |
| ``k2``    | ``0.5 * d**2``        | ``mse``               |
| ``k3``    | ``exp(-d) + d - 1``   | ``low_var_kl``        |
| ``full``  | ``sum_v p_v (log p_v - log q_v)`` (from the kernel; needs reference logits) | |

verl's straight-through names ``k1+`` (``kl+``), ``abs+``, ``k3+`` (``low_var_kl+``) take the value of the
estimator without ``+`` and the gradient of ``k2`` (verl ``kl_penalty``); ``k2+`` (``mse+``) is ``k2``.
"""
import torch

ESTIMATORS = ("k1", "abs", "k2", "k3", "full")
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def canonical(estimator) -> str:
    """The canonical name of ``estimator`` (an alias, or a straight-through ``+`` name, is accepted)."""
    if not isinstance(estimator, str):
        raise TypeError(f"estimator must be a str, got {type(estimator).__name__}")
    straight_through = estimator.endswith("+")
    base = estimator[:-1] if straight_through else estimator
    name = ALIASES.get(base, base)
    if name not in ESTIMATORS or (straight_through and name == "full"):
        raise ValueError(f"estimator must be one of {ESTIMATORS}, an alias {tuple(ALIASES)}, or a straight-through "
                         f"name such as 'k3+' or 'low_var_kl+', got {estimator!r}")
    return name + "+" if straight_through and name != "k2" else name


def check_kl_clamp(kl_clamp):
    if kl_clamp is None:
        return None
    if isinstance(kl_clamp, torch.Tensor) or not isinstance(kl_clamp, (int, float)):
        raise TypeError(f"kl_clamp must be a python float or None, got {type(kl_clamp).__name__}")
    if not kl_clamp > 0:
        raise ValueError(f"kl_clamp must be > 0, got {kl_clamp}")
    return float(kl_clamp)


def value(estimator: str, kl_clamp, logp, ref_logp, full_kl):
    """The estimator's value on ``[N]`` tensors (``kl_clamp`` applied); autograd derives its gradient."""
    if estimator.endswith("+"):
        # Straight through: the base estimator's (clamped) value, the gradient of k2.
        k2 = value("k2", None, logp, ref_logp, full_kl)
        return k2 + (value(estimator[:-1], kl_clamp, logp, ref_logp, full_kl) - k2).detach()
    if estimator == "full":
        kl = full_kl
    else:
        d = logp - ref_logp
        if estimator == "k1":
            kl = d
        elif estimator == "abs":
            kl = d.abs()
        elif estimator == "k2":
            kl = 0.5 * d * d
        else:
            kl = torch.expm1(-d) + d  # k3: exp(-d) - 1 + d, expm1 keeps small d accurate
    return kl if kl_clamp is None else kl.clamp(-kl_clamp, kl_clamp)
