"""KL controllers against hand-computed update sequences (both update conventions)."""
import pytest
import torch

from kltriton.controllers import AdaptiveKLController, ConstantKLController


def test_constant():
    c = ConstantKLController(0.05)
    assert c.update(3.0, 10) == 0.05 and c.update_from_reward_kl([1.0]) == 0.05 and c.value == 0.05


def test_adaptive_ziegler_updates():
    c = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    # kl 9 -> error clip(0.5) = 0.2 -> 0.2 * (1 + 0.2 * 256 / 10000)
    assert c.update(9.0, 256) == pytest.approx(0.2 * 1.00512)
    # kl 5.4 -> error -0.1 -> * (1 - 0.1 * 64 / 10000)
    assert c.update(torch.tensor(5.4), 64) == pytest.approx(0.2 * 1.00512 * (1 - 0.00064))
    # a kl_per_seq tensor: its mean is used
    before = c.value
    assert c.update(torch.tensor([1.0, 2.0, 3.0]), 3) == pytest.approx(before * (1 - 0.2 * 3 / 10000))


def test_adaptive_torchrl_convention():
    """torchrl feeds the logged reward terms -coef * kl and renormalizes by the current coef."""
    c = AdaptiveKLController(init_kl_coef=0.5, target=1.0, horizon=100)
    rewards_kl = [-0.5 * 1.1, -0.5 * 1.3]  # kl values 1.1 and 1.3 -> mean 1.2 -> error 0.2
    assert c.update_from_reward_kl(rewards_kl) == pytest.approx(0.5 * (1 + 0.2 * 2 / 100))
    coef = c.value
    rewards_kl = torch.tensor([-coef * 0.95] * 4)  # kl 0.95 -> error -0.05
    assert c.update_from_reward_kl(rewards_kl) == pytest.approx(coef * (1 - 0.05 * 4 / 100))


def test_bad_arguments():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="kl_values"):
        AdaptiveKLController(0.1, 1.0, 10).update_from_reward_kl(None)
