"""TRL 1.16's experimental trainers that run the whole model and read its ``[B, T, V]`` logits, scored from the hidden
states instead; installed by ``kltriton.integrations.trl.apply()`` (and undone with it).

- ``OnlineDPOTrainer._forward`` (``trl.experimental.online_dpo``): the completion tokens' log-probs ``[B, C]``, TRL's
  ``log_softmax`` + ``take_along_dim`` on the logits (no temperature: TRL applies it only when generating), become
  ``kltriton.token_logprobs`` of the backbone's last hidden states through the LM head as a ``LinearLogits``, with
  TRL's left truncation to ``max_length`` and its positions (``prompt_len - 1`` on, or from 0 without a prompt),
  padding included. The policy's log-probs take a gradient; the reference's are scored under TRL's ``no_grad``.
Each runs inside the (wrapped) model's forward and the LM head's own (``kltriton.heads``), as the fused head does, so
DDP, FSDP2 and ZeRO-3 gather and reduce the head as in the model's forward. Results are fp32 whatever the model's
dtype (TRL's: the logits' dtype). TRL's own code runs, with one log line naming the reason, for an encoder-decoder
model, vision inputs, a PEFT adapter on the LM head, or a model without an LM head and backbone to read.
"""
import torch

import kltriton
from kltriton import heads
from kltriton.integrations._patch import Patch
from kltriton.integrations.trl import _head_scaling, _log_once


def install(patch: Patch) -> None:
    """Replace ``OnlineDPOTrainer._forward``."""
    from trl.experimental.online_dpo import online_dpo_trainer

    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        reason = "the inputs are multimodal" if vision_inputs is not None else _why_trl_forward(self, model)
        if reason is not None:
            _log_once(f"OnlineDPOTrainer log-probs: TRL's own _forward (the [B, T, V] logits), because {reason}")
            return trl_online_dpo._forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                           vision_inputs)
        _log_once("OnlineDPOTrainer log-probs: kltriton.token_logprobs from the hidden states")
        return _completion_logprobs(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask)

    trl_online_dpo = patch.replace(patch.resolve(online_dpo_trainer, "OnlineDPOTrainer"), _forward=_forward)


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
