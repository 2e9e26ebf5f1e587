"""kltriton.adapters.torchrl's GRPO loss family against torchrl 0.14's own (``torchrl.objectives.llm``): the same
output fields and values, and the same parameter gradients of the summed loss, on a tiny Llama and a random batch
(old and reference log-probs off the model's own, one old log-prob NaN as torchrl's alignment pads)."""
import warnings

import pytest
import torch

pytest.importorskip("torchrl")
pytest.importorskip("transformers")

from tensordict import set_list_to_stack  # noqa: E402
from torchrl.objectives.llm import grpo as real  # noqa: E402

import kltriton.adapters.torchrl as ours  # noqa: E402
from helpers import CallCounter  # noqa: E402
from torchrl_support import GEN, tiny_wrapper, token_data  # noqa: E402

REF = ("next", "ref_log_probs", "full")
CASES = [
    ("GRPOLoss", "generic", dict(clip_epsilon=0.2, kl_to_ref_coeff=0.1, entropy_coeff=0.05)),
    ("GRPOLoss", "rlhf", dict(clip_epsilon=0.1, entropy_bonus=False)),
    ("GRPOLoss", "sft", dict(clip_epsilon=(0.2, 0.28), aggregation="prompt_mean", kl_to_ref_coeff=0.5)),
    ("DAPO", "rlhf", dict(clip_epsilon=(0.2, 0.28), kl_to_ref_coeff=0.1)),
    ("CISPOLoss", "generic", dict(clip_epsilon=(0.2, 0.28), kl_to_ref_coeff=0.1, entropy_coeff=0.05)),
    ("CISPOLoss", "rlhf", dict(clip_epsilon=0.1, aggregation="prompt_mean", entropy_bonus=False)),
]


@pytest.fixture(autouse=True)
def _lists_stack():
    with set_list_to_stack(True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="torchrl")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


@pytest.fixture(scope="module")
def actor_and_batch():
    with set_list_to_stack(True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="torchrl")
        actor = tiny_wrapper(0, "log_probs", "tokens", True)
        td = token_data(True)
        with torch.no_grad():
            logp = actor(td.copy()).get(GEN, as_padded_tensor=True)
    gen = torch.Generator().manual_seed(3)
    old = logp + 0.4 * torch.randn(logp.shape, generator=gen)
    old[1, 5] = float("nan")
    td[GEN] = old
    td["advantage"] = torch.randn(logp.shape + (1,), generator=gen)
    td[REF] = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    return actor, td


def _run(cls, actor, td, strategy, kwargs):
    """The loss module's output and the parameter gradients of the sum of its ``loss_*`` fields."""
    actor.zero_grad()
    out = cls(actor, masking_strategy=strategy, **kwargs)(td.copy())
    sum(getattr(out, key) for key in out.keys() if key.startswith("loss_")).backward()
    return out, [p.grad.clone() for p in actor.parameters() if p.grad is not None]


@pytest.mark.parametrize("name,strategy,kwargs", CASES)
def test_matches_torchrl(actor_and_batch, name, strategy, kwargs, monkeypatch):
    actor, td = actor_and_batch
    expected, e_grads = _run(getattr(real, name), actor, td, strategy, kwargs)
    losses = CallCounter(monkeypatch, "policy_loss")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to torchrl's forward
        got, grads = _run(getattr(ours, name), actor, td, strategy, kwargs)
    assert losses.calls == 1
    assert type(got) is type(expected)
    assert sorted(got.keys()) == sorted(expected.keys())
    assert 0 < float(expected.clip_fraction) < 1, "the batch clips some tokens"
    for key in expected.keys():
        torch.testing.assert_close(getattr(got, key).detach(), getattr(expected, key).detach(), atol=2e-6, rtol=2e-5,
                                   msg=lambda m: f"{key}: {m}")  # noqa: B023
    assert len(grads) == len(e_grads) > 0
    for g, e in zip(grads, e_grads):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-4)


def test_unmapped_options_run_torchrl_with_a_warning(actor_and_batch, monkeypatch):
    """``kl_mask_threshold`` changes the denominators per token: torchrl's forward runs, said once."""
    actor, td = actor_and_batch
    kwargs = dict(kl_mask_threshold=0.05, kl_to_ref_coeff=0.1)
    expected, _ = _run(real.GRPOLoss, actor, td, "rlhf", kwargs)
    losses = CallCounter(monkeypatch, "policy_loss")
    loss = ours.GRPOLoss(actor, masking_strategy="rlhf", **kwargs)
    with pytest.warns(UserWarning, match="kl_mask_threshold"):
        got = loss(td.copy())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loss(td.copy())
    torch.testing.assert_close(got.loss_objective, expected.loss_objective)
    assert losses.calls == 0


@pytest.mark.parametrize("name,kwargs", [("GRPOLoss", dict(clip_epsilon=0.2, kl_to_ref_coeff=0.1, entropy_coeff=0.05)),
                                         ("DAPO", dict(clip_epsilon=(0.2, 0.28))),
                                         ("CISPOLoss", dict(clip_epsilon=(0.2, 0.28), kl_to_ref_coeff=0.1))])
def test_extreme_log_ratio_matches_torchrl(actor_and_batch, name, kwargs):
    """torchrl's ratio ``exp(log_weight)`` has no clamp: a log-ratio of +22 under a negative advantage (and -22 under
    a positive one) gives torchrl's loss (about 3.6e9 |A| on that token, not verl's clamped exp(20) |A|) and its
    gradient, with no fallback to torchrl's forward."""
    actor, td = actor_and_batch
    td = td.copy()
    with torch.no_grad():
        logp = actor(td.copy()).get(GEN, as_padded_tensor=True)
    old, advantage = td.get(GEN, as_padded_tensor=True).clone(), td["advantage"].clone()
    for (row, col), log_ratio, sign in (((1, 6), 22.0, -1.0), ((0, 6), -22.0, 1.0)):
        old[row, col] = logp[row, col] - log_ratio
        advantage[row, col] = sign * (0.5 + advantage[row, col].abs())
    td[GEN], td["advantage"] = old, advantage
    expected, e_grads = _run(getattr(real, name), actor, td, "rlhf", kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to torchrl's forward
        got, grads = _run(getattr(ours, name), actor, td, "rlhf", kwargs)
    if name != "CISPOLoss":  # the unclipped branch carries the +22 token: beyond exp(20)
        assert float(expected.loss_objective.detach()) > 1e8
    for key in expected.keys():
        torch.testing.assert_close(getattr(got, key).detach(), getattr(expected, key).detach(), atol=2e-6, rtol=2e-5,
                                   msg=lambda m: f"{key}: {m}")  # noqa: B023
    assert len(grads) == len(e_grads) > 0
    for g, e in zip(grads, e_grads):  # fp32 backward through the model at the scale of its largest gradient
        torch.testing.assert_close(g, e, atol=1e-6 * (1 + e.abs().max().item()), rtol=1e-4)
