"""OpenRLHF integration: its Actor scores with kltriton, and kltriton reproduces OpenRLHF's helpers."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")

import kltriton  # noqa: E402
from helpers import CallCounter  # noqa: E402
from kltriton.integrations import openrlhf as kl_openrlhf  # noqa: E402
from openrlhf_support import stub_flash_attn  # noqa: E402

stub_flash_attn()

import openrlhf.models.utils as openrlhf_utils  # noqa: E402
from openrlhf.models import PolicyLoss  # noqa: E402

ORIGINALS = (openrlhf_utils.log_probs_from_logits, openrlhf_utils.compute_entropy)


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of kltriton.token_logprobs (what the integration calls)."""
    return CallCounter(monkeypatch, "token_logprobs")


def _logits(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()


def _tiny_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def test_actor_forward_and_backward_match(tmp_path, counted):
    """OpenRLHF's own Actor (bf16, temperature 0.7): action log-probs, entropy and parameter gradients."""
    from openrlhf.models import Actor

    _tiny_llama(tmp_path)
    actor = Actor(str(tmp_path), attn_implementation="sdpa", param_dtype="bf16", temperature=0.7)
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(3, 97, (3, 17), generator=g)
    attention_mask = torch.ones_like(sequences)
    attention_mask[0, :4] = 0  # left padding
    action_mask = torch.ones(3, 9, dtype=torch.bool)
    action_mask[2, 6:] = False
    weights = torch.randn(3, 9, generator=g)

    def run():
        actor.zero_grad()
        logp, output = actor(sequences, action_mask, attention_mask, return_output=True, return_entropy=True)
        ((logp * weights).sum() + (output.entropy[:, -9:] * weights).sum()).backward()
        grads = {n: p.grad.clone() for n, p in actor.named_parameters()}
        return logp.detach(), output.entropy.detach(), grads

    logp, entropy, grads = run()
    with kl_openrlhf.apply():
        k_logp, k_entropy, k_grads = run()
    assert counted.calls == 2  # one log-prob call, one entropy call
    # Same fp32 logits in both runs: only the order of the vocab reduction differs.
    torch.testing.assert_close(k_logp, logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_entropy, entropy, rtol=1e-5, atol=1e-5)
    # Parameter gradients are bf16: one bf16 rounding step of difference is allowed.
    for name, grad in grads.items():
        torch.testing.assert_close(k_grads[name].float(), grad.float(), rtol=1e-2, atol=1e-4, msg=name)


def test_log_probs_from_logits_matches_and_leaves_the_callers_logits_alone():
    logits = _logits((3, 29, 301)).detach()
    labels = torch.randint(0, 301, (3, 29), generator=torch.Generator().manual_seed(2))
    theirs_input = logits.clone()
    expected = ORIGINALS[0](theirs_input, labels, temperature=0.7)
    with kl_openrlhf.apply():
        ours_input = logits.clone()
        ours = openrlhf_utils.log_probs_from_logits(ours_input, labels, temperature=0.7)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs_input, logits / 0.7)  # OpenRLHF divided the caller's logits in place
    assert torch.equal(ours_input, logits)                   # kltriton did not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_log_probs_and_entropy_match_float64(dtype):
    logits = _logits((2, 31, 1031), dtype)
    labels = torch.randint(0, 1031, (2, 31), generator=torch.Generator().manual_seed(3))
    expected_lp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    expected_ent = ORIGINALS[1](logits.double())
    with kl_openrlhf.apply():
        lp = openrlhf_utils.log_probs_from_logits(logits, labels)
        ent = openrlhf_utils.compute_entropy(logits)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(lp.double(), expected_lp, **tol)
    torch.testing.assert_close(ent.double(), expected_ent, **tol)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), logits)
    (expected,) = torch.autograd.grad(expected_lp.sum() + expected_ent.sum(), logits)
    torch.testing.assert_close(grad.double(), expected.double(), **tol)


def _policy_and_ref(b=4, t=21, v=257):
    logits = _logits((b, t, v))
    labels = torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(4))
    ref_logits = _logits((b, t, v), torch.float64, seed=5).detach()
    ref_logp = torch.log_softmax(ref_logits, -1).gather(-1, labels[..., None]).squeeze(-1).float()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 15:] = False
    mask[3, 7:] = False
    return logits, labels, ref_logp, mask


# OpenRLHF estimator (and unbiased_gradient) -> kltriton estimator. OpenRLHF clamps every value to [-10, 10].
KL_CASES = {("k1", False): "k1", ("k2", False): "k2", ("k3", False): "k3", ("k1", True): "k1+",
            ("k3", True): "k3+"}


