"""TRL (tested with 1.16): ``GRPOTrainer`` computes its log-probs, entropy and loss with kltriton.

``apply()`` changes two things of ``trl.trainer.grpo_trainer``, and ``undo()`` puts them back:

- ``add_fused_lm_head``, which ``GRPOTrainer.__init__`` calls on the policy and the reference model:
  TRL's head is still added, then wrapped by one whose ``fused_lm_head=True`` call projects only the
  scored positions and scores them with ``kltriton.token_logprobs`` (log-probs and entropy in one pass).
  So call ``apply()`` before building the trainer. After ``undo()`` the wrapped models use TRL's head
  again. Models that need something kltriton's head does not do (MoE router losses, other outputs than
  log-probs and entropy, sharded heads) keep TRL's head, with a log line.
- ``GRPOTrainer._compute_loss``: with a configuration that maps
  onto it (see ``policy_loss_arguments``), the loss is computed from the hidden states by
  ``kltriton.policy_loss``; otherwise TRL's own ``_compute_loss`` runs (on kltriton's log-probs), with
  one log line per reason.
- With ``apply(truncation=True)`` (off by default), also ``GRPOTrainer._get_per_token_logps_and_entropies``
  and ``use_adapter``: the policy's log-probs (current and old, in the head and in the loss) are those of the
  distribution sampled from, ``kltriton.Truncation`` of the config's ``top_k`` / ``top_p`` / ``min_p`` at its
  ``temperature``; the reference model's stay untruncated (see ``sampling_truncation``).

A function rather than a trainer subclass: it also works for trainers built by TRL's CLI and for
users' own ``GRPOTrainer`` subclasses. Nothing is imported before ``apply()`` is called.
"""
import contextlib
import contextvars
import logging
import types
from typing import NamedTuple, Optional

import torch

import kltriton
from kltriton.integrations._patch import Integration, Patch
from kltriton.linear_logits import head_scaling

logger = logging.getLogger(__name__)

_logged = set()

def _install(patch: Patch) -> None:
    """Make ``trl.GRPOTrainer`` compute log-probs, entropy (and, where it maps, the loss) with kltriton.

    Call ``apply()`` before building the trainer.
    """
    from trl.trainer import grpo_trainer

    _logged.clear()  # each apply() logs each fallback reason once
    trl_add_fused_lm_head = patch.resolve(grpo_trainer, "add_fused_lm_head")
    trl_compute_loss = patch.resolve(patch.resolve(grpo_trainer, "GRPOTrainer"), "_compute_loss")

    def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        trl_add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                              outputs=outputs)
        _wrap_fused_head(model, patch, temperature, cast_lm_head_to_fp32, tuple(outputs))

    def _compute_loss(self, model, inputs):
        reason = _why_trl_loss(self, inputs)
        if reason is not None:
            _log_once(f"GRPOTrainer loss: TRL's own code (on kltriton's log-probs), because {reason}")
            return trl_compute_loss(self, model, inputs)
        _log_once(f"GRPOTrainer loss: kltriton.policy_loss from the hidden states (TRL loss_type="
                  f"{self.loss_type!r}, importance_sampling_level={self.importance_sampling_level!r}, "
                  f"beta={self.beta})")
        return _kltriton_loss(self, model, inputs)

    patch.set(grpo_trainer, "add_fused_lm_head", add_fused_lm_head)
    patch.set(grpo_trainer.GRPOTrainer, "_compute_loss", _compute_loss)
    if _switches["truncation"]:
        _install_truncation(patch, grpo_trainer)


_integration = Integration("TRL", _install, package="trl", extra="trl", tested="1.16.0")
undo = _integration.undo
_switches = {"truncation": False}


def apply(*, truncation: bool = False) -> Patch:
    """Make ``trl.GRPOTrainer`` compute with kltriton (call it before building the trainer); returns the ``Patch``
    (``.undo()``, or ``with apply(): ...``).

    Args:
        truncation: score the policy's log-probs under the config's sampling knobs (``top_k``, ``top_p``,
            ``min_p`` at ``temperature``), as ``kltriton.Truncation``: the distribution the completions were
            sampled from, not ``softmax(logits / T)``. Off by default: it changes TRL's numbers. Use it when the
            rollout log-probs are the engine's processed ones (vLLM ``logprobs_mode="processed_logprobs"``).
    """
    _switches["truncation"] = bool(truncation)
    return _integration.apply()


