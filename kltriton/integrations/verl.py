"""verl (tested with 0.9.1): its log-prob and entropy helpers and its fused-kernels forward run on kltriton, and
its registered policy losses are offered through ``kltriton.policy_loss``.

``apply()`` changes, in verl and in every loaded verl module that imported them by name (and in those imported
later):

- ``logprobs_from_logits(logits, labels, inplace_backward=True)``: ``kltriton.token_logprobs``.
  ``inplace_backward`` (flash-attn's option to write the gradient into the logits) is accepted and
  ignored: kltriton never writes into its inputs.
- ``entropy_from_logits(logits)`` and ``entropy_from_logits_with_chunking(logits, chunk_size)``: the
  entropy from the same streaming pass (no ``[N, V]`` softmax, so no chunking is needed).
- ``verl.models.transformers.monkey_patch.patch_forward_with_backends``: ``use_fused_kernels=True`` with
  ``fused_kernel_options.impl_backend="kltriton"`` (verl's ``fused_kernels_backend``, today ``triton`` / ``torch``
  / ``liger``) gives the actor's causal LM a forward that scores its log-probs and entropy from the hidden states
  with ``kltriton.LinearLogits`` (never the ``[N, V]`` logits; the LM head's scale and softcap read from the
  config as TRL does). Vision-language models, whose forwards verl writes per model, keep the ``torch``
  backend, with a log line.

All return fp32 whatever the logits' dtype (verl returns the logits' dtype for bf16 logits).

The policy losses: ``policy_loss_arguments(config)`` turns an actor config (``ActorConfig``: ``policy_loss.loss_mode``,
the clip ratios, ``clip_ratio_c``, ``tau_pos`` / ``tau_neg``, the ``policy_loss`` parameters, ``loss_agg_mode``,
``global_batch_info``, the KL loss and the entropy coefficient) into ``kltriton.policy_loss`` keyword
arguments, for every name of verl's ``POLICY_LOSS_REGISTRY``: a caller with logits or hidden states computes the
actor's loss in one fused call, ``kltriton.policy_loss(logits, labels, advantages, old_logprobs=...,
**policy_loss_arguments(config))``, and ``pg_metrics(out)`` gives verl's metric names. verl 0.9.1's own actor
computes its loss after its forward, from log-probs (``workers/utils/losses.ppo_loss``): there the registry's
functions run on the log-probs kltriton produced, and their gradient flows back through kltriton's backward.

Distillation (``verl/trainer/distillation``):

- ``fsdp.losses.compute_forward_kl_topk``, the ``forward_kl_topk`` loss's logits processor: the per-token loss by
  ``kltriton.token_divergence`` with a ``kltriton.TopK`` teacher (``tail="none"``: verl's sum over the top-k ids
  without a tail, ``min_logprob`` its ``log_prob_min_clamp``), i.e. the student's streamed log-sum-exp and a
  ``K``-column gather instead of a ``[N, V]`` ``log_softmax``; the diagnostics (student / teacher top-k mass,
  overlap) from the student's logits without gradient, as verl does. verl's own with Ulysses sequence parallelism
  (its slicing), with a log line. Megatron's vocab-parallel version is not patched (it needs Megatron's groups).
- the estimator losses registered under ``kl``, ``k1``, ``abs``, ``mse``, ``k2``, ``low_var_kl``, ``k3``
  (``register_distillation_loss``): ``get_distillation_loss_fn`` returns kltriton's, which scores the student's
  log-probs against the teacher's with ``kltriton.estimators`` (verl's ``kl_penalty`` names and clamp). They
  receive log-probs, so there is no vocab pass to fuse: the log-probs come from kltriton's
  ``logprobs_from_logits`` above.

``undo()`` (or leaving ``with apply():``) restores verl's functions everywhere (a model whose forward was
already switched to the kltriton backend keeps it, as verl's own backends do).
"""
import logging
from typing import Optional

import torch

import kltriton
from kltriton import dropins, estimators, heads
from kltriton.integrations._patch import Integration, Patch
from kltriton.linear_logits import head_scaling