@pytest.mark.parametrize("case", list(KL_CASES), ids=lambda c: c[0] + ("-unbiased" if c[1] else ""))
def test_compute_approx_kl_matches_kltriton_token_kl(case):
    estimator, unbiased = case
    logits, labels, ref_logp, mask = _policy_and_ref()
    try:
        out = kltriton.token_kl(logits, ref_logp, labels, estimator=KL_CASES[case], kl_clamp=10.0, mask=mask)
    except ValueError as error:
        if unbiased:
            pytest.skip(f"this kltriton does not accept {KL_CASES[case]!r} yet: {error}")
        raise
    with kl_openrlhf.apply():
        logp = openrlhf_utils.log_probs_from_logits(logits, labels) * mask
    expected = openrlhf_utils.compute_approx_kl(logp, ref_logp * mask, kl_estimator=estimator,
                                                unbiased_gradient=unbiased)
    torch.testing.assert_close(out.kl, expected, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(out.kl.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_compute_reward_matches_kltriton_fused_kl_reward():
    """The experience maker's reward: r clipped, at the last action token, minus kl_coef * k1 at every token."""
    logits, labels, ref_logp, mask = _policy_and_ref()
    scores = torch.tensor([3.0, -7.0, 0.5, 9.0])
    out = kltriton.fused_kl_reward(logits, ref_logp, labels, coef=0.05, estimator="k1", kl_clamp=10.0,
                                   scores=scores, score_clip=5.0, mask=mask)
    with kl_openrlhf.apply():
        logp = openrlhf_utils.log_probs_from_logits(logits, labels) * mask
    kl = openrlhf_utils.compute_approx_kl(logp, ref_logp * mask, kl_estimator="k1")
    expected = openrlhf_utils.compute_reward(scores, 0.05, kl, action_mask=mask, reward_clip_range=(-5.0, 5.0))
    torch.testing.assert_close(out.reward, expected, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(out.reward.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(kltriton, "policy_loss"), reason="kltriton.policy_loss has not landed yet")
@pytest.mark.parametrize("token_level_loss", [True, False], ids=["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_type,dual_clip", [("ppo", None), ("ppo", 3.0), ("gspo", None)])
def test_policy_loss_matches_openrlhf(loss_type, dual_clip, token_level_loss):
    logits, labels, _, mask = _policy_and_ref()
    g = torch.Generator().manual_seed(6)
    advantages = torch.randn(logits.shape[:2], generator=g)
    if loss_type == "gspo":
        # One advantage per sequence, as GSPO uses it. OpenRLHF differentiates exp(mean log-ratio) itself and
        # verl (whose formula kltriton follows) the stop-gradient token form: equal gradients only then.
        advantages = advantages[:, :1].expand_as(advantages)
    with kl_openrlhf.apply():
        logp = openrlhf_utils.log_probs_from_logits(logits, labels) * mask
    old = (logp.detach() + 0.3 * torch.randn(logp.shape, generator=g)) * mask
    loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip,
                         token_level_loss=token_level_loss, policy_loss_type=loss_type)
    expected = loss_fn(logp, old, advantages, action_mask=mask)[0]
    aggregation = "token-mean" if token_level_loss and loss_type == "ppo" else "seq-mean-token-mean"
    out = kltriton.policy_loss(logits, labels, advantages, old_logprobs=old, loss_type=loss_type, clip_low=0.2,
                               clip_high=0.28, dual_clip=dual_clip, aggregation=aggregation, mask=mask)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(out.loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_apply_changes_nothing_until_called_and_undo_restores_everywhere():
    import openrlhf.models.actor as actor_module

    assert (openrlhf_utils.log_probs_from_logits, openrlhf_utils.compute_entropy) == ORIGINALS
    assert (actor_module.log_probs_from_logits, actor_module.compute_entropy) == ORIGINALS
    with kl_openrlhf.apply() as patch:
        assert actor_module.log_probs_from_logits is kl_openrlhf.log_probs_from_logits
        assert actor_module.compute_entropy is kl_openrlhf.compute_entropy
        with pytest.raises(RuntimeError, match="already applied"):
            kl_openrlhf.apply()
    assert not patch.active
    assert (actor_module.log_probs_from_logits, actor_module.compute_entropy) == ORIGINALS
    assert (openrlhf_utils.log_probs_from_logits, openrlhf_utils.compute_entropy) == ORIGINALS


def test_importing_the_integration_imports_no_openrlhf():
    code = ("import sys, kltriton.integrations.openrlhf; "
            "sys.exit(int(any(m == 'openrlhf' or m.startswith('openrlhf.') for m in sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(kltriton.__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
