"""TRL (tested with 1.16): the fused LM head of TRL's trainers, ``GRPOTrainer``'s loss, the distillation
trainers' divergence and the experimental trainers' full-logits forwards computed with kltriton.

``apply()`` changes TRL's ``add_fused_lm_head`` (in every TRL module that imported it), ``GRPOTrainer._compute_loss``,
four functions of TRL's distillation (below) and the experimental trainers' forwards
(``kltriton.integrations.trl_experimental``), and ``undo()`` puts them back.

Sharded training (DDP, FSDP2 with the head in any unit, DeepSpeed ZeRO-2/3): every score is computed inside the
wrapped model's forward and the LM head's own (``kltriton.heads.score_with_lm_head``), so each wrapper's hooks
gather, unshard and reduce the head as in the model's own forward; frozen heads (the reference, the teacher) are
gathered copies (``kltriton.heads.lm_head_logits``). Tensor-parallel heads (transformers' ``tp_plan``, torch's
``parallelize_module`` with ``ColwiseParallel`` on ``lm_head``: a ``Shard(0)`` ``DTensor`` weight) are scored
vocab-parallel by kltriton's DTensor front door, the hidden states as a ``Replicate`` ``DTensor``: no logits, not even
a vocabulary shard's, and no full-vocabulary gather. FSDP2 and tensor parallelism together (a 2-D mesh): inside the
head's FSDP2 unit the unsharded weight is the tensor-parallel ``DTensor``, scored the same way.


- ``add_fused_lm_head``, which the ``__init__`` of every TRL 1.16 trainer (SFT, DPO, KTO, RLOO, GRPO, the
  experimental AsyncGRPO) calls on its policy and reference model, and a user's own trainer may call from
  ``trl.trainer.utils``: it is replaced in every loaded TRL module that holds it (``Patch.swap``), so a module
  imported later gets the replacement from ``trl.trainer.utils``. TRL's head is still added, then wrapped by one
  whose ``fused_lm_head=True`` call projects only the scored positions and scores them with
  ``kltriton.token_logprobs(..., outputs=...)``: the log-probs and every statistic the trainer asked its head for
  (``entropy``; ``is_top1``, SFT's and DPO's token accuracy; ``mean_logits``, DPO's and KTO's logged logits;
  ``log_sum_sq_probs``, DPO's WPO weight) in one pass. So call ``apply()`` before building the trainer. After
  ``undo()`` the wrapped models use TRL's head again. An MoE model whose config asks for router logits gets TRL's
  load-balancing loss from kltriton's head too: the backbone returns its router logits, and the head adds
  ``router_aux_loss_coef`` times transformers' ``load_balancing_loss_func`` to the loss and returns it as
  ``aux_loss``. A model with a PEFT adapter on the head keeps TRL's head, with a log line naming the reason.
- ``SFTTrainer.compute_loss``: unchanged, but one log line where SFT's loss comes from the model's own logits (TRL's
  code, with ``label_smoothing_factor`` or a ``compute_loss_func``; the head then gives only the metrics).
- ``OnlineDPOTrainer._forward`` (the completion tokens' log-probs) and ``CPOTrainer`` / ``ORPOTrainer``'s
  ``concatenated_forward`` (log-prob sums or means, NLL loss, mean logits), experimental: from the hidden states, no
  ``[B, T, V]`` logits (``kltriton.integrations.trl_experimental``, which says where TRL's own forward still runs).
- ``selective_log_softmax``, ``selective_log_softmax_and_entropy`` and ``entropy_from_logits`` (``trl.trainer.utils``),
  which the experimental trainers that still build the ``[B, T, V]`` logits call (TPO, SDPO, SDFT, A2PO; CPO and ORPO
  where TRL's forward runs): ``kltriton.dropins``, in every TRL module that holds them. Their results are fp32
  whatever the logits' dtype (TRL's CPU path returns the logits' dtype).
- ``GRPOTrainer._compute_loss``: the loss is computed from the hidden states by ``kltriton.policy_loss``
  (``policy_loss_arguments``): every loss type x importance-sampling level, the KL term with or without TRL's
  bias correction, ``delta``, the entropy mask and bonus (adaptive too), the off-policy mask and the vLLM
  importance-sampling correction map onto it; on several processes the entropy mask's quantile is over every
  data-parallel process's tokens, as TRL's (``entropy_quantile_group``: ``data_parallel_group``). TRL's own
  ``_compute_loss`` runs (on kltriton's log-probs and, for an MoE model, kltriton's head's ``aux_loss``) only for
  the MoE load-balancing loss, multimodal inputs or a model kltriton's head does not serve, with one log line per
  reason. The loss is computed inside the
  model's forward: the patched forward gets it as a function (``fused_lm_head=<callable>``) and returns
  ``kltriton.policy_loss``'s output.
- With ``apply(truncation=True)`` (off by default), also ``GRPOTrainer._get_per_token_logps_and_entropies``
  and ``use_adapter``: the policy's log-probs (current and old, in the head and in the loss) are those of the
  distribution sampled from, ``kltriton.Truncation`` of the config's ``top_k`` / ``top_p`` / ``min_p`` at its
  ``temperature``; the reference model's stay untruncated (see ``sampling_truncation``). With vLLM installed, a
  colocated vLLM returns kltriton's log-probs too (``kltriton.integrations.vllm_plugin``).

Distillation (``kltriton.token_divergence`` from the models' hidden states, never the ``[B, T, V]`` logits):

- ``GKDTrainer.compute_loss`` (``trl.experimental.gkd``): the student's and the teacher's backbones give hidden
  states, their LM heads become ``LinearLogits``, and the loss is the generalized JSD of TRL's
  ``generalized_jsd_loss`` (its ``beta``, temperature 1 and ``batchmean`` reduction, or ``sum / num_items_in_batch``)
  with the student's gradient written in the forward; each model runs through its wrapper's forward. Under data
  parallelism the loss is scaled by the ranks as transformers' ``Trainer.compute_loss`` scales it (TRL's override
  does not). TRL's own ``compute_loss`` runs, with a log line, where the caller wants the student's outputs
  (``return_outputs=True``), for MoE models or multimodal inputs.
- ``GKDTrainer.generalized_jsd_loss``: the same function on logits; ``reduction="none"`` (TRL returns the
  elementwise ``[M, V]`` terms) runs TRL's own code, with a log line.
- ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (``DistillationTrainer``'s loss): the same signature
  and results (loss, the student's entropy sum, the scored count). ``DistillationTrainer._compute_loss`` (TRL's,
  wrapped) hands it the two models, whose heads are then read through them; TRL's own for ``DTensor`` heads
  passed without their models (a tensor-parallel head and an FSDP2 shard look alike without the model).

A function rather than a trainer subclass: it also works for trainers built by TRL's CLI and for
users' own ``GRPOTrainer`` subclasses. Nothing is imported before ``apply()`` is called.
"""
import contextlib
import contextvars
import functools
import logging
import types
from typing import Optional

