"""TRL (tested with 1.16): ``GRPOTrainer`` computes its log-probs, entropy and loss with kltriton, and the
distillation trainers their divergence.

``apply()`` changes two things of ``trl.trainer.grpo_trainer``, three of TRL's distillation (below), and
``undo()`` puts them back:

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

Distillation (``kltriton.token_divergence`` from the models' hidden states, never the ``[B, T, V]`` logits):

- ``GKDTrainer.compute_loss`` (``trl.experimental.gkd``): the student's and the teacher's backbones give hidden
  states, their LM heads become ``LinearLogits``, and the loss is the generalized JSD of TRL's
  ``generalized_jsd_loss`` (its ``beta``, temperature 1 and ``batchmean`` reduction, or ``sum / num_items_in_batch``)
  with the student's gradient written in the forward. TRL's own ``compute_loss`` runs, with a log line, where the
  caller wants the student's outputs (``return_outputs=True``), for MoE models, sharded heads or multimodal inputs.
- ``GKDTrainer.generalized_jsd_loss``: the same function on logits; ``reduction="none"`` (TRL returns the
  elementwise ``[M, V]`` terms) runs TRL's own code, with a log line.
- ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (``DistillationTrainer``'s loss): the same signature
  and results (loss, the student's entropy sum, the scored count); TRL's own for sharded (``DTensor``) heads.

A function rather than a trainer subclass: it also works for trainers built by TRL's CLI and for
users' own ``GRPOTrainer`` subclasses. Nothing is imported before ``apply()`` is called.
"""
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
    _install_distillation(patch)


_integration = Integration("TRL", _install, package="trl", extra="trl", tested="1.16.0")
apply = _integration.apply
undo = _integration.undo


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
    out = kltriton.token_logprobs(logits, labels[mask], temperature=temperature, return_entropy=with_entropy)
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


# ---------------------------------------------------------------------------------------------- distillation
def _install_distillation(patch: Patch) -> None:
    """``GKDTrainer.compute_loss`` / ``generalized_jsd_loss`` and ``DistillationTrainer``'s divergence loss."""
    from trl.experimental.gkd import gkd_trainer
    from trl.models.utils import _ForwardRedirection
    from trl.trainer import distillation_trainer

    gkd = patch.resolve(gkd_trainer, "GKDTrainer")
    trl_gkd_compute_loss = patch.resolve(gkd, "compute_loss")
    trl_jsd = patch.resolve(gkd, "generalized_jsd_loss")
    trl_chunked = patch.resolve(distillation_trainer, "_chunked_divergence_loss")
    redirect = _ForwardRedirection()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        reason = _why_trl_gkd(self, model, inputs, return_outputs)
        if reason is not None:
            _log_once(f"GKDTrainer loss: TRL's own code, because {reason}")
            return trl_gkd_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        _log_once(f"GKDTrainer loss: kltriton.token_divergence (generalized JSD, beta={self.beta}) from the hidden "
                  "states")
        student = self.accelerator.unwrap_model(model)
        # Through the wrapper's forward (DDP / FSDP hooks), as TRL's DistillationTrainer does.
        return redirect(model, student, _gkd_loss, self, student, inputs, num_items_in_batch)

    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean", num_items_in_batch=None):
        if reduction not in ("batchmean", "sum", "mean") and num_items_in_batch is None:
            _log_once(f"GKDTrainer.generalized_jsd_loss: TRL's own code, because reduction={reduction!r} returns "
                      "the elementwise terms")
            return trl_jsd(student_logits, teacher_logits, labels=labels, beta=beta, temperature=temperature,
                           reduction=reduction, num_items_in_batch=num_items_in_batch)
        return _jsd_loss(student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch)

    def chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                                student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                                teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                teacher_final_logit_softcapping=None, temperature=1.0):
        args = (student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias,
                student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
                teacher_final_logit_softcapping, temperature)
        if any(_is_sharded(w) for w in (student_lm_head_weight, teacher_lm_head_weight)):
            _log_once("DistillationTrainer loss: TRL's own chunked kernels, because the LM heads are sharded "
                      "(DTensor)")
            return trl_chunked(*args)
        _log_once(f"DistillationTrainer loss: kltriton.token_divergence (generalized JSD, beta={beta}) from the "
                  "hidden states")
        return _distillation_loss(*args)

    patch.set(gkd, "compute_loss", compute_loss)
    patch.set(gkd, "generalized_jsd_loss", staticmethod(generalized_jsd_loss))
    patch.set(distillation_trainer, "_chunked_divergence_loss", chunked_divergence_loss)