# The Truncation the fused head applies to the call being scored (None: untruncated), set by the patched
# _get_per_token_logps_and_entropies; True in _reference while TRL scores the reference through an adapter.
_truncation = contextvars.ContextVar("kltriton_trl_truncation", default=None)
_reference = contextvars.ContextVar("kltriton_trl_reference", default=False)


def sampling_truncation(trainer) -> Optional["kltriton.Truncation"]:
    """The ``kltriton.Truncation`` of a ``GRPOTrainer``'s sampling knobs, ``None`` when every knob is off."""
    truncation = kltriton.Truncation(top_k=trainer.top_k, top_p=trainer.top_p, min_p=trainer.min_p)
    return None if truncation.disabled else truncation


def _install_truncation(patch: Patch, grpo_trainer) -> None:
    """``apply(truncation=True)``: the policy's log-probs (not the reference's) are scored truncated."""
    trainer_class = patch.resolve(grpo_trainer, "GRPOTrainer")
    trl_logps = patch.resolve(trainer_class, "_get_per_token_logps_and_entropies")
    trl_use_adapter = patch.resolve(grpo_trainer, "use_adapter")

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        policy = model is not self.ref_model and not _reference.get()
        token = _truncation.set(sampling_truncation(self) if policy else None)
        try:
            return trl_logps(self, model, *args, **kwargs)
        finally:
            _truncation.reset(token)

    @contextlib.contextmanager
    def use_adapter(model, adapter_name):  # TRL scores the reference as the policy model with another adapter
        token = _reference.set(True)
        try:
            with trl_use_adapter(model, adapter_name):
                yield
        finally:
            _reference.reset(token)

    patch.set(trainer_class, "_get_per_token_logps_and_entropies", _get_per_token_logps_and_entropies)
    patch.swap("trl", trl_use_adapter, use_adapter)
    _log_once("GRPOTrainer scores the policy's log-probs truncated by its top_k / top_p / min_p "
              "(apply(truncation=True))")


def _log_once(message: str) -> None:
    """One line per message and ``apply()``: what runs (kltriton's head, kltriton's loss or TRL's and why)."""
    if message not in _logged:
        _logged.add(message)
        logger.warning("kltriton: %s", message)


# ---------------------------------------------------------------------------------------------- head
class _Head(NamedTuple):
    """What the LM head needs to score positions: ``hidden [..., H]``, ``weight [V, H]``, ``bias [V]``."""
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]


def _head_scaling(model):
    """``(logit_scale, softcap)`` of the model's LM head (``kltriton.linear_logits.head_scaling``, TRL's reading
    of the config), or a string saying why kltriton's head can't serve the model."""
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        return "the model returns MoE router logits (its load-balancing loss is TRL's)"
    return head_scaling(model.config)


def _wrap_fused_head(model, patch: Patch, temperature, cast_lm_head_to_fp32, outputs):
    """Wrap the ``forward`` TRL's ``add_fused_lm_head`` installed with one that scores through kltriton."""
    scaling = _head_scaling(model)
    if isinstance(scaling, str) or not set(outputs) <= {"log_probs", "entropy"}:
        why = scaling if isinstance(scaling, str) else f"outputs {outputs} were asked for"
        _log_once(f"{type(model).__name__} keeps TRL's fused LM head, because {why}")
        return
    logit_scale, softcap = scaling
    trl_forward = model.forward
    with_entropy = "entropy" in outputs

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not patch.active or fused_lm_head is False:
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        if not isinstance(head.weight, torch.Tensor) or type(head.weight).__name__ == "DTensor":
            raise NotImplementedError("kltriton's TRL head takes an unsharded LM head; undo() the integration "
                                      "for FSDP2 / tensor-parallel heads")
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
        if fused_lm_head == "kltriton":  # the loss path: scored later by kltriton.policy_loss
            return _Head(hidden, head.weight, head.bias)
        return _score(hidden, head.weight, head.bias, labels, logit_scale, softcap, temperature, with_entropy,
                      num_items_in_batch)

    model.forward = types.MethodType(forward, model)
    model._kltriton_head_scaling = (logit_scale, softcap)
    _log_once(f"{type(model).__name__} scores its {' and '.join(outputs)} with kltriton's LM head "
              f"(logit_scale={logit_scale}, softcap={softcap})")