import torch

import kltriton
from kltriton import dropins, heads
from kltriton.integrations._patch import Integration, Patch
from kltriton.linear_logits import head_scaling

logger = logging.getLogger(__name__)

_logged = set()

def _install(patch: Patch) -> None:
    """Make TRL's fused LM head (every trainer's) compute its log-probs and statistics with kltriton, and
    ``trl.GRPOTrainer`` its loss where it maps.

    Call ``apply()`` before building the trainer.
    """
    from trl.trainer import grpo_trainer
    from trl.trainer import utils as trl_utils

    _logged.clear()  # each apply() logs each fallback reason once
    trl_add_fused_lm_head = patch.resolve(trl_utils, "add_fused_lm_head")
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

    patch.swap("trl", trl_add_fused_lm_head, add_fused_lm_head)  # every trainer module's copy, and utils'
    patch.set(grpo_trainer.GRPOTrainer, "_compute_loss", _compute_loss)
    _install_logit_helpers(patch)
    _install_sft_loss_note(patch)
    _install_distillation(patch)
    from kltriton.integrations import trl_experimental

    trl_experimental.install(patch)  # experimental trainers' full-logits forwards, from the hidden states
    if _switches["truncation"]:
        _install_truncation(patch, grpo_trainer)


_integration = Integration("TRL", _install, package="trl", tested="1.16.0")
undo = _integration.undo
_switches = {"truncation": False}