def _is_sharded(tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _jsd_loss(student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch):
    """TRL's ``generalized_jsd_loss`` (a reduced loss) by ``kltriton.token_divergence``: ``labels`` ``-100`` are not
    scored (None: every position, and ``batchmean`` divides by the batch size, as TRL's ``jsd.size(0)``)."""
    if labels is None:
        labels = torch.zeros(student_logits.shape[:-1], dtype=torch.long, device=student_logits.device)
        if reduction == "batchmean" and num_items_in_batch is None:
            num_items_in_batch = max(student_logits.shape[0], 1)
    if num_items_in_batch is not None:
        total = kltriton.token_divergence(student_logits, teacher_logits, labels, divergence="jsd", beta=beta,
                                          temperature=temperature, reduction="sum")
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return kltriton.token_divergence(student_logits, teacher_logits, labels, divergence="jsd", beta=beta,
                                     temperature=temperature, reduction=reduction)


_MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")


def _why_trl_gkd(trainer, model, inputs, return_outputs) -> Optional[str]:
    """``None`` when kltriton computes ``GKDTrainer``'s loss from the hidden states, else why TRL's code runs."""
    if return_outputs:
        return "the caller asked for the student's outputs (return_outputs=True)"
    for name, m in (("student", trainer.accelerator.unwrap_model(model)),
                    ("teacher", trainer.accelerator.unwrap_model(trainer.teacher_model))):
        head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        if head is None or not hasattr(m, "base_model"):
            return f"the {name} model has no LM head and backbone to read hidden states from"
        if _is_sharded(head.weight):
            return f"the {name}'s LM head is sharded (DTensor)"
        if isinstance(_head_scaling(m), str):
            return f"the {name}: {_head_scaling(m)}"
    if any(inputs.get(k) is not None for k in _MULTIMODAL_INPUTS):
        return "the inputs are multimodal"
    return None


def _head_logits(model, input_ids, attention_mask):
    """The model's next-token logits as ``LinearLogits``: its backbone's hidden states (the last position dropped)
    and its LM head, with the head's scaling from the config."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    logit_scale, softcap = _head_scaling(model)
    return kltriton.LinearLogits(hidden[:, :-1].to(head.weight.dtype), head.weight, head.bias,
                                 logit_scale=logit_scale, softcap=softcap)


def _gkd_loss(trainer, student, inputs, num_items_in_batch):
    """``GKDTrainer.compute_loss`` by ``kltriton.token_divergence``: TRL's causal shift, ``generalized_jsd_loss`` with
    the trainer's ``beta`` at temperature 1 (as TRL calls it), ``batchmean`` or ``sum / num_items_in_batch``."""
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    teacher.eval()
    student_logits = _head_logits(student, inputs["input_ids"], inputs["attention_mask"])
    with torch.no_grad():
        teacher_logits = _head_logits(teacher, inputs["input_ids"], inputs["attention_mask"])
    return _jsd_loss(student_logits, teacher_logits, inputs["labels"][:, 1:], trainer.beta, 1.0, "batchmean",
                     num_items_in_batch)


def _distillation_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                       completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias,
                       student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
                       teacher_final_logit_softcapping, temperature):
    """``DistillationTrainer``'s ``_chunked_divergence_loss`` by ``kltriton.token_divergence``: ``(loss, the student's
    entropy summed over the scored positions, their count)``, the loss ``sum / count`` (clamped at 1) or
    ``sum / num_items_in_batch``."""
    mask = completion_mask != 0
    labels = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    student = kltriton.LinearLogits(student_hidden_states, student_lm_head_weight, student_lm_head_bias,
                                    logit_scale=float(student_logit_scale), softcap=student_final_logit_softcapping)
    teacher = kltriton.LinearLogits(teacher_hidden_states.to(teacher_lm_head_weight.dtype), teacher_lm_head_weight,
                                    teacher_lm_head_bias, logit_scale=float(teacher_logit_scale),
                                    softcap=teacher_final_logit_softcapping)
    total, entropy = kltriton.token_divergence(student, teacher, labels, divergence="jsd", beta=beta,
                                               temperature=temperature, reduction="sum", mask=mask,
                                               return_entropy=True)
    count = mask.sum()
    if num_items_in_batch is None:
        loss = total / count.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        loss = total / num_items_in_batch
    return loss, entropy.sum(), count
