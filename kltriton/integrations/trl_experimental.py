"""TRL 1.16's experimental trainers that run the whole model and read its ``[B, T, V]`` logits, scored from the hidden
states instead; installed by ``kltriton.integrations.trl.apply()`` (and undone with it).

- ``OnlineDPOTrainer._forward`` (``trl.experimental.online_dpo``): the completion tokens' log-probs ``[B, C]``, TRL's
  ``log_softmax`` + ``take_along_dim`` on the logits (no temperature: TRL applies it only when generating), become
  ``kltriton.token_logprobs`` of the backbone's last hidden states through the LM head as a ``LinearLogits``, with
  TRL's left truncation to ``max_length`` and its positions (``prompt_len - 1`` on, or from 0 without a prompt),
  padding included. The policy's log-probs take a gradient; the reference's are scored under TRL's ``no_grad``.
- ``CPOTrainer.concatenated_forward`` (CPO / SimPO / AlphaPO / IPO, ``trl.experimental.cpo``) and
  ``ORPOTrainer.concatenated_forward`` (``trl.experimental.orpo``): one ``token_logprobs(...,
  outputs=("mean_logits",))`` over every position of the concatenated chosen + rejected batch gives what the trainers
  read from the logits: the per-sequence log-prob sums or means (``get_batch_logps``), the NLL loss (TRL's
  ``CrossEntropyLoss`` mean over the chosen rows: CPO's over the labels, ORPO's over the attended ``input_ids``) and
  the mean logits. The two ``logits`` slots of the returned tuple hold the per-position means over the vocabulary
  (``[B, T, 1]``, CPO; ``[B, T - 1, 1]``, ORPO), whose ``.mean()`` is TRL's mean of the ``[B, T, V]`` logits (the
  trainers read them only through ``.detach().mean()``): a subclass that reads the logits themselves needs TRL's
  forward (``undo()``). ORPO's NLL labels and its log-prob labels are one token per position wherever both are scored
  (checked each call, one host sync); where they differ the positions are scored twice.

Each runs inside the (wrapped) model's forward and the LM head's own (``kltriton.heads``), as the fused head does, so
DDP, FSDP2 and ZeRO-3 gather and reduce the head as in the model's forward. Results are fp32 whatever the model's
dtype (TRL's: the logits' dtype). TRL's own code runs, with one log line naming the reason, for an encoder-decoder
model, vision inputs (Online DPO), the MoE aux loss (CPO, ORPO: it comes from the model's own forward), a PEFT
adapter on the LM head, or a model without an LM head and backbone to read.
"""
import torch

import kltriton
from kltriton import heads
from kltriton.integrations._patch import Patch
from kltriton.integrations.trl import _head_scaling, _log_once


def install(patch: Patch) -> None:
    """Replace ``OnlineDPOTrainer._forward`` and ``CPOTrainer`` / ``ORPOTrainer.concatenated_forward``."""
    from trl.experimental.cpo import cpo_trainer
    from trl.experimental.online_dpo import online_dpo_trainer
    from trl.experimental.orpo import orpo_trainer

    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        reason = "the inputs are multimodal" if vision_inputs is not None else _why_trl_forward(self, model)
        if reason is not None:
            _log_once(f"OnlineDPOTrainer log-probs: TRL's own _forward (the [B, T, V] logits), because {reason}")
            return trl_online_dpo._forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                           vision_inputs)
        _log_once("OnlineDPOTrainer log-probs: kltriton.token_logprobs from the hidden states")
        return _completion_logprobs(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask)

    def cpo_forward(self, model, batch):
        return _preference_forward(self, model, batch, trl_cpo.concatenated_forward, "CPOTrainer")

    def orpo_forward(self, model, batch):
        return _preference_forward(self, model, batch, trl_orpo.concatenated_forward, "ORPOTrainer")

    trl_online_dpo = patch.replace(patch.resolve(online_dpo_trainer, "OnlineDPOTrainer"), _forward=_forward)
    trl_cpo = patch.replace(patch.resolve(cpo_trainer, "CPOTrainer"), concatenated_forward=cpo_forward)
    trl_orpo = patch.replace(patch.resolve(orpo_trainer, "ORPOTrainer"), concatenated_forward=orpo_forward)


def _causal_lm(model):
    """The transformers causal LM inside ``model``'s wrappers (DDP, DeepSpeed, ``torch.compile``) and PEFT's
    ``PeftModel`` (whose adapters sit inside it)."""
    model = heads.unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _why_trl_forward(trainer, model):
    """``None`` when kltriton scores the model from its hidden states, else why TRL's forward runs."""
    causal_lm = _causal_lm(model)
    if trainer.is_encoder_decoder:
        return "the model is an encoder-decoder"
    get_head = getattr(causal_lm, "get_output_embeddings", None)
    if get_head is None or get_head() is None or not hasattr(causal_lm, "base_model"):
        return f"{type(causal_lm).__name__} has no LM head and backbone to read hidden states from"
    scaling = _head_scaling(causal_lm)
    return scaling if isinstance(scaling, str) else None


def _score_in_forward(model, input_ids, attention_mask, positions, fn):
    """``fn(logits)``, ``logits`` the ``LinearLogits`` of the backbone's last hidden states at ``positions`` (a
    slice of ``[0, T)``), computed inside the (wrapped) model's forward and its LM head's."""
    causal_lm = _causal_lm(model)

    def forward(input_ids, attention_mask):
        hidden = causal_lm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                      use_cache=False).last_hidden_state
        return heads.score_with_lm_head(causal_lm, hidden[:, positions], fn)

    return heads.run_in_forward(model, forward, input_ids, attention_mask)