def apply(*, truncation: bool = False) -> Patch:
    """Make TRL's trainers compute with kltriton (call it before building the trainer); returns the ``Patch``
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
    _install_vllm_plugin(patch)


def _install_vllm_plugin(patch: Patch) -> None:
    """``apply(truncation=True)`` with vLLM installed: a colocated engine (``vllm_mode="colocate"``, which runs in
    this process) returns kltriton's log-probs (``kltriton.integrations.vllm_plugin``), so the rollout log-probs and
    the trainer's are one function of the logits; undone with the rest. A vLLM the plugin does not support keeps
    its own, with a log line. A vLLM server needs ``VLLM_PLUGINS=kltriton`` in its own environment."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return
    from kltriton.integrations import vllm_plugin

    if vllm_plugin.active():
        return  # VLLM_PLUGINS=kltriton already applied it in this process
    try:
        vllm_plugin.install(Patch("vLLM probe"))  # resolves every hook; nothing recorded on TRL's patch yet
    except (RuntimeError, AttributeError, ImportError) as err:
        _log_once(f"a colocated vLLM keeps its own log-probs (kltriton's vLLM plugin cannot serve it: {err})")
        return
    vllm_plugin.install(patch)
    _log_once("a colocated vLLM returns kltriton's log-probs (kltriton.integrations.vllm_plugin)")


def _log_once(message: str) -> None:
    """One line per message and ``apply()``: what runs (kltriton's head, kltriton's loss or TRL's and why)."""
    if message not in _logged:
        _logged.add(message)
        logger.warning("kltriton: %s", message)


# ---------------------------------------------------------------------------------------------- head
def _install_sft_loss_note(patch: Patch) -> None:
    """``SFTTrainer.compute_loss``, unchanged but for one log line where its loss comes from the model's own logits
    (TRL's code): with ``label_smoothing_factor`` (nll) or a ``compute_loss_func``, kltriton's head only gives the
    entropy and token accuracy."""
    from trl.trainer import sft_trainer

    trl_compute_loss = patch.resolve(patch.resolve(sft_trainer, "SFTTrainer"), "compute_loss")

    def compute_loss(self, model, inputs, *args, **kwargs):
        smoothing = self.label_smoother is not None and self.args.loss_type == "nll"
        if self.compute_loss_func is not None or smoothing:
            why = "compute_loss_func" if self.compute_loss_func is not None else "label_smoothing_factor"
            _log_once(f"SFTTrainer loss: TRL's code on the model's own logits (its {why}); kltriton's head gives "
                      "the entropy and token accuracy")
        return trl_compute_loss(self, model, inputs, *args, **kwargs)

    patch.set(sft_trainer.SFTTrainer, "compute_loss", compute_loss)


_LOGIT_HELPERS = ("selective_log_softmax", "selective_log_softmax_and_entropy", "entropy_from_logits")


def _install_logit_helpers(patch: Patch) -> None:
    """TRL's helpers on full logits (``_LOGIT_HELPERS``), which the experimental trainers that still build the
    ``[B, T, V]`` logits call (TPO, SDPO, SDFT, A2PO; CPO and ORPO where TRL's forward runs): ``kltriton.dropins`` in
    every TRL module that holds them."""
    from trl.trainer import utils as trl_utils

    for name in _LOGIT_HELPERS:
        patch.swap("trl", patch.resolve(trl_utils, name), getattr(dropins, name))


