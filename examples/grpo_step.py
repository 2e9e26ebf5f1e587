"""GRPO training steps in plain PyTorch: sample a group of completions per prompt, reward them, normalize the
rewards within each group, and take two optimizer steps on each batch with `kltriton.policy_loss` (clipped
surrogate + k3 KL to a frozen reference), computed from the hidden states and the LM head (`LinearLogits`): no
`[B, T, V]` logits.

A tiny Llama built from a config (random weights, nothing downloaded) learns a toy task: say even token ids. The
first step's loss and gradients are checked against the eager loss (log_softmax over the full logits, gather,
ratio, clip, k3, sequence-mean of token-means); each rollout prints its reward and the metrics of its last step.

    python examples/grpo_step.py            # under a minute on 2 CPU cores
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kltriton

VOCAB, PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 256, 4, 8, 8, 12
STEPS, UPDATES = 6, 2        # rollouts, and optimizer updates on each (the second one is off-policy: clipping)
CLIP, KL_COEF = 0.2, 0.04

torch.manual_seed(0)
config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None,
                     bos_token_id=None)
policy = LlamaForCausalLM(config)
reference = LlamaForCausalLM(config).eval().requires_grad_(False)
reference.load_state_dict(policy.state_dict())
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
prompts = torch.randint(1, VOCAB, (PROMPTS, PROMPT_LEN))


def reward(completions):
    """The toy task: the share of even token ids in each completion."""
    return (completions % 2 == 0).float().mean(-1)


def kltriton_loss(input_ids, old_logprobs, advantages, completion_mask):
    """The GRPO loss from the hidden states: the gradient reaches the LM head and, through ``hidden``, the backbone."""
    hidden = policy.model(input_ids).last_hidden_state                          # [B, T, H]
    with torch.no_grad():
        ref_hidden = reference.model(input_ids).last_hidden_state
    out = kltriton.policy_loss(
        kltriton.LinearLogits(hidden, policy.lm_head.weight), input_ids, advantages, old_logprobs=old_logprobs,
        ref=kltriton.LinearLogits(ref_hidden, reference.lm_head.weight), loss_type="ppo", clip_low=CLIP,
        kl_coef=KL_COEF, kl_estimator="k3", aggregation="seq-mean-token-mean", mask=completion_mask,
        shift_labels=True)
    return out, hidden, ref_hidden


def eager_loss(hidden, ref_hidden, input_ids, old_logprobs, advantages, completion_mask):
    """The same loss without kltriton: log_softmax over the full logits, gather, ratio, clip, k3, aggregate."""
    logp = torch.log_softmax(policy.lm_head(hidden)[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    ref_logp = torch.log_softmax(reference.lm_head(ref_hidden)[:, :-1].float(), -1).gather(
        -1, input_ids[:, 1:, None])[..., 0]
    ratio = torch.exp(logp - old_logprobs[:, :-1])
    pg = torch.maximum(-advantages[:, None] * ratio, -advantages[:, None] * ratio.clamp(1 - CLIP, 1 + CLIP))
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1                     # k3
    mask = completion_mask[:, 1:].float()
    return (((pg + KL_COEF * kl) * mask).sum(-1) / mask.sum(-1)).mean()         # seq-mean-token-mean


def difference_from_eager(input_ids, old_logprobs, advantages, completion_mask):
    """The largest difference of the loss, and of its LM-head and hidden-state gradients (relative), from eager."""
    out, hidden, ref_hidden = kltriton_loss(input_ids, old_logprobs, advantages, completion_mask)
    grads = torch.autograd.grad(out.loss, [policy.lm_head.weight, hidden])
    hidden = hidden.detach().requires_grad_()
    expected = eager_loss(hidden, ref_hidden, input_ids, old_logprobs, advantages, completion_mask)
    expected_grads = torch.autograd.grad(expected, [policy.lm_head.weight, hidden])
    return max([(out.loss - expected).abs().item()]
               + [((g - e).abs().max() / e.abs().max()).item() for g, e in zip(grads, expected_grads)])


print(f"policy: Llama from a config, vocab {VOCAB}; {PROMPTS} prompts x {GROUP} completions of {NEW_TOKENS} tokens "
      f"per step; reward = share of even token ids")
print(f"{'step':>4} {'reward':>7} {'loss':>8} {'kl':>8} {'clipfrac':>8} {'entropy':>8}")
first_reward = None
for step in range(1, STEPS + 1):
    # Rollout: GROUP sampled completions per prompt.
    policy.eval()
    with torch.no_grad():
        input_ids = policy.generate(prompts.repeat_interleave(GROUP, 0), do_sample=True, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, top_k=0, pad_token_id=0)
    completions = input_ids[:, PROMPT_LEN:]
    rewards = reward(completions)
    grouped = rewards.view(PROMPTS, GROUP)
    advantages = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)).flatten()
    completion_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    completion_mask[:, PROMPT_LEN:] = True                                      # score the completion tokens only

    with torch.no_grad():  # the rollout policy's log-probs, for the ratio of every update on this batch
        hidden = policy.model(input_ids).last_hidden_state
        old_logprobs = kltriton.token_logprobs(kltriton.LinearLogits(hidden, policy.lm_head.weight), input_ids,
                                               mask=completion_mask, shift_labels=True)

    policy.train()
    if step == 1:  # the check: the same loss and gradients as the eager computation
        error = difference_from_eager(input_ids, old_logprobs, advantages, completion_mask)
    for _ in range(UPDATES):
        out, _, _ = kltriton_loss(input_ids, old_logprobs, advantages, completion_mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()

    m = out.metrics  # of the last update
    first_reward = rewards.mean().item() if first_reward is None else first_reward
    print(f"{step:>4} {rewards.mean().item():>7.3f} {out.loss.item():>8.4f} {m['kl_mean'].item():>8.5f} "
          f"{m['clipfrac'].item():>8.3f} {m['entropy_mean'].item():>8.4f}")

ok = error < 1e-4
print(f"policy_loss vs eager at step 1 (loss; LM-head and hidden-state gradients, relative): max |difference| = "
      f"{error:.2e} -> {'OK' if ok else 'MISMATCH'}")
print(f"mean reward {first_reward:.3f} -> {rewards.mean().item():.3f} after {STEPS} steps")
raise SystemExit(0 if ok else 1)