def _score(hidden, weight, bias, labels, logit_scale, softcap, temperature, with_entropy, num_items_in_batch):
    """TRL's ``FusedCausalLMOutput`` for the next-token ``labels`` (-100 = not scored), from kltriton."""
    from trl.trainer.utils import FusedCausalLMOutput

    mask = labels != -100
    logits = kltriton.LinearLogits(hidden[mask], weight, bias, logit_scale=logit_scale, softcap=softcap)
    out = kltriton.token_logprobs(logits, labels[mask], temperature=temperature, return_entropy=with_entropy,
                                  truncation=_truncation.get())
    logp, entropy = out if with_entropy else (out, None)
    # masked_scatter keeps the outputs connected to the model even when no position is scored
    log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
    if entropy is not None:
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                               label_mask=mask)


# ---------------------------------------------------------------------------------------------- loss
# TRL loss_type -> (kltriton loss_type, aggregation); the normalizers TRL applies on top are in _kltriton_loss.
_LOSS_TYPES = {
    "grpo": ("ppo", "seq-mean-token-mean"),
    "bnpo": ("ppo", "token-mean"),
    "dr_grpo": ("ppo", "seq-mean-token-sum-norm"),
    "dapo": ("ppo", "token-sum"),
    "cispo": ("cispo", "token-sum"),
}
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _why_trl_loss(trainer, inputs) -> Optional[str]:
    """``None`` when ``policy_loss_arguments`` covers the trainer's configuration, else the reason it doesn't."""
    args = trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    checks = [
        (trainer.loss_type not in _LOSS_TYPES, f"loss_type={trainer.loss_type!r} has no kltriton equivalent"),
        (trainer.importance_sampling_level == "sequence" and trainer.loss_type != "grpo",
         f"importance_sampling_level='sequence' with loss_type={trainer.loss_type!r}"),
        (trainer.loss_type == "cispo" and trainer.epsilon_high <= 1.0, "CISPO with epsilon_high <= 1"),
        (args.delta is not None and args.delta < 1 + trainer.epsilon_high,
         "delta < 1 + epsilon_high is not a dual clip"),
        (trainer.beta != 0.0 and args.use_bias_correction_kl, "use_bias_correction_kl=True with beta != 0"),
        (trainer.off_policy_mask_threshold is not None, "off_policy_mask_threshold is set"),
        (trainer.top_entropy_quantile < 1.0, "top_entropy_quantile < 1"),
        (trainer._entropy_bonus_enabled, "the entropy bonus is on"),
        (trainer.aux_loss_enabled, "the MoE aux loss is on"),
        (any(inputs.get(k) is not None for k in _MULTIMODAL_KEYS), "the inputs are multimodal"),
        (not hasattr(model, "_kltriton_head_scaling"), "the model kept TRL's fused LM head"),
    ]
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        checks += [
            (trainer.vllm_importance_sampling_clip_min not in (None, 0.0), "vllm_importance_sampling_clip_min is set"),
            (trainer.vllm_importance_sampling_clip_max is None, "vllm_importance_sampling_clip_max is None"),
            (inputs.get("sampling_per_token_logps") is None, "no sampling_per_token_logps in the inputs"),
        ]
    return next((reason for failed, reason in checks if failed), None)