def _head_scaling(model):
    """``(logit_scale, softcap)`` of the model's LM head (``kltriton.linear_logits.head_scaling``, TRL's reading
    of the config), or a string saying why kltriton's head can't serve the model."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "base_layer"):
        return "its LM head carries a PEFT adapter (kltriton would project with the base weight only)"
    return head_scaling(model.config)


# The per-token fields of TRL's FusedCausalLMOutput that kltriton's head fills (with loss and label_mask); every
# one TRL 1.16's head can be asked for.
_HEAD_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _wrap_fused_head(model, patch: Patch, temperature, cast_lm_head_to_fp32, outputs):
    """Wrap the ``forward`` TRL's ``add_fused_lm_head`` installed with one that scores through kltriton.

    The scoring runs inside the LM head module's forward (``kltriton.score_with_lm_head``), itself inside this
    forward, which TRL calls through the wrapped model: DDP sees the head used in its forward, FSDP2 unshards the
    head's unit (any wrapping, any ``reshard_after_forward``, its ``MixedPrecisionPolicy``), ZeRO-3 gathers the head
    in the forward and the backward, once per call on every rank."""
    scaling = _head_scaling(model)
    missing = [name for name in outputs if name not in _HEAD_OUTPUTS]
    if isinstance(scaling, str) or missing:
        why = scaling if isinstance(scaling, str) else (f"it is asked for {', '.join(missing)}, which kltriton's "
                                                        "head does not compute")
        _log_once(f"{type(model).__name__} keeps TRL's fused LM head, because {why}")
        return
    logit_scale, softcap = scaling
    trl_forward = model.forward
    statistics = tuple(name for name in outputs if name != "log_probs")  # token_logprobs' outputs= names

    @functools.wraps(type(model).forward)  # as TRL's: generate() reads the model's kwargs off this signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not patch.active or fused_lm_head is False:
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        text_config = self.config.get_text_config()
        if getattr(text_config, "output_router_logits", False):  # as TRL's head and the model's own forward
            kwargs.setdefault("output_router_logits", True)
        backbone = self.base_model(*args, **kwargs)
        hidden = backbone.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
        if callable(fused_lm_head):  # the loss path (_kltriton_loss): scored by kltriton.policy_loss in here
            return heads.score_with_lm_head(self, hidden, fused_lm_head)
        mask = labels != -100
        aux_loss, aux_coef = None, 0.0
        if kwargs.get("output_router_logits"):
            aux_loss = _router_aux_loss(self, backbone.router_logits, kwargs.get("attention_mask"))
            aux_coef = getattr(text_config, "router_aux_loss_coef", 0.0)
        return heads.score_with_lm_head(self, hidden[mask], functools.partial(
            _score, mask=mask, labels=labels[mask], temperature=temperature, statistics=statistics,
            num_items_in_batch=num_items_in_batch, aux_loss=aux_loss, aux_coef=aux_coef))

    model.forward = types.MethodType(forward, model)
    model._kltriton_head_scaling = (logit_scale, softcap)
    names = ", ".join(outputs[:-1]) + " and " + outputs[-1] if len(outputs) > 1 else outputs[0]
    _log_once(f"{type(model).__name__} scores its {names} with kltriton's LM head "
              f"(logit_scale={logit_scale}, softcap={softcap})")


def _router_aux_loss(model, router_logits, attention_mask):
    """The MoE load-balancing loss TRL 1.16's head adds: transformers' Mixtral ``load_balancing_loss_func`` (every
    MoE family's) of the backbone's router logits (one ``[B * T, experts]`` per layer), with the expert counts read
    where TRL reads them for the installed transformers. ``attention_mask`` None (padding-free): every token counts."""
    import transformers
    from packaging.version import Version
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text_config = model.config.get_text_config()
    version = Version(transformers.__version__)
    if version < Version("5.0.0"):
        num_experts, per_token = model.num_experts, model.num_experts_per_tok
    else:  # GptOssConfig has no num_experts in transformers [5.0, 5.6) (TRL's issue #5754): the model's
        gpt_oss_without = text_config.model_type == "gpt_oss" and version < Version("5.6.0")
        num_experts = model.num_experts if gpt_oss_without else text_config.num_experts
        per_token = text_config.num_experts_per_tok
    return load_balancing_loss_func(router_logits, num_experts, per_token, attention_mask)


def _score(logits, *, mask, labels, temperature, statistics, num_items_in_batch, aux_loss=None, aux_coef=0.0):
    """TRL's ``FusedCausalLMOutput`` from the ``LinearLogits`` of the scored positions (``mask``) and their labels:
    the log-probs and the ``statistics`` the head was asked for, in one pass; each zero (False) where not scored.
    With an MoE ``aux_loss`` (a scalar), the loss adds ``aux_coef * aux_loss`` and the output carries it."""
    from trl.trainer.utils import FusedCausalLMOutput

    out = kltriton.token_logprobs(logits, labels, temperature=temperature, outputs=statistics,
                                  truncation=_truncation.get())
    # masked_scatter keeps the outputs connected to the model even when no position is scored
    values = {"log_probs": out.logp, **{name: getattr(out, name) for name in statistics}}
    fields = {name: value.new_zeros(mask.shape).masked_scatter(mask, value) for name, value in values.items()}
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / count
    if aux_loss is not None:
        loss = loss + aux_coef * aux_loss
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **fields)


# ---------------------------------------------------------------------------------------------- loss
# TRL loss types whose loss normalizer is the number of sequences (times the accumulation steps), the number of
# local tokens (bnpo), or the generation batch's token count (the rest).
_PER_SEQUENCE = ("grpo", "sapo", "dr_grpo", "luspo")
_PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _why_trl_loss(trainer, inputs) -> Optional[str]:
    """``None`` when ``policy_loss_arguments`` covers the trainer's configuration, else the reason it doesn't.
    Every ``GRPOConfig`` field of the loss maps (docs/integrations.md lists them); what is left is the model."""
    from kltriton.kernels.loss import terms

    model = trainer.accelerator.unwrap_model(trainer.model)
    checks = [
        (trainer.loss_type not in terms.LOSS_TYPES, f"loss_type={trainer.loss_type!r} is not one kltriton knows"),
        (trainer.aux_loss_enabled, "the MoE aux loss is on (kltriton.policy_loss does not add it)"),
        (any(inputs.get(k) is not None for k in _MULTIMODAL_KEYS), "the inputs are multimodal"),
        (not hasattr(model, "_kltriton_head_scaling"), "the model kept TRL's fused LM head"),
    ]
    return next((reason for failed, reason in checks if failed), None)


def data_parallel_group(accelerator):
    """The process group over which a trainer's processes hold different data (TRL gathers its entropy quantile
    over them), or ``None`` for one: every process without tensor parallelism; under accelerate's
    ``ParallelismConfig`` with ``tp_size`` the ranks of one tensor-parallel group hold one batch, the data-parallel
    group is the mesh's ``"dp"`` dimension (``None`` when only tensor parallelism is on)."""
    import torch.distributed as dist

    if accelerator.num_processes == 1:
        return None
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.tp_enabled:
        return dist.group.WORLD
    if accelerator.num_processes == config.tp_size:
        return None
    return accelerator.torch_device_mesh["dp"].get_group()


