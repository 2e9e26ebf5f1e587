"""RLHF reward shaping: the KL-shaped per-token rewards of a batch of rollouts, as torchrl's `KLRewardTransform`,
verl's `apply_kl_penalty` and OpenRLHF compute them, with `kltriton.fused_kl_reward`.

Two tiny Llama models built from a config (random weights, nothing downloaded) stand in for the policy and the
frozen reference. A padded batch of prompts and responses of different lengths is scored: reward = -coef * KL per
response token, plus each sequence's reward-model score at its last token. The script checks the result against
the eager computation (log_softmax of both models, gather, mask, shape), scores the same batch again straight from
the hidden states (`LinearLogits`, no `[B, T, V]` logits), and steps an adaptive KL controller.

    python examples/rlhf_reward.py          # under a minute on 2 CPU cores
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kltriton
from kltriton.controllers import AdaptiveKLController

VOCAB, PROMPT, RESPONSE, BATCH = 32000, 24, 104, 4

torch.manual_seed(0)
config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
policy = LlamaForCausalLM(config).eval()
reference = LlamaForCausalLM(config).eval()
reference.load_state_dict(policy.state_dict())
with torch.no_grad():  # the policy has drifted a little from the reference during training
    for param in policy.parameters():
        param.add_(0.02 * torch.randn_like(param))

# A rollout batch [B, T]: a prompt, then a response of its own length, then padding.
lengths = torch.tensor([104, 61, 17, 88])                     # response tokens of each sequence
input_ids = torch.randint(0, VOCAB, (BATCH, PROMPT + RESPONSE))
position = torch.arange(PROMPT + RESPONSE)
attention_mask = position < PROMPT + lengths[:, None]         # [B, T]: prompt + response
response_mask = attention_mask & (position >= PROMPT)         # the tokens the policy generated
input_ids[~attention_mask] = 0                                # pad token
scores = torch.tensor([2.5, -1.0, 14.0, 0.3])                 # a reward model's score per sequence
coef, score_clip = 0.05, 10.0

with torch.no_grad():  # the models' forward, in two steps: the backbone's hidden states, then the LM head
    hidden = policy.model(input_ids, attention_mask=attention_mask).last_hidden_state              # [B, T, H]
    ref_hidden = reference.model(input_ids, attention_mask=attention_mask).last_hidden_state
    logits, ref_logits = policy.lm_head(hidden), reference.lm_head(ref_hidden)                     # [B, T, V]

# Position t scores the token at t + 1 (shift_labels); mask says which tokens are scored: the response.
out = kltriton.fused_kl_reward(logits, ref_logits, input_ids, coef=coef, scores=scores, score_clip=score_clip,
                               mask=response_mask, shift_labels=True)

# The same, eagerly: log_softmax over the whole vocabulary for both models, gather, mask, shape.
logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
ref_logp = torch.log_softmax(ref_logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
scored = response_mask[:, 1:]
kl = (logp - ref_logp) * scored
reward = -coef * kl
last = PROMPT + lengths - 2                                   # the position that scores each sequence's last token
reward[torch.arange(BATCH), last] += scores.clamp(-score_clip, score_clip)
error = max((out.reward[:, :-1] - reward).abs().max().item(), (out.kl[:, :-1] - kl).abs().max().item(),
            out.reward[:, -1].abs().max().item())

print(f"policy/reference: Llama from a config, vocab {VOCAB}; batch [{BATCH}, {PROMPT + RESPONSE}], "
      f"prompt {PROMPT} tokens, coef {coef}, score clip {score_clip}")
print(f"{'seq':>3} {'response':>8} {'mean k1 KL':>10} {'score':>6} {'sum reward':>10}")  # k1 = logp - ref_logp
for s in range(BATCH):
    print(f"{s:>3} {lengths[s].item():>8} {out.kl_per_seq[s].item():>10.5f} {scores[s].item():>6.1f} "
          f"{out.reward[s].sum().item():>10.4f}")
ok = error < 1e-4
print(f"fused_kl_reward vs eager: max |difference| = {error:.2e} -> {'OK' if ok else 'MISMATCH'}")

# From the hidden states: the LM heads' logits are never built (only the scored positions are projected).
from_hidden = kltriton.fused_kl_reward(
    kltriton.LinearLogits(hidden, policy.lm_head.weight), kltriton.LinearLogits(ref_hidden, reference.lm_head.weight),
    input_ids, coef=coef, scores=scores, score_clip=score_clip, mask=response_mask, shift_labels=True)
hidden_error = (from_hidden.reward - out.reward).abs().max().item()
ok &= hidden_error < 1e-4
print(f"LinearLogits (hidden states) vs logits: max |difference| = {hidden_error:.2e} -> "
      f"{'OK' if hidden_error < 1e-4 else 'MISMATCH'}")

# The coefficient for the next batch, steered toward a target KL (Ziegler et al.).
controller = AdaptiveKLController(init_kl_coef=coef, target=0.01, horizon=100)
print(f"adaptive KL coefficient: {coef} -> {controller.update(out.kl_per_seq, n_steps=BATCH):.5f} "
      f"(measured KL {out.kl_per_seq.mean().item():.5f}, target 0.01)")
raise SystemExit(0 if ok else 1)