def policy_loss_arguments(trainer, inputs) -> dict:
    """The ``kltriton.policy_loss`` keyword arguments for one ``GRPOTrainer`` micro-batch (mapped config)."""
    loss_type, aggregation = _LOSS_TYPES[trainer.loss_type]
    if trainer.importance_sampling_level == "sequence":
        loss_type = "gspo"
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    kwargs = dict(
        loss_type=loss_type, aggregation=aggregation, mask=mask,
        old_logprobs=inputs.get("old_per_token_logps"),
        clip_low=trainer.epsilon_low, clip_high=trainer.epsilon_high, dual_clip=trainer.args.delta,
        temperature=trainer.temperature,
    )
    if loss_type == "cispo":  # TRL's CISPO caps the ratio at epsilon_high itself and has no lower bound
        kwargs.update(clip_low=1.0, clip_high=trainer.epsilon_high - 1.0)
    if aggregation == "seq-mean-token-sum-norm":
        kwargs["horizon"] = trainer.max_completion_length
    if trainer.beta != 0.0:
        kwargs.update(ref=inputs["ref_per_token_logps"], kl_coef=trainer.beta, kl_estimator="k3")
    if _switches["truncation"]:
        kwargs["truncation"] = sampling_truncation(trainer)
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        old = inputs.get("old_per_token_logps")
        rollout = inputs["sampling_per_token_logps"]
        # TRL gives tokens vLLM could not score (NaN) a weight of 1: their rollout log-prob is the old one.
        kwargs.update(rollout_logprobs=torch.where(torch.isnan(rollout), old, rollout),
                      is_mode=trainer.vllm_importance_sampling_mode,
                      is_cap=trainer.vllm_importance_sampling_clip_max)
    return kwargs


def _kltriton_loss(trainer, model, inputs):
    """``GRPOTrainer._compute_loss`` through ``kltriton.policy_loss``; logs TRL's metrics."""
    completion_ids = inputs["completion_ids"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with trainer.accelerator.autocast():
        head = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head="kltriton")
    logit_scale, softcap = trainer.accelerator.unwrap_model(trainer.model)._kltriton_head_scaling
    k = completion_ids.size(1)
    logits = kltriton.LinearLogits(head.hidden[:, -k:], head.weight, head.bias, logit_scale=logit_scale,
                                   softcap=softcap)
    kwargs = policy_loss_arguments(trainer, inputs)
    out = kltriton.policy_loss(logits, completion_ids, inputs["advantages"], **kwargs)

    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    if kwargs["aggregation"] == "token-sum":  # dapo, cispo: TRL divides by the generation batch's token count
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * accumulation / trainer.args.steps_per_generation
        loss = out.loss / normalizer
    else:
        loss = out.loss / accumulation
    _log_metrics(trainer, mode, out, kwargs["mask"], inputs["advantages"], kwargs["loss_type"])
    return loss


def _log_metrics(trainer, mode, out, mask, advantages, loss_type):
    """TRL's ``kl``, ``entropy`` and clip metrics, from kltriton's per-token outputs."""
    acc = trainer.accelerator
    mask = mask.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    seq_tokens = mask.sum(-1)

    def mean(x):  # over the scored tokens of every process
        totals = acc.reduce(torch.stack([(x * mask).sum(), mask.sum()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def seq_mean(x):  # one value per sequence
        return (x * mask).sum(-1) / seq_tokens

    metrics = trainer._metrics[mode]
    if trainer.beta != 0.0:
        metrics["kl"].append(mean(out.kl))
    metrics["entropy"].append(mean(out.entropy))
    ratio = out.ratio.detach()
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"].append(mean(((ratio > trainer.epsilon_high) & (advantages > 0)).float()))
        return
    low = ((ratio < 1 - trainer.epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + trainer.epsilon_high) & (advantages > 0)).float()
    region = torch.maximum(low, high)
    if loss_type == "gspo":  # TRL averages sequence-level clip flags over sequences, not tokens
        flags = [seq_mean(x) for x in (low, high, region)]
        totals = acc.reduce(torch.stack([f.nansum() for f in flags] + [(seq_tokens > 0).sum().float()]), "sum")
        means = [(t / totals[3].clamp(min=1.0)).item() for t in totals[:3]]
    else:
        means = [mean(x) for x in (low, high, region)]
    metrics["clip_ratio/low_mean"].append(means[0])
    metrics["clip_ratio/high_mean"].append(means[1])
    metrics["clip_ratio/region_mean"].append(means[2])
    metrics["clip_ratio/low_min"].append(_nan_reduce(acc.gather(seq_mean(low)), torch.min))
    metrics["clip_ratio/high_max"].append(_nan_reduce(acc.gather(seq_mean(high)), torch.max))


def _nan_reduce(x, fn) -> float:
    x = x[~torch.isnan(x)]
    return float("nan") if x.numel() == 0 else fn(x).item()