def _mode_and_accumulation(trainer):
    mode = "train" if trainer.model.training else "eval"
    return mode, (trainer.current_gradient_accumulation_steps if mode == "train" else 1.0)


def _entropy_coef(trainer) -> float:
    """The entropy bonus's coefficient this step (TRL: the adaptive controller gates it on the last entropy)."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    if trainer.use_adaptive_entropy:
        return trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    return trainer.entropy_coef


def policy_loss_arguments(trainer, inputs) -> dict:
    """The ``kltriton.policy_loss`` keyword arguments that give ``GRPOTrainer._compute_loss``'s loss for one
    micro-batch: the loss type and its parameters, the importance-sampling level, the KL term (bias-corrected or
    not), the entropy mask and bonus, the off-policy mask, the vLLM importance-sampling ratios, and TRL's loss
    normalizers (folded into the aggregation's denominators, gradient accumulation included)."""
    args = trainer.args
    mode, accumulation = _mode_and_accumulation(trainer)
    loss_type = trainer.loss_type
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    kwargs = dict(loss_type=loss_type, importance_sampling_level=trainer.importance_sampling_level, mask=mask,
                  old_logprobs=inputs.get("old_per_token_logps"), temperature=trainer.temperature)
    if loss_type == "cispo":  # TRL's CISPO caps the ratio at epsilon_high itself and has no lower bound
        kwargs.update(clip_low=1.0, clip_high=trainer.epsilon_high - 1.0)
    else:
        kwargs.update(clip_low=trainer.epsilon_low, clip_high=trainer.epsilon_high)
    if loss_type in _PPO_FAMILY and args.delta is not None:
        kwargs["delta"] = args.delta
    if loss_type == "sapo":
        kwargs.update(tau_pos=args.sapo_temperature_pos, tau_neg=args.sapo_temperature_neg)
    if loss_type == "vespo":
        kwargs.update(vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
                      vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg)
    batch = mask.shape[0]
    if loss_type in _PER_SEQUENCE:
        kwargs["global_batch_size"] = batch * accumulation
        if loss_type == "dr_grpo":
            kwargs["horizon"] = trainer.max_completion_length
    elif loss_type == "bnpo":
        kwargs["batch_num_tokens"] = mask.sum().clamp(min=1.0) * accumulation
    else:  # cispo, dapo, vespo: the generation batch's token count, rescaled to one accumulation window
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * accumulation / args.steps_per_generation
        kwargs["batch_num_tokens"] = normalizer
    if trainer.beta != 0.0:
        kwargs.update(ref=inputs["ref_per_token_logps"], kl_coef=trainer.beta, kl_estimator="k3",
                      use_bias_correction_kl=args.use_bias_correction_kl)
    if trainer.top_entropy_quantile < 1.0:
        kwargs["token_mask_entropy_quantile"] = 1 - trainer.top_entropy_quantile
        group = data_parallel_group(trainer.accelerator)
        if group is not None:  # TRL's threshold: the quantile over every data-parallel process's tokens
            kwargs["entropy_quantile_group"] = group
    if trainer.off_policy_mask_threshold is not None:
        kwargs["off_policy_mask_threshold"] = trainer.off_policy_mask_threshold
        if inputs.get("sampling_per_token_logps") is not None:
            kwargs["rollout_logprobs"] = inputs["sampling_per_token_logps"]
    if _switches["truncation"]:
        kwargs["truncation"] = sampling_truncation(trainer)
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        kwargs["rollout_is_weights"] = inputs["importance_sampling_ratio"]  # TRL's, computed at generation
    coef = _entropy_coef(trainer)
    if coef != 0.0:  # TRL's bonus: the mean entropy of the (kept) tokens, scaled for accumulation only
        kwargs.update(entropy_coef=coef / accumulation, entropy_aggregation="token-mean")
    return kwargs


def _kltriton_loss(trainer, model, inputs):
    """``GRPOTrainer._compute_loss`` through ``kltriton.policy_loss``; logs TRL's metrics."""
    completion_ids = inputs["completion_ids"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    kwargs = policy_loss_arguments(trainer, inputs)
    k = completion_ids.size(1)

    def loss(logits):  # inside the (wrapped) model's forward and its LM head's
        completion = kltriton.LinearLogits(logits.hidden[:, -k:], logits.weight, logits.bias,
                                           logit_scale=logits.logit_scale, softcap=logits.softcap)
        return kltriton.policy_loss(completion, completion_ids, inputs["advantages"], **kwargs)

    with trainer.accelerator.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=loss)
    mode, accumulation = _mode_and_accumulation(trainer)
    _log_metrics(trainer, mode, accumulation, out, kwargs, inputs["advantages"])
    return out.loss


def _log_metrics(trainer, mode, accumulation, out, kwargs, advantages):
    """TRL's metrics of ``_compute_loss`` from kltriton's outputs: ``kl``, ``entropy``, the loss type's clip
    metrics, and with the entropy bonus ``policy_loss``, ``entropy_coef`` and the adaptive controller's update."""
    from trl.trainer.utils import nanmax, nanmin

    acc = trainer.accelerator
    mask = kwargs["mask"].float()
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    sequence_level = trainer.importance_sampling_level == "sequence"
    metrics = trainer._metrics[mode]

    def global_masked_mean(x):  # TRL's: over the tokens, or over the sequences of a (B, 1) value
        if x.shape[1] == 1:
            local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
        else:
            local = torch.stack([(x * mask).sum(), mask.sum()])
        totals = acc.reduce(local, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def masked_seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    if trainer.beta != 0.0:
        metrics["kl"].append(global_masked_mean(out.kl))
    metrics["entropy"].append(global_masked_mean(out.entropy))
    ratio = out.ratio.detach()
    if sequence_level:  # TRL's coef_1 is (B, 1): read it where the sequence has a token, 1 where it has none
        first = mask.argmax(-1, keepdim=True)
        ratio = torch.where(mask.sum(-1, keepdim=True) > 0, ratio.gather(1, first),
                            torch.ones_like(first, dtype=ratio.dtype))
    loss_type = trainer.loss_type
    if loss_type in _PPO_FAMILY:
        if trainer.args.delta is not None:
            ratio = torch.clamp(ratio, max=trainer.args.delta)
        low = ((ratio < 1 - trainer.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + trainer.epsilon_high) & (adv > 0)).float()
        region = torch.maximum(low, high)
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(region))
        metrics["clip_ratio/low_min"].append(nanmin(acc.gather(masked_seq_mean(low))).item())
        metrics["clip_ratio/high_max"].append(nanmax(acc.gather(masked_seq_mean(high))).item())
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"].append(global_masked_mean(((ratio > trainer.epsilon_high) & (adv > 0)).float()))
    elif loss_type == "vespo":
        count = adv.shape[0] if adv.shape[1] == 1 else mask.sum()
        phi = out.metrics["vespo_phi_mean"] * count
        totals = acc.reduce(torch.stack([phi, torch.as_tensor(count, dtype=phi.dtype, device=phi.device)]), "sum")
        metrics["vespo/phi_seq_mean"].append((totals[0] / totals[1].clamp(min=1.0)).item())
    if trainer._entropy_bonus_enabled:
        _entropy_bonus_metrics(trainer, mode, accumulation, out, kwargs, mask)


def _entropy_bonus_metrics(trainer, mode, accumulation, out, kwargs, mask):
    """With the entropy bonus TRL logs the loss without it (``policy_loss``), updates the adaptive controller on
    the tokens the bonus acts on, and logs ``entropy_coef`` at optimizer steps."""
    acc = trainer.accelerator
    policy = out.metrics["pg_loss"] + kwargs.get("kl_coef", 0.0) * out.metrics["kl_loss"]
    if trainer.loss_type in _PER_SEQUENCE or trainer.loss_type == "bnpo":
        policy = policy * accumulation  # TRL logs these before dividing by the accumulation steps
    trainer._metrics[mode]["policy_loss"].append(acc.gather(policy).nanmean().item())
    if trainer.use_adaptive_entropy and mode == "train":
        effective = mask
        if "token_mask_entropy_quantile" in kwargs:
            effective = mask * (out.entropy >= out.metrics["entropy_threshold"]).float()
        stats = torch.stack([(out.entropy * effective).sum(), effective.sum()])
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if acc.sync_gradients:
            totals = acc.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            args = trainer.args
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    if mode == "train" and acc.sync_gradients:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)


