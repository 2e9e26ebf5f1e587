"""KL coefficient controllers: ``fused_kl_reward(..., coef=controller.value)``.

``AdaptiveKLController`` is the proportional controller of Ziegler et al. (2019):
``e = clip(kl / target - 1, -0.2, 0.2)`` and ``value *= 1 + e * n_steps / horizon``.
``update(current_kl, n_steps)`` takes the measured KL, e.g. ``kl_per_seq.mean()`` with
``n_steps = batch size`` as verl does. ``update_from_reward_kl(kl_values)`` takes torchrl's
convention instead: the logged reward terms ``-coef * kl``, renormalized by the current coef,
with ``n_steps = len(kl_values)``.
"""
from typing import Sequence, Union

import torch

from kltriton._values import check_float

Number = Union[float, torch.Tensor]


def _to_float(value: Number, name: str, **limits) -> float:
    """A float or a 1-element tensor as a finite python float (``check_float``'s ``limits``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        value = float(value.item())  # one host sync per update, outside the hot path
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a 1-element tensor, got {type(value).__name__}")
    return check_float(name, value, **limits)


def _mean(values, name: str) -> float:
    if isinstance(values, torch.Tensor):
        values = values.detach().float().reshape(-1)
    else:
        values = torch.as_tensor([_to_float(v, name) for v in values], dtype=torch.float32)
    if values.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    return float(values.mean().item())


class ConstantKLController:
    """A fixed KL coefficient; ``update`` accepts anything and changes nothing."""

    def __init__(self, kl_coef: float):
        self.value = _to_float(kl_coef, "kl_coef")

    def update(self, current_kl: Number = None, n_steps: int = 1) -> float:
        return self.value

    def update_from_reward_kl(self, kl_values: Sequence[Number] = None) -> float:
        return self.value


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019), steering the measured KL toward ``target``.

    Args:
        init_kl_coef: starting coefficient (``.value``).
        target: the KL value to hold.
        horizon: how many steps an error of 20% takes to change the coefficient by ~20%.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value = _to_float(init_kl_coef, "init_kl_coef")
        self.target = _to_float(target, "target", above=0.0)
        self.horizon = _to_float(horizon, "horizon", above=0.0)

    def update(self, current_kl: Number, n_steps: int) -> float:
        """Step with the measured KL (a float, a 0-dim tensor, or e.g. ``kl_per_seq`` whose
        mean is used) over ``n_steps`` samples; returns the new coefficient."""
        kl = _mean(current_kl, "current_kl") if isinstance(current_kl, torch.Tensor) else _to_float(current_kl, "current_kl")
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def update_from_reward_kl(self, kl_values: Sequence[Number]) -> float:
        """torchrl's ``AdaptiveKLController.update``: ``kl_values`` are reward terms ``-coef * kl``."""
        if kl_values is None:
            raise ValueError("kl_values must be given: the logged reward KL terms (-coef * kl)")
        n_steps = kl_values.numel() if isinstance(kl_values, torch.Tensor) else len(kl_values)
        return self.update(-_mean(kl_values, "kl_values") / self.value, n_steps)
