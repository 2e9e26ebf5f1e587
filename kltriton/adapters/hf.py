"""Hugging Face causal LMs: per-token log-probs (and KL against a reference) through kltriton's kernels.

The backbone runs once; its LM head is handed to the kernels as a ``kltriton.LinearLogits`` (with the
softcap / logit scale of the model's config), so no logits are built at all: only the scored
positions are projected, in tiles, and the log-probs come from the fused kernels. The model may be wrapped
(DDP, FSDP2, a DeepSpeed engine): the scoring runs inside its forward and its LM head's (``kltriton.heads``).
transformers is never imported here: the model object brings it.
"""
from typing import NamedTuple, Optional

import torch

from kltriton import heads
from kltriton.functional.token_kl import token_kl
from kltriton.functional.token_logprobs import token_logprobs
from kltriton.linear_logits import LinearLogits, head_scaling


class CausalLMLogprobs(NamedTuple):
    """Outputs aligned with ``input_ids`` (shape ``S``, fp32, 0 where not scored): position ``t``
    holds the value for the *next* token ``input_ids[t + 1]``, as ``shift_labels=True`` does."""
    logprobs: torch.Tensor                  # S: log p(input_ids[t + 1] | input_ids[:t + 1])
    kl: Optional[torch.Tensor] = None       # S: estimator(logprobs, ref_logprobs), with ref_model
    ref_logprobs: Optional[torch.Tensor] = None  # S: the reference model's log-probs, with ref_model


def _scored_positions(input_ids, attention_mask, position_ids, response_mask):
    """Bool ``S``: position ``t`` is scored iff ``t + 1`` is a real token of the same sequence
    (and ``response_mask[t + 1]``), and ``t`` itself is a real token."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    scored = torch.zeros_like(real)
    scored[..., :-1] = real[..., :-1] & real[..., 1:]
    if position_ids is not None:  # packed: the next token must continue the same sequence
        scored[..., :-1] &= position_ids[..., 1:] == position_ids[..., :-1] + 1
    if response_mask is not None:
        scored[..., :-1] &= response_mask[..., 1:].bool()
    return scored


def _positions_from_cu_seqlens(cu_seqlens, n, device):
    """``[N]`` position ids restarting at 0 at every offset of ``cu_seqlens``."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=n)
    return torch.arange(n, device=device) - starts


def _backbone(model, input_ids, attention_mask, position_ids):
    """The last hidden states of ``model`` (unwrapped) on the inputs."""
    return model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state


def _scored(model, inputs, fn):
    """``fn(logits)``, ``logits`` the model's ``LinearLogits``, computed inside the model's forward (through whatever
    wraps it: DDP, FSDP2, a DeepSpeed engine) and its LM head's forward (``kltriton.heads``), so the wrapper gathers
    and reduces the head as in the model's own forward."""
    inner = heads.unwrap_model(model)

    def forward(*inputs):
        return heads.score_with_lm_head(inner, _backbone(inner, *inputs), fn)

    return heads.run_in_forward(model, forward, *inputs)


def _reference_logits(model, inputs) -> LinearLogits:
    """The reference model's ``LinearLogits`` (no gradient): its backbone run through its wrapper's forward, its head
    a gathered copy when sharded (``kltriton.heads.lm_head_logits``)."""
    inner = heads.unwrap_model(model)

    def forward(*inputs):
        logits = heads.lm_head_logits(inner, _backbone(inner, *inputs))
        return logits.hidden, logits.weight, logits.bias  # tensors: what a wrapper's output hooks expect

    with torch.no_grad():
        hidden, weight, bias = heads.run_in_forward(model, forward, *inputs)
    scale, softcap = head_scaling(inner.config)
    return LinearLogits(hidden, weight, bias, logit_scale=scale, softcap=softcap)


def causal_lm_logprobs(model, input_ids, attention_mask=None, *, cu_seqlens=None, position_ids=None,
                       response_mask=None, temperature: float = 1.0, ref_model=None, estimator: str = "k1",
                       kl_clamp: Optional[float] = None, backend: Optional[str] = None) -> CausalLMLogprobs:
    """Log-probs of every next token under a causal LM (and the KL against ``ref_model``).

    Args:
        model: a transformers causal LM (``...ForCausalLM``), plain or wrapped (DDP, FSDP2, a DeepSpeed
            engine): scored inside its forward and its LM head's (``kltriton.heads``).
        input_ids: padded ``[B, T]``, or packed ``[1, N]`` / ``[N]`` with ``cu_seqlens`` or
            ``position_ids`` restarting at 0 for every sequence.
        attention_mask: padded layout only, ``[B, T]`` (1 = real token; left or right padding).
            Position ids then count real tokens only, so padding never shifts them.
        cu_seqlens: packed layout, ``[num_seqs + 1]`` offsets; position ids are derived from it.
        position_ids: optional, shape of ``input_ids``. Packed inputs are run with no 2-D mask so
            transformers isolates the sequences from the position ids (block-diagonal attention).
        response_mask: optional bool, shape of ``input_ids``: the tokens whose log-prob is request
            (e.g. the response); position ``t`` is scored iff ``response_mask[t + 1]``.
        temperature: log-probs of ``softmax(logits / temperature)`` for both models.
        ref_model: optional reference causal LM, plain or wrapped; run without gradient (a sharded head is
            gathered into a copy).
        estimator, kl_clamp, backend: as in ``kltriton.token_kl``.

    Returns:
        ``CausalLMLogprobs(logprobs, kl, ref_logprobs)``, fp32 with the shape of ``input_ids``,
        position ``t`` scoring ``input_ids[t + 1]``, 0 where not scored (``kl`` and ``ref_logprobs``
        are None without ``ref_model``). Gradients reach ``model``'s parameters through ``logprobs``
        and ``kl``.
    """
    shape = input_ids.shape
    packed = cu_seqlens is not None or (position_ids is not None and attention_mask is None
                                        and (input_ids.dim() == 1 or input_ids.shape[0] == 1))
    if packed:
        if attention_mask is not None:
            raise ValueError("packed inputs (cu_seqlens) take no attention_mask")
        input_ids = input_ids.reshape(1, -1)
        if position_ids is None:
            position_ids = _positions_from_cu_seqlens(cu_seqlens, input_ids.shape[1], input_ids.device)
        position_ids = position_ids.reshape(1, -1)
    elif attention_mask is not None and position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    flat_response = None if response_mask is None else response_mask.reshape(input_ids.shape)
    scored = _scored_positions(input_ids, attention_mask, position_ids if packed else None, flat_response)
    labels = torch.full_like(input_ids, -100)
    labels[..., :-1] = input_ids[..., 1:]
    labels = labels.masked_fill(~scored, -100)

    inputs = (input_ids, attention_mask, position_ids)
    if ref_model is None:
        logp = _scored(model, inputs, lambda logits: token_logprobs(logits, labels, temperature=temperature,
                                                                   backend=backend))
        return CausalLMLogprobs(logp.reshape(shape))
    ref_logits = _reference_logits(ref_model, inputs)
    kl, logp, ref_logp = _scored(model, inputs, lambda logits: tuple(token_kl(
        logits, ref_logits, labels, estimator=estimator, kl_clamp=kl_clamp, temperature=temperature,
        backend=backend)))
    return CausalLMLogprobs(logp.reshape(shape), kl.reshape(shape), ref_logp.reshape(shape))