# ---------------------------------------------------------------------------------------------- distillation
def _install_distillation(patch: Patch) -> None:
    """``GKDTrainer.compute_loss`` / ``generalized_jsd_loss`` and ``DistillationTrainer``'s divergence loss."""
    from trl.experimental.gkd import gkd_trainer
    from trl.models.utils import _ForwardRedirection
    from trl.trainer import distillation_trainer

    # trl_gkd / trl_distillation / trl_module: TRL's own code that the replacements below call (patch.replace, at
    # the end)
    redirect = _ForwardRedirection()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        reason = _why_trl_gkd(self, model, inputs, return_outputs)
        if reason is not None:
            _log_once(f"GKDTrainer loss: TRL's own code, because {reason}")
            return trl_gkd.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        _log_once(f"GKDTrainer loss: kltriton.token_divergence (generalized JSD, beta={self.beta}) from the hidden "
                  "states")
        student = self.accelerator.unwrap_model(model)
        # Through the wrapper's forward (DDP / FSDP / DeepSpeed hooks), as TRL's DistillationTrainer does.
        loss = redirect(model, student, _gkd_loss, self, student, redirect, inputs, num_items_in_batch)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            # num_items_in_batch counts every rank's tokens and the wrapper averages the ranks' gradients: scaled
            # as transformers' Trainer.compute_loss scales (TRL's GKD override does not, so its data-parallel
            # gradient is 1 / world of a one-process run's).
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return loss

    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean", num_items_in_batch=None):
        if reduction not in ("batchmean", "sum", "mean") and num_items_in_batch is None:
            _log_once(f"GKDTrainer.generalized_jsd_loss: TRL's own code, because reduction={reduction!r} returns "
                      "the elementwise terms")
            return trl_gkd.generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=beta,
                                                temperature=temperature, reduction=reduction,
                                                num_items_in_batch=num_items_in_batch)
        return _jsd_loss(student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch)

    def distillation_compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        # TRL's, run inside the student wrapper's forward; the heads it hands to _chunked_divergence_loss are read
        # through these models (kltriton.heads) instead of as tensors.
        models = (unwrapped_student, self.accelerator.unwrap_model(self.teacher_model))
        token = _distillation_models.set(models)
        try:
            return trl_distillation._compute_loss(self, unwrapped_student, inputs, num_items_in_batch)
        finally:
            _distillation_models.reset(token)

    def chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                                teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                                student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                                teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                teacher_final_logit_softcapping=None, temperature=1.0):
        models = _distillation_models.get()
        if models is not None and all(a is b for a, b in zip(_heads_of(models), (student_lm_head_weight,
                                                                                 teacher_lm_head_weight))):
            _log_once(f"DistillationTrainer loss: kltriton.token_divergence (generalized JSD, beta={beta}) from "
                      "the hidden states, the LM heads read in their modules' forwards")
            student, teacher = models
            return _divergence_through_heads(student, teacher, student_hidden_states, teacher_hidden_states,
                                             completion_mask, beta, num_items_in_batch, temperature)
        args = (student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias,
                student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
                teacher_final_logit_softcapping, temperature)
        if any(_is_sharded(w) for w in (student_lm_head_weight, teacher_lm_head_weight)):
            _log_once("DistillationTrainer loss: TRL's own chunked kernels, because the LM heads are sharded "
                      "(DTensor) and came without their models")
            return trl_module._chunked_divergence_loss(*args)
        _log_once(f"DistillationTrainer loss: kltriton.token_divergence (generalized JSD, beta={beta}) from the "
                  "hidden states")
        return _distillation_loss(*args)

    trl_gkd = patch.replace(patch.resolve(gkd_trainer, "GKDTrainer"), compute_loss=compute_loss,
                            generalized_jsd_loss=staticmethod(generalized_jsd_loss))
    trl_distillation = patch.replace(patch.resolve(distillation_trainer, "DistillationTrainer"),
                                     _compute_loss=distillation_compute_loss)
    trl_module = patch.replace(distillation_trainer, _chunked_divergence_loss=chunked_divergence_loss)