logger = logging.getLogger(__name__)

# verl writes the forwards of these model types itself (vision inputs): they keep its torch backend.
_OWN_FORWARDS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe")


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl's ``logprobs_from_logits`` on kltriton: fp32 log-prob of ``labels`` (every position scored)."""
    return dropins.logprobs_of_labels(logits, labels)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits`` on kltriton: fp32 entropy of ``softmax(logits)``, differentiable."""
    return dropins.entropy_from_logits(logits)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl's chunked entropy on kltriton; ``chunk_size`` is accepted and not needed."""
    return dropins.entropy_from_logits(logits)


# ------------------------------------------------------------------------------ fused-kernels forward
def forward_with_kltriton_backend(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                                  inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                                  output_hidden_states=None, return_dict=None, cache_position=None,
                                  logits_to_keep=0, temperature: float = 1.0, shift_labels=None, **loss_kwargs):
    """verl's ``forward_with_torch_backend`` (``models/transformers/dense_common.py``) with the log-probs and entropy
    of the next tokens scored by ``kltriton.token_logprobs`` on ``LinearLogits(hidden, lm_head)``: fp32,
    differentiable w.r.t. the hidden states and the LM head. Scored inside the LM head's forward
    (``kltriton.score_with_lm_head``), so FSDP2 unshards the head in any wrapping. Under Ulysses sequence
    parallelism the engine passes ``shift_labels``: the input ids rolled over the whole packed sequence, then split
    like the hidden states (verl #6068); rolling the local slice instead would score each slice's last token on its
    own first one."""
    from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model

    outputs = forward_base_model(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                                 return_dict=return_dict, cache_position=cache_position)
    if not return_dict:
        raise NotImplementedError("forward_with_kltriton_backend has to return_dict")
    if shift_labels is not None:  # labels the engine already rolled over the whole sequence (verl issue #6068)
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise RuntimeError("To use forward_with_kltriton_backend, either labels or input_ids must be provided.")
    # Scored inside the LM head module's forward: FSDP2 unshards the head whatever unit holds it (verl wraps the
    # decoder layers, the untied embeddings and the root), in its param_dtype, and reduces its gradient.
    log_probs, entropy = heads.score_with_lm_head(self, outputs[0], lambda logits: kltriton.token_logprobs(
        logits, rolled, temperature=temperature, return_entropy=True))
    return CausalLMOutputForPPO(log_probs=log_probs, entropy=entropy, past_key_values=outputs.past_key_values,
                                hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _patch_forward(verl_patch_forward):
    def patch_forward_with_backends(model, use_fused_kernels: bool = False, fused_kernels_backend: str = None):
        """verl's ``patch_forward_with_backends`` with one more backend, ``"kltriton"``."""
        if not (use_fused_kernels and fused_kernels_backend == "kltriton"):
            return verl_patch_forward(model, use_fused_kernels=use_fused_kernels,
                                      fused_kernels_backend=fused_kernels_backend)
        scaling = head_scaling(model.config)
        if model.config.model_type in _OWN_FORWARDS or isinstance(scaling, str):
            why = scaling if isinstance(scaling, str) else f"verl writes the {model.config.model_type} forward itself"
            logger.warning("kltriton: %s keeps verl's torch fused-kernels backend, because %s",
                           type(model).__name__, why)
            return verl_patch_forward(model, use_fused_kernels=True, fused_kernels_backend="torch")
        model._verl_fused_kernels_backend = "kltriton"
        model.__class__.forward = forward_with_kltriton_backend
        logger.warning("kltriton: %s scores its log-probs and entropy from the hidden states with kltriton "
                       "(fused_kernels_backend='kltriton')", type(model).__name__)

    return patch_forward_with_backends


# ------------------------------------------------------------------------------ the policy losses
def _get(config, name, default=None):
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


def policy_loss_arguments(config, *, loss_mode: Optional[str] = None, loss_agg_mode: Optional[str] = None,
                          global_batch_info: Optional[dict] = None, response_length: Optional[int] = None) -> dict:
    """``kltriton.policy_loss`` keyword arguments that compute the policy loss ``config`` (verl's ``ActorConfig``)
    names, as ``workers/utils/losses.ppo_loss`` adds it up: the registered policy loss (``loss_mode``: default
    ``config.policy_loss.loss_mode``) aggregated by ``loss_agg_mode`` (default ``config.loss_agg_mode``) with
    ``global_batch_info`` (default ``config.global_batch_info``), plus ``kl_loss_coef`` times the KL loss
    (``use_kl_loss``: the caller passes ``ref=``) and minus ``entropy_coeff`` times the entropy.
    ``response_length``: the padded length ``T`` of a packed batch (``seq-mean-token-sum-norm``'s default divisor).

    verl's own deviations, kept: the policy term of ``sapo`` aggregates ``seq-mean-token-mean`` whatever
    ``loss_agg_mode`` says, and ``geo_mean``'s averages over the local sequences (``pg_aggregation``);
    ``low_var_kl`` (k3) is clamped to [-10, 10]."""
    policy = _get(config, "policy_loss", {})
    mode = loss_mode or _get(policy, "loss_mode", "vanilla")
    clip = _get(config, "clip_ratio", 0.2)
    kwargs = dict(loss_type=mode, clip_low=_get(config, "clip_ratio_low", clip),
                  clip_high=_get(config, "clip_ratio_high", clip),
                  aggregation=loss_agg_mode or _get(config, "loss_agg_mode", "token-mean"))
    info = dict(_get(config, "global_batch_info", {}) if global_batch_info is None else global_batch_info)
    dp_size = info.get("dp_size") or 1
    if info.get("batch_num_tokens") is not None:  # verl multiplies by dp_size: the local share of the batch
        kwargs["batch_num_tokens"] = info["batch_num_tokens"] / dp_size
    if info.get("global_batch_size") is not None:
        kwargs["global_batch_size"] = info["global_batch_size"] / dp_size
    if info.get("loss_scale_factor") is not None:
        kwargs["horizon"] = info["loss_scale_factor"]
    elif response_length is not None:
        kwargs["horizon"] = response_length
    correction = _get(policy, "rollout_correction", {})
    if mode == "vanilla" or (mode == "bypass_mode" and _get(correction, "loss_type", "ppo_clip") == "ppo_clip"):
        kwargs["dual_clip"] = _get(config, "clip_ratio_c", 3.0)
    elif mode in ("dppo_tv", "dppo_kl"):
        kwargs["clip_ratio_c"] = _get(config, "clip_ratio_c", 20.0)
    elif mode == "sapo":
        kwargs.update(tau_pos=_get(config, "tau_pos", 1.0), tau_neg=_get(config, "tau_neg", 1.05),
                      pg_aggregation="seq-mean-token-mean")
    elif mode == "clip_cov":
        kwargs.update(clip_cov_ratio=_get(policy, "clip_cov_ratio", 0.0002), clip_cov_lb=_get(policy, "clip_cov_lb", 1.0),
                      clip_cov_ub=_get(policy, "clip_cov_ub", 5.0))
    elif mode == "kl_cov":
        kwargs.update(kl_cov_ratio=_get(policy, "kl_cov_ratio", 0.0002), ppo_kl_coef=_get(policy, "ppo_kl_coef", 1.0))
    elif mode == "dro":
        kwargs["dro_beta"] = _get(policy, "dro_beta")
    elif mode == "geo_mean":  # verl: torch.mean over the local sequences, whatever loss_agg_mode says
        kwargs["pg_aggregation"] = "seq-mean-token-mean"
    if mode == "bypass_mode":
        kwargs.update(_bypass_arguments(correction))
    if _get(config, "use_kl_loss", False):
        kl_type = _get(config, "kl_loss_type", "low_var_kl")
        kwargs.update(kl_coef=_get(config, "kl_loss_coef", 0.001), kl_estimator=kl_type)
        if kl_type.rstrip("+") in ("low_var_kl", "k3"):
            kwargs["kl_clamp"] = 10.0
    if _get(config, "entropy_coeff", 0.0):
        kwargs["entropy_coef"] = float(_get(config, "entropy_coeff"))
    return kwargs


def _bypass_arguments(correction) -> dict:
    """verl's ``rollout_correction`` of ``bypass_mode``: the loss type and the rollout IS weights of the
    REINFORCE variant (token / sequence, truncated at the threshold, or IcePop's ``"lower_upper"`` window)."""
    kind = _get(correction, "loss_type", "ppo_clip")
    if _get(correction, "rollout_rs") is not None or _get(correction, "rollout_is_batch_normalize", False):
        raise NotImplementedError("bypass_mode with rollout_rs (rejection sampling) or rollout_is_batch_normalize "
                                  "has no kltriton.policy_loss equivalent; use verl's own function")
    kwargs = {"bypass_loss_type": kind}
    level = _get(correction, "rollout_is")
    if kind == "reinforce" and level is not None:
        threshold = _get(correction, "rollout_is_threshold", 2.0)
        if isinstance(threshold, str) and "_" in threshold:
            low, high = (float(v) for v in threshold.split("_", 1))
            kwargs.update(is_mode=f"{level}_mask", is_min=low, is_cap=high)
        else:
            kwargs.update(is_mode=f"{level}_truncate", is_cap=float(threshold))
    return kwargs


def pg_metrics(out) -> dict:
    """verl's policy-loss metric names from a ``kltriton.policy_loss`` output (0-dim tensors)."""
    return {"actor/pg_clipfrac": out.metrics["clipfrac"], "actor/ppo_kl": out.metrics["ppo_kl"],
            "actor/pg_clipfrac_lower": out.metrics["clipfrac_lower"], "actor/pg_loss": out.metrics["pg_loss"]}


def _install(patch: Patch) -> None:
    """Make verl compute log-probs and entropy with kltriton and accept the ``kltriton`` fused-kernels backend."""
    import verl.models.transformers.monkey_patch as monkey_patch
    import verl.utils.torch_functional as verl_F

    patch.swap("verl", patch.resolve(verl_F, "logprobs_from_logits"), logprobs_from_logits)
    patch.swap("verl", patch.resolve(verl_F, "entropy_from_logits"), entropy_from_logits)
    patch.swap("verl", patch.resolve(verl_F, "entropy_from_logits_with_chunking"), entropy_from_logits_with_chunking)
    patch.set(monkey_patch, "patch_forward_with_backends",
              _patch_forward(patch.resolve(monkey_patch, "patch_forward_with_backends")))
    _install_distillation(patch)


# ---------------------------------------------------------------------------------------------- distillation
ESTIMATOR_LOSSES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
K3_CLAMP = 10.0  # verl's kl_penalty clamps k3 to [-10, 10] (and its log-ratio to [-20, 20], which never binds first)
DIAGNOSTIC_CHUNK = 1 << 22  # logits per chunk of the no-gradient diagnostics


def _install_distillation(patch: Patch) -> None:
    import verl.trainer.distillation.fsdp.losses as fsdp_losses
    import verl.trainer.distillation.losses as losses
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

    _logged.clear()  # each apply() logs each route once
    verl_get_fn = patch.resolve(losses, "get_distillation_loss_fn")
    verl_topk = patch.resolve(fsdp_losses, "compute_forward_kl_topk")

    def get_distillation_loss_fn(loss_name):
        if loss_name in ESTIMATOR_LOSSES:
            return estimator_distillation_loss
        return verl_get_fn(loss_name)

    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        if get_ulysses_sequence_parallel_world_size() > 1:
            _log_once("forward_kl_topk: verl's own, because Ulysses sequence parallelism slices the teacher's top-k")
            return verl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        _log_once("forward_kl_topk: kltriton.token_divergence with a TopK teacher")
        return forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids,
                               config.distillation_loss.log_prob_min_clamp)

    patch.swap("verl", verl_get_fn, get_distillation_loss_fn)
    patch.set(fsdp_losses, "compute_forward_kl_topk", compute_forward_kl_topk)


