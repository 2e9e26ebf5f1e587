"""TRL integration, loss by loss: on one hand-made GRPOTrainer batch, ``_compute_loss`` with kltriton applied gives
TRL's own loss, parameter gradients and logged metrics for every configuration of a sweep over the GRPOConfig
fields that change the loss, and falls back to TRL's code for none of them (the fallbacks are counted)."""
import itertools
import math

import pytest
import torch

pytest.importorskip("trl")

import kltriton  # noqa: E402
from helpers import CallCounter  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from trl_support import config, dataset, reward_cats, tiny_llama  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# The sweep of the issue: every loss type x importance-sampling level x beta x bias correction x entropy mask x
# epsilon_high x delta.
SWEEP = list(itertools.product(LOSS_TYPES, ("token", "sequence"), (0.0, 0.04), (False, True), (1.0, 0.2),
                               (None, 0.28), (None, 1.5)))
B, P, C = 4, 4, 6


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """A GRPOTrainer built with the integration applied (its models carry kltriton's head), the integration's
    patch (undone between uses: ``commit()`` / ``undo()`` switch between kltriton and TRL), and a batch."""
    from trl import GRPOTrainer

    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(path)
    patch = kl_trl.apply()
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward_cats, args=config(tmp_path_factory.mktemp("out")),
                          train_dataset=dataset())
    patch.undo()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    yield trainer, patch, _batch(trainer)
    patch.undo()


def _batch(trainer):
    """Prompts with left padding, completions of lengths 6, 4, 0 (all masked: a truncated completion) and 3,
    old / reference / sampling log-probs around the model's own (one sampling log-prob NaN, as vLLM reports a
    token it could not score), and TRL's importance-sampling ratios."""
    gen = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    completion_ids = torch.randint(3, vocab, (B, C), generator=gen)
    completion_mask = (torch.arange(C)[None] < torch.tensor([6, 4, 0, 3])[:, None]).long()
    with torch.no_grad():
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, mask, C)
    noise = lambda scale: scale * torch.randn(B, C, generator=gen)  # noqa: E731
    old = logps + noise(0.3)
    sampling = old + noise(0.3)
    sampling[0, 2] = float("nan")
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=torch.randn(B, generator=gen),
                num_items_in_batch=completion_mask.sum() * 2.0, old_per_token_logps=old,
                ref_per_token_logps=logps + noise(0.5), sampling_per_token_logps=sampling)


def _is_ratio(trainer, inputs):
    """TRL's vLLM importance-sampling ratio (``_generate_and_score_completions``), restated."""
    mask = inputs["completion_mask"]
    diff = torch.nan_to_num((inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask, nan=0.0)
    if trainer.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if trainer.vllm_importance_sampling_mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    low, high = (-math.inf if low is None else low), (math.inf if high is None else high)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _run(trainer, inputs):
    """``(loss, parameter gradients, metrics)`` of one ``_compute_loss`` call."""
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    return loss.detach(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


def _compare(trainer, patch, inputs, what):
    """TRL's ``_compute_loss`` (TRL's head and loss) against the patched one; returns kltriton's metrics."""
    patch.undo()
    state = (trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats)
    theirs = _run(trainer, inputs)
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = state
    patch.commit()
    ours = _run(trainer, inputs)
    # Log-probs from two LM heads differ by fp32 rounding (~1e-6): the loss and its gradients agree to 1e-5.
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} loss: {m}")
    assert len(ours[1]) == len(theirs[1]), what
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what} gradient: {m}")
    assert set(ours[2]) == set(theirs[2]), (what, set(ours[2]) ^ set(theirs[2]))
    for key, values in theirs[2].items():
        for a, b in zip(ours[2][key], values):
            same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
            assert same, (what, key, a, b)
    return ours[2]


def _configure(trainer, loss_type="dapo", level="token", beta=0.0, bias=True, quantile=1.0, epsilon_high=None,
               delta=None):
    args = trainer.args
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.top_entropy_quantile = quantile
    trainer.epsilon_high = trainer.epsilon_low if epsilon_high is None else epsilon_high
    args.use_bias_correction_kl, args.delta = bias, delta