# (student, teacher) unwrapped, while DistillationTrainer._compute_loss runs
_distillation_models = contextvars.ContextVar("kltriton_trl_distillation_models", default=None)


def _heads_of(models):
    return tuple(heads.unwrap_model(m).get_output_embeddings().weight for m in models)


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
        if isinstance(_head_scaling(m), str):
            return f"the {name}: {_head_scaling(m)}"
        if getattr(m.config.get_text_config(), "output_router_logits", False):
            return f"the {name} is an MoE model (kltriton's GKD loss is not tested on one)"
    if any(inputs.get(k) is not None for k in _MULTIMODAL_INPUTS):
        return "the inputs are multimodal"
    return None


def _teacher_head(teacher, input_ids, attention_mask):
    """The teacher's next-token hidden states and its LM head (a gathered copy when sharded,
    ``kltriton.lm_head_logits``), computed inside the teacher wrapper's forward."""
    hidden = teacher.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    logits = heads.lm_head_logits(teacher, hidden[:, :-1])  # (called under no_grad: a copy when sharded)
    return logits.hidden, logits.weight, logits.bias  # tensors: what wrappers' output hooks expect


def _gkd_loss(trainer, student, redirect, inputs, num_items_in_batch):
    """``GKDTrainer.compute_loss`` by ``kltriton.token_divergence``: TRL's causal shift, ``generalized_jsd_loss`` with
    the trainer's ``beta`` at temperature 1 (as TRL calls it), ``batchmean`` or ``sum / num_items_in_batch``. Runs
    inside the student wrapper's forward; the teacher runs through its own wrapper's."""
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    teacher.eval()
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad():
        teacher_hidden, weight, bias = redirect(trainer.teacher_model, teacher, _teacher_head, teacher, input_ids,
                                                attention_mask)
    logit_scale, softcap = _head_scaling(teacher)
    teacher_logits = kltriton.LinearLogits(teacher_hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)
    hidden = student.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    labels = inputs["labels"][:, 1:]
    return heads.score_with_lm_head(student, hidden[:, :-1], lambda student_logits: _jsd_loss(
        student_logits, teacher_logits, labels, trainer.beta, 1.0, "batchmean", num_items_in_batch))


