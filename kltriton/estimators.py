"""Per-token KL estimators on ``d = logp - ref_logp``: the one parser (``parse``) and the one formula
(``Estimator.value``) every entry uses.

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
from typing import NamedTuple, Optional

import torch

from kltriton._values import check_float

ESTIMATORS = ("k1", "abs", "k2", "k3", "full")
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


class Estimator(NamedTuple):
    """A parsed estimator: ``base`` (one of ``ESTIMATORS``) and verl's straight-through ``+``."""
    base: str
    straight_through: bool = False

    @property
    def name(self) -> str:
        """The canonical spelling (``"k3+"``): what crosses a custom-op boundary, parsed back by ``parse``."""
        return self.base + ("+" if self.straight_through else "")

    @property
    def needs_ref_logits(self) -> bool:
        return self.base == "full"

    def value(self, logp, ref_logp, full_kl=None, kl_clamp=None) -> torch.Tensor:
        """The estimator's value on ``[N]`` tensors, clamped to ``[-kl_clamp, kl_clamp]`` (a float or a 0-dim
        tensor); autograd derives
        its gradient. Straight through: bitwise the base estimator's value, the gradient of ``k2``
        (verl's ``k2 - k2.detach() + base.detach()``)."""
        if self.base == "full":
            kl = full_kl
        else:
            d = logp - ref_logp
            if self.base == "k1":
                kl = d
            elif self.base == "abs":
                kl = d.abs()
            elif self.base == "k2":
                kl = 0.5 * d * d
            else:
                kl = torch.expm1(-d) + d  # k3: exp(-d) - 1 + d, expm1 keeps small d accurate
        if kl_clamp is not None:
            kl = kl.clamp(-kl_clamp, kl_clamp)
        if self.straight_through:
            d = logp - ref_logp
            k2 = 0.5 * d * d
            kl = k2 - k2.detach() + kl.detach()
        return kl

    def slope(self, d, kl_clamp) -> torch.Tensor:
        """``d value / d logp`` on ``d = logp - ref_logp`` (not for ``"full"``): 0 where the clamp holds the
        value; the straight-through names take the slope of ``k2`` (``d``)."""
        if self.straight_through:
            return d
        slope = {"k1": torch.ones_like(d), "abs": torch.sign(d), "k2": d, "k3": -torch.expm1(-d)}[self.base]
        value = Estimator(self.base).value(d, torch.zeros_like(d))
        return torch.where(value.abs() > kl_clamp, torch.zeros_like(d), slope)


def _table():
    """Every accepted name -> its ``Estimator``."""
    table = {}
    for name in ESTIMATORS + tuple(ALIASES):
        base = ALIASES.get(name, name)
        table[name] = Estimator(base)
        if base != "full":
            table[name + "+"] = Estimator(base, base != "k2")  # "k2+" is k2: its own gradient
    return table


BY_NAME = _table()


def parse(estimator, *, ref_logits: bool = True, argument: str = "estimator") -> Estimator:
    """The ``Estimator`` named by ``estimator`` (a name, an alias, a straight-through ``+`` name, or an
    ``Estimator``). ``ref_logits=False``: the reference is given as log-probs, so ``"full"`` is refused.
    Errors name ``argument``."""
    if isinstance(estimator, (Estimator, str)):
        parsed = BY_NAME.get(estimator.name if isinstance(estimator, Estimator) else estimator)
    else:
        raise TypeError(f"{argument} must be a str, got {type(estimator).__name__}")
    if parsed is None:
        raise ValueError(f"{argument} must be one of {ESTIMATORS}, an alias {tuple(ALIASES)}, or a straight-through "
                         f"name such as 'k3+' or 'low_var_kl+', got {estimator!r}")
    if parsed.needs_ref_logits and not ref_logits:
        raise ValueError(f"{argument}='full' needs reference logits in ref, not reference log-probs")
    return parsed


def check_kl_clamp(kl_clamp) -> Optional[float]:
    """``kl_clamp``: None (no clamp) or a finite float ``> 0``."""

    return check_float("kl_clamp", kl_clamp, above=0.0, allow_none=True)