# ---------------------------------------------------------------------------------------------- Online DPO
def _completion_logprobs(trainer, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """TRL's ``OnlineDPOTrainer._forward``: ``[B, C]`` log-probs of ``completion_ids`` after the prompt (left-truncated
    so that prompt and completion fit ``max_length``), at every completion position, padding included."""
    cut = max(prompt_ids.size(1) + completion_ids.size(1) - trainer.max_length, 0)
    prompt_ids, prompt_mask = prompt_ids[:, cut:], prompt_mask[:, cut:]
    input_ids = torch.cat((prompt_ids, completion_ids), dim=1)
    attention_mask = torch.cat((prompt_mask, completion_mask), dim=1)
    # The logits at prompt_len - 1 predict the first completion token; without a prompt TRL scores each completion
    # token on its own position (positions 0 .. C - 1).
    start = max(prompt_ids.size(1) - 1, 0)
    positions = slice(start, start + completion_ids.size(1))
    return _score_in_forward(model, input_ids, attention_mask, positions,
                             lambda logits: kltriton.token_logprobs(logits, completion_ids))


# ---------------------------------------------------------------------------------------------- CPO, ORPO
def _preference_forward(trainer, model, batch, trl_forward, name):
    """``concatenated_forward`` of ``CPOTrainer`` or ``ORPOTrainer`` (``name``): ``(chosen_logps, rejected_logps,
    chosen_logits, rejected_logits, nll_loss)``, the logits as their per-position means ``[B, T(-1), 1]``."""
    reason = "the MoE aux loss is on (it comes from the model's own forward)" if trainer.aux_loss_enabled \
        else _why_trl_forward(trainer, model)
    if reason is not None:
        _log_once(f"{name}.concatenated_forward: TRL's own (the [B, T, V] logits), because {reason}")
        return trl_forward(trainer, model, batch)
    _log_once(f"{name}.concatenated_forward: kltriton.token_logprobs from the hidden states (no [B, T, V] logits; "
              "its logits slots hold their per-position means)")
    orpo = name == "ORPOTrainer"
    padding_value = trainer.padding_value if orpo else trainer.pad_token_id
    concatenated = trainer.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=padding_value,
                                               device=trainer.accelerator.device)
    input_ids, attention_mask = concatenated["concatenated_input_ids"], concatenated["concatenated_attention_mask"]
    labels = concatenated["concatenated_labels"][:, 1:]  # [B, T - 1], -100 where not scored
    # The NLL's labels: CPO's are the labels; ORPO's every attended token, prompt included.
    nll_labels = torch.where(attention_mask[:, 1:] == 1, input_ids[:, 1:], -100) if orpo else labels
    logp, nll_logp, mean_logits = _score_positions(model, input_ids, attention_mask, labels, nll_labels)

    chosen = batch["chosen_labels"].shape[0]
    mask = labels != -100
    logps = (logp * mask).sum(-1)
    if orpo or trainer.loss_type in ("ipo", "simpo"):  # TRL's average_log_prob
        logps = logps / mask.sum(-1)
    if orpo or trainer.cpo_alpha != 0:  # CrossEntropyLoss's mean over the chosen rows' scored tokens
        nll_mask = nll_labels[:chosen] != -100
        nll_loss = -(nll_logp[:chosen] * nll_mask).sum() / nll_mask.sum()
    else:
        nll_loss = torch.tensor(0.0).to(trainer.accelerator.device)
    means = (mean_logits[:, :-1] if orpo else mean_logits).unsqueeze(-1)  # ORPO logs T - 1 positions, CPO all T
    return logps[:chosen], logps[chosen:], means[:chosen], means[chosen:], nll_loss


def _score_positions(model, input_ids, attention_mask, labels, nll_labels):
    """``(logp, nll_logp, mean_logits)``: the log-probs ``[B, T - 1]`` of ``labels`` and of ``nll_labels`` (-100: not
    scored; the value there is a dummy label's, for the caller to mask) and the mean logit ``[B, T]`` of every
    position. One streamed pass when the two label sets agree
    wherever both are scored (CPO's are one tensor), else a second for ``nll_labels``."""
    both = (labels != -100) & (nll_labels != -100)
    one_pass = nll_labels is labels or bool(torch.equal(labels[both], nll_labels[both]))  # a host sync (ORPO)
    merged = torch.where(labels != -100, labels, nll_labels)
    label_sets = [merged] if one_pass else [labels, nll_labels]
    # Every position is scored (the mean logit of the last one and of padding too): -100 and the last
    # position get the dummy label 0.
    label_sets = [torch.nn.functional.pad(x.clamp(min=0), (0, 1)) for x in label_sets]

    def score(logits):
        first = kltriton.token_logprobs(logits, label_sets[0], outputs=("mean_logits",))
        second = first.logp if one_pass else kltriton.token_logprobs(logits, label_sets[1])
        return first.logp, second, first.mean_logits

    logp, nll_logp, mean_logits = _score_in_forward(model, input_ids, attention_mask, slice(None), score)
    return logp[:, :-1], nll_logp[:, :-1], mean_logits