def _divergence_through_heads(student, teacher, student_hidden_states, teacher_hidden_states, completion_mask, beta,
                              num_items_in_batch, temperature):
    """``_distillation_loss`` with the heads read through their models: the student's inside its LM head's forward,
    the teacher's as a gathered copy when sharded."""
    with torch.no_grad():  # the teacher takes no gradient: its head is a gathered copy when sharded
        teacher_logits = heads.lm_head_logits(teacher, teacher_hidden_states)
    return heads.score_with_lm_head(student, student_hidden_states, lambda student_logits: _divergence(
        student_logits, teacher_logits, completion_mask, beta, num_items_in_batch, temperature))


def _distillation_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                       completion_mask, beta, num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias,
                       student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
                       teacher_final_logit_softcapping, temperature):
    """``DistillationTrainer``'s ``_chunked_divergence_loss`` by ``kltriton.token_divergence`` on the given tensors."""
    student = kltriton.LinearLogits(student_hidden_states, student_lm_head_weight, student_lm_head_bias,
                                    logit_scale=float(student_logit_scale), softcap=student_final_logit_softcapping)
    teacher = kltriton.LinearLogits(teacher_hidden_states.to(teacher_lm_head_weight.dtype), teacher_lm_head_weight,
                                    teacher_lm_head_bias, logit_scale=float(teacher_logit_scale),
                                    softcap=teacher_final_logit_softcapping)
    return _divergence(student, teacher, completion_mask, beta, num_items_in_batch, temperature)


def _divergence(student, teacher, completion_mask, beta, num_items_in_batch, temperature):
    """``(loss, the student's entropy summed over the scored positions, their count)``, the loss ``sum / count``
    (clamped at 1) or ``sum / num_items_in_batch``: ``_chunked_divergence_loss``'s outputs."""
    mask = completion_mask != 0
    labels = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
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
