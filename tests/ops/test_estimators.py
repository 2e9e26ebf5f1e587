"""Every accepted KL estimator name through every public entry that takes one (``token_kl``,
``fused_kl_reward``, ``policy_loss``), with reference logits and with reference log-probs, against a float64
oracle written from the estimator table: values, and gradients w.r.t. the policy logits with a random
upstream gradient (a straight-through ``+`` name: the base estimator's value, the gradient of ``k2``).
The torchrl adapters run the same names in ``tests/adapters/test_torchrl.py``.

Tolerances: fp32 accumulation on logits of size ~3 (values ``2e-5``); gradients ``1e-5`` absolute plus
``1e-4`` relative (the k3 slope ``1 - exp(-d)`` and the straight-through ``d`` are O(1))."""
import pytest
import torch

import kltriton
from helpers import assert_close, random_labels, random_logits
from kltriton import estimators

NAMES = tuple(sorted(estimators.BY_NAME))
V = 97


def oracle(name, logp, ref_logp, full_kl):
    """The estimator table in float64; straight through in verl's form."""
    est = estimators.parse(name)
    d = logp - ref_logp
    value = {"k1": d, "abs": d.abs(), "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1, "full": full_kl}[est.base]
    if est.straight_through:
        k2 = 0.5 * d * d
        value = k2 - k2.detach() + value.detach()
    return value


def batch(seed=0):
    torch.manual_seed(seed)
    logits = random_logits((3, 6, V), torch.float32)
    ref = random_logits((3, 6, V), torch.float32)
    labels = random_labels((3, 6), V)
    return logits, ref, labels


def float64_kl(name, logits, ref, labels, ref_as_logprobs):
    """(kl, x64) with ``x64`` the float64 policy logits the oracle differentiates."""
    x64 = logits.double().requires_grad_()
    scored = labels != -100
    safe = labels.clamp(min=0)
    lp_all = torch.log_softmax(x64, -1)
    lq_all = torch.log_softmax(ref.double(), -1)
    logp = lp_all.gather(-1, safe[..., None]).squeeze(-1)
    ref_logp = lq_all.gather(-1, safe[..., None]).squeeze(-1)
    full = (lp_all.exp() * (lp_all - lq_all)).sum(-1)
    kl = oracle(name, logp, ref_logp, full)
    return torch.where(scored, kl, torch.zeros_like(kl)), x64, torch.where(scored, ref_logp, 0.0)


@pytest.mark.parametrize("ref_as_logprobs", [False, True], ids=["ref-logits", "ref-logprobs"])
@pytest.mark.parametrize("name", NAMES)
def test_token_kl_and_fused_kl_reward(backend, name, ref_as_logprobs):
    if ref_as_logprobs and estimators.parse(name).needs_ref_logits:
        with pytest.raises(ValueError, match="estimator='full' needs reference logits"):
            kltriton.token_kl(*batch()[:1], torch.zeros(3, 6), batch()[2], estimator=name)
        return
    logits, ref, labels = batch()
    want, x64, ref_logp = float64_kl(name, logits, ref, labels, ref_as_logprobs)
    given_ref = ref_logp.float() if ref_as_logprobs else ref
    upstream = torch.randn(3, 6)
    e_grad, = torch.autograd.grad((want * upstream.double()).sum(), x64)
    for entry in ("token_kl", "fused_kl_reward"):
        x = logits.clone().requires_grad_()
        if entry == "token_kl":
            kl = kltriton.token_kl(x, given_ref, labels, estimator=name, backend=backend).kl
        else:
            kl = kltriton.fused_kl_reward(x, given_ref, labels, coef=0.3, estimator=name, backend=backend).kl
        assert_close(kl, want, 2e-5, 1e-5, what=f"{entry} {name} value")
        grad, = torch.autograd.grad((kl * upstream).sum(), x)
        assert_close(grad, e_grad, 1e-5, 1e-4, what=f"{entry} {name} grad")


@pytest.mark.parametrize("ref_as_logprobs", [False, True], ids=["ref-logits", "ref-logprobs"])
@pytest.mark.parametrize("name", NAMES)
def test_policy_loss_kl_term(backend, name, ref_as_logprobs):
    """``policy_loss(kl_coef=1, kl_estimator=name)`` with a zero advantage and on-policy: the loss is the
    token-mean of the KL and its gradient the oracle's."""
    if ref_as_logprobs and estimators.parse(name).needs_ref_logits:
        with pytest.raises(ValueError, match="kl_estimator='full' needs reference logits"):
            logits, ref, labels = batch()
            kltriton.policy_loss(logits, labels, torch.zeros(3, 6), ref=torch.zeros(3, 6), kl_coef=1.0,
                                 kl_estimator=name)
        return
    logits, ref, labels = batch(1)
    want, x64, ref_logp = float64_kl(name, logits, ref, labels, ref_as_logprobs)
    count = (labels != -100).sum()
    e_loss = want.sum() / count
    e_grad, = torch.autograd.grad(0.7 * e_loss, x64)
    x = logits.clone().requires_grad_()
    out = kltriton.policy_loss(x, labels, torch.zeros(3, 6), ref=ref_logp.float() if ref_as_logprobs else ref,
                               kl_coef=1.0, kl_estimator=name, backend=backend)
    assert_close(out.kl, want, 2e-5, 1e-5, what=f"policy_loss {name} kl")
    assert_close(out.loss, e_loss, 2e-5, 1e-5, what=f"policy_loss {name} loss")
    grad, = torch.autograd.grad(0.7 * out.loss, x)
    assert_close(grad, e_grad, 1e-6, 1e-4, what=f"policy_loss {name} grad")


def test_straight_through_value_is_bitwise_the_base():
    """verl's form: the straight-through value equals the base estimator's bit for bit."""
    logits, ref, labels = batch(2)
    for base in ("k1", "abs", "k3", "kl", "low_var_kl"):
        a = kltriton.token_kl(logits, ref, labels, estimator=base, backend="reference").kl
        b = kltriton.token_kl(logits, ref, labels, estimator=base + "+", backend="reference").kl
        assert torch.equal(a, b), base


def test_unknown_names_are_refused_everywhere():
    logits, ref, labels = batch()
    for bad in ("k4", "full+", "K3", ""):
        with pytest.raises(ValueError, match="estimator must be one of"):
            kltriton.token_kl(logits, ref, labels, estimator=bad)
        with pytest.raises(ValueError, match="kl_estimator must be one of"):
            kltriton.policy_loss(logits, labels, torch.zeros(3, 6), ref=ref, kl_estimator=bad)
    with pytest.raises(TypeError, match="estimator must be a str"):
        kltriton.fused_kl_reward(logits, ref, labels, estimator=3)