_logged = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("kltriton: %s", message)


def estimator_distillation_loss(config, distillation_config, model_output, data):
    """verl's ``compute_distillation_loss_reverse_kl_estimator`` on ``kltriton.estimators``: ``(losses [B, T],
    metrics)`` of the student's log-probs against the teacher's, with verl's metric."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    student = no_padding_2_padding(model_output["log_probs"], data)
    teacher = no_padding_2_padding(data["teacher_logprobs"], data).squeeze(-1)
    mask = data["response_mask"]
    mask = (mask.bool().to_padded_tensor(False) if mask.is_nested else mask.bool())
    name = distillation_config.distillation_loss.loss_mode
    estimator = estimators.parse(name, ref_logits=False)
    losses = estimator.value(student, teacher, kl_clamp=K3_CLAMP if estimator.base == "k3" else None)
    return losses, {"distillation/abs_loss": Metric(AggregationType.MEAN, losses[mask].abs().mean())}


def forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp):
    """verl's ``fsdp.losses.compute_forward_kl_topk`` by ``kltriton.token_divergence``: the same dict of ``[1, nnz]``
    tensors (``distillation_losses`` differentiable w.r.t. ``student_logits``, the diagnostics without gradient)."""
    teacher_lp = teacher_topk_log_probs.values().unsqueeze(0) if teacher_topk_log_probs.is_nested \
        else teacher_topk_log_probs
    ids = teacher_topk_ids.values().unsqueeze(0) if teacher_topk_ids.is_nested else teacher_topk_ids
    scored = torch.zeros(student_logits.shape[:-1], dtype=torch.long, device=student_logits.device)
    teacher = kltriton.TopK(ids.long(), teacher_lp, min_logprob=log_prob_min_clamp)
    losses = kltriton.token_divergence(student_logits, teacher, scored, divergence="forward_kl", tail="none")
    with torch.no_grad():
        student_lp, student_ids = _topk_diagnostics(student_logits, ids.long())
        clamped_student, clamped_teacher = student_lp, teacher_lp.float()
        if log_prob_min_clamp is not None:
            clamped_student = clamped_student.clamp_min(log_prob_min_clamp)
            clamped_teacher = clamped_teacher.clamp_min(log_prob_min_clamp)
        overlap = (ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(-1)
        overlap_count = overlap.sum(-1)
        token_kl = clamped_teacher.exp() * (clamped_teacher - clamped_student)
        advantage = (-token_kl * overlap).sum(-1) / overlap_count.clamp_min(1)
        return {
            "distillation_losses": losses,
            "student_mass": student_lp.exp().sum(-1),
            "teacher_mass": teacher_lp.float().exp().sum(-1),
            "overlap_count": overlap_count,
            "overlap_token_advantage": torch.where(overlap_count > 0, advantage, torch.zeros_like(advantage)),
        }


def _topk_diagnostics(student_logits, ids):
    """``(log-probs at ids, the student's own top-k ids)`` ``[..., K]`` without gradient, in row chunks (no ``[N, V]``
    fp32 temporary)."""
    vocab, k = student_logits.shape[-1], ids.shape[-1]
    rows, flat_ids = student_logits.detach().reshape(-1, vocab), ids.reshape(-1, k)
    logp = torch.empty(flat_ids.shape, dtype=torch.float32, device=rows.device)
    own = torch.empty_like(flat_ids)
    step = max(1, DIAGNOSTIC_CHUNK // vocab)
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step].float()
        logp[start:start + step] = chunk.gather(-1, flat_ids[start:start + step]) - chunk.logsumexp(-1, keepdim=True)
        own[start:start + step] = torch.topk(chunk, k, dim=-1).indices
    return logp.view(ids.shape), own.view(ids.shape)


_integration = Integration("verl", _install, package="verl", tested="0.9.1")
apply = _integration.apply
undo = _integration.undo
