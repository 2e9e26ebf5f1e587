"""Distillation: a small student learns a larger teacher's next-token distributions with `kltriton.token_divergence`
(TRL GKD's generalized JSD), from both models' hidden states and LM heads (`LinearLogits`): neither model's
`[B, T, V]` logits are built, and the student's gradient is written during the forward.

Two tiny Llama models built from configs (random weights, nothing downloaded; the teacher's head is scaled up so
that its distributions are peaked, as a trained model's are). The first step's loss and student gradient are
checked against TRL 1.16's `GKDTrainer.generalized_jsd_loss` formula on the full logits; then training steps, each
printing its loss.

    python examples/distillation.py         # under a minute on 2 CPU cores
"""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import kltriton

VOCAB, BATCH, LENGTH, STEPS, BETA = 512, 8, 32, 30, 0.5


def tiny_llama(hidden_size):
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


torch.manual_seed(0)
teacher, student = tiny_llama(128).eval().requires_grad_(False), tiny_llama(32)
with torch.no_grad():
    teacher.lm_head.weight.mul_(20)
optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
input_ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
attention_mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
attention_mask[BATCH // 2:, LENGTH * 3 // 4:] = 0            # half the batch is shorter (padding)


def kltriton_loss():
    """The batch-mean JSD over the scored positions (each position scores the next token, as GKD does)."""
    hidden = student.model(input_ids, attention_mask=attention_mask).last_hidden_state         # [B, T, H]
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids, attention_mask=attention_mask).last_hidden_state
    loss = kltriton.token_divergence(kltriton.LinearLogits(hidden, student.lm_head.weight),
                                     kltriton.LinearLogits(teacher_hidden, teacher.lm_head.weight), input_ids,
                                     divergence="jsd", beta=BETA, mask=attention_mask, shift_labels=True,
                                     reduction="batchmean")
    return loss, hidden, teacher_hidden


def generalized_jsd_loss(student_logits, teacher_logits, beta):
    """TRL 1.16 ``GKDTrainer.generalized_jsd_loss`` (temperature 1, reduction "batchmean") on ``[M, V]`` rows."""
    student_log_probs, teacher_log_probs = F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits, -1)
    beta = torch.tensor(beta, dtype=student_log_probs.dtype)
    mixture_log_probs = torch.logsumexp(torch.stack([student_log_probs + torch.log(1 - beta),
                                                     teacher_log_probs + torch.log(beta)]), dim=0)
    kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
    return (beta * kl_teacher + (1 - beta) * kl_student).sum() / student_logits.shape[0]


def difference_from_eager():
    """The largest difference of the loss, and of its gradients w.r.t. the student's head and hidden states
    (relative), from TRL's formula on the full logits of the scored positions."""
    loss, hidden, teacher_hidden = kltriton_loss()
    params = [student.lm_head.weight, hidden]
    grads = torch.autograd.grad(loss, params)
    params[1] = hidden = hidden.detach().requires_grad_()
    scored = attention_mask[:, 1:].bool()                    # position t scores token t + 1
    expected = generalized_jsd_loss(student.lm_head(hidden)[:, :-1][scored],
                                    teacher.lm_head(teacher_hidden)[:, :-1][scored], BETA)
    expected_grads = torch.autograd.grad(expected, params)
    return max([(loss - expected).abs().item()]
               + [((g - e).abs().max() / e.abs().max()).item() for g, e in zip(grads, expected_grads)])


error = difference_from_eager()
print(f"teacher: Llama, hidden 128; student: Llama, hidden 32; vocab {VOCAB}, batch [{BATCH}, {LENGTH}], "
      f"JSD with beta {BETA}")
losses = []
for step in range(1, STEPS + 1):
    loss, _, _ = kltriton_loss()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step == 1 or step % 5 == 0:
        print(f"step {step:>3}: loss {losses[-1]:.4f}")
ok = error < 1e-4
print(f"token_divergence vs TRL's generalized_jsd_loss at step 1 (loss; student head and hidden-state gradients, "
      f"relative): max |difference| = {error:.2e} -> {'OK' if ok else 'MISMATCH'}")
print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {STEPS} steps")
raise SystemExit(0 if ok else 1)