@pytest.mark.slow  # 1024 configurations: about 2 minutes of CPU
def test_the_sweep_equals_trl_with_no_fallback(rig, monkeypatch):
    trainer, patch, inputs = rig
    losses = CallCounter(monkeypatch, "policy_loss")
    fallbacks = []
    original = kl_trl._why_trl_loss
    monkeypatch.setattr(kl_trl, "_why_trl_loss", lambda *a: fallbacks.append(original(*a)) or fallbacks[-1])
    clipped = 0
    for setting in SWEEP:
        _configure(trainer, *setting)
        metrics = _compare(trainer, patch, inputs, setting)
        clipped += metrics.get("clip_ratio/region_mean", [0])[0] > 0
    assert losses.calls == len(SWEEP)
    assert [reason for reason in fallbacks if reason is not None] == [], "fallbacks to TRL's code"
    assert len(fallbacks) == len(SWEEP)
    assert clipped > len(SWEEP) // 8  # the sweep clips: the clip metrics are not all zero


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "vespo"])
def test_vllm_importance_sampling_options(rig, monkeypatch, mode, loss_type):
    """TRL's vLLM correction (every mode, with C_min and C_max) multiplies the policy term by TRL's ratios, which
    the integration takes from the batch; VESPO reads them inside its weight (token modes only, as TRL)."""
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses VESPO with sequence-level vLLM correction")
    trainer, patch, inputs = rig
    losses = CallCounter(monkeypatch, "policy_loss")
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", mode)
    for low, high in ((None, 3.0), (0.8, 1.2), (0.5, None)):
        if mode.endswith("truncate") and low is None and high is None:
            continue
        monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_min", low)
        monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_max", high)
        batch = dict(inputs, importance_sampling_ratio=_is_ratio(trainer, inputs))
        _configure(trainer, loss_type, beta=0.04)
        _compare(trainer, patch, batch, (mode, loss_type, low, high))
    assert losses.calls == 3


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo", "vespo"])
def test_off_policy_mask_entropy_bonus_and_eval(rig, monkeypatch, loss_type):
    """The off-policy sequence mask (on vLLM's sampling log-probs and without them), the entropy bonus (static,
    adaptive, with the entropy mask), and eval mode."""
    trainer, patch, inputs = rig
    losses = CallCounter(monkeypatch, "policy_loss")
    calls = 0
    for threshold, with_sampling in ((0.05, True), (0.05, False), (0.5, True)):
        monkeypatch.setattr(trainer, "off_policy_mask_threshold", threshold)
        batch = inputs if with_sampling else {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
        _configure(trainer, loss_type, beta=0.04)
        _compare(trainer, patch, batch, (loss_type, threshold, with_sampling))
        calls += 1
    monkeypatch.setattr(trainer, "off_policy_mask_threshold", None)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", True)
    for adaptive, quantile in ((False, 1.0), (True, 1.0), (True, 0.5)):
        monkeypatch.setattr(trainer, "use_adaptive_entropy", adaptive)
        monkeypatch.setattr(trainer, "entropy_coef", 0.02)
        monkeypatch.setattr(trainer, "_last_world_entropy", 0.0)  # the adaptive bonus applies
        monkeypatch.setattr(trainer.args, "entropy_target", 5.0)
        _configure(trainer, loss_type, beta=0.04, quantile=quantile)
        _compare(trainer, patch, inputs, (loss_type, "entropy bonus", adaptive, quantile))
        calls += 1
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", False)
    trainer.model.eval()
    try:
        _configure(trainer, loss_type, beta=0.04, quantile=0.2)
        _compare(trainer, patch, inputs, (loss_type, "eval"))
        calls += 1
    finally:
        trainer.model.train()
    assert losses.calls == calls


_PPO_NAMES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@pytest.fixture(scope="module")
def default_trainer(tmp_path_factory):
    """A GRPOTrainer (TRL's own head and loss, kltriton not applied) whose loss fields are all ``GRPOConfig``'s
    defaults (only the run's plumbing is set), on one step with no accumulation, and the batch of ``_batch``."""
    from trl import GRPOConfig, GRPOTrainer

    path = tmp_path_factory.mktemp("tiny-llama-defaults")
    tiny_llama(path)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("out")), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=B, num_generations=B, save_strategy="no", disable_tqdm=True,
                      dataloader_num_workers=0)
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward_cats, args=args, train_dataset=dataset())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _batch(trainer)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()  # this step's tokens: one process
    return trainer, inputs


def _extreme(trainer, inputs):
    """The batch with an old log-prob 22 below the current one (log-ratio +22, which TRL does not clamp) in a
    sequence of negative advantage, and 22 above in one of positive advantage."""
    inputs = dict(inputs, old_per_token_logps=inputs["old_per_token_logps"].clone())
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    adv, scored = inputs["advantages"], inputs["completion_mask"][:, 1] > 0
    negative, positive = int(torch.nonzero((adv < 0) & scored)[0]), int(torch.nonzero((adv > 0) & scored)[0])
    for row, log_ratio in ((negative, 22.0), (positive, -22.0)):
        inputs["old_per_token_logps"][row, 1] = logps[row, 1] - log_ratio
    return inputs


@pytest.mark.parametrize("extreme", [False, True], ids=["ordinary", "log-ratio-22"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_loss_type_alone_is_trls_default_config(default_trainer, loss_type, extreme):
    """``kltriton.policy_loss(loss_type=name)`` with nothing else (on the completions' logits) equals TRL's own
    ``_compute_loss`` under ``GRPOConfig``'s defaults: no dual clip, no log-ratio clamp, dr_grpo's normalizer
    ``max_completion_length = 512``, ... The names verl registers too (``cispo``, ``sapo``) take verl's defaults;
    TRL's versions of them are the documented keywords (``docs/api/losses.md``)."""
    trainer, inputs = default_trainer
    if extreme:
        inputs = _extreme(trainer, inputs)
    model = trainer.model
    trainer.loss_type = loss_type
    model.zero_grad()
    expected = trainer._compute_loss(model, inputs)
    expected.backward()
    e_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1:-1]
    trl_form = {"cispo": dict(clip_low=1.0, clip_high=trainer.epsilon_high - 1.0, log_ratio_clamp=math.inf),
                "sapo": dict(log_ratio_clamp=math.inf, global_batch_size=float(B))}.get(loss_type, {})
    out = kltriton.policy_loss(logits, inputs["completion_ids"], inputs["advantages"], mask=inputs["completion_mask"],
                               old_logprobs=inputs["old_per_token_logps"], loss_type=loss_type, **trl_form)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    # Log-probs from two LM heads differ by fp32 rounding (~1e-6): the loss and its gradients agree to 1e-5. The
    # backward through the model rounds in fp32 at the scale of the largest gradient (exp(22) at the extreme).
    torch.testing.assert_close(out.loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert len(grads) == len(e_grads) > 0
    for a, b in zip(grads, e_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * (1 + b.abs().max().item()))
    if extreme and loss_type in _PPO_NAMES:  # TRL's unclamped ratio: exp(22) |A|, not verl's exp(20) |A|
        assert expected.abs() > 1e4, float(expected)
