"""A causal LM's output head as ``kltriton.LinearLogits``, whatever wraps the model: plain, DDP, FSDP2, DeepSpeed
ZeRO-3, or a tensor-parallel (DTensor) head.

For people who write their own training loop (the trainer integrations use the same calls):

- ``score_with_lm_head(model, hidden, fn)``: ``fn(logits)`` runs *inside the LM head module's forward*, so every
  wrapper's hooks fire around it: FSDP2 unshards the head's unit (in its ``MixedPrecisionPolicy`` dtype) before
  ``fn`` and again before its backward, then reduce-scatters the head's gradient; ZeRO-3 gathers the head in the
  forward and in the backward, the same collectives on every rank whatever ``fn`` does. Call it where the model's
  own forward would project its hidden states: inside the (wrapped) model's forward, e.g. through the wrapper's
  forward as TRL's ``_ForwardRedirection`` does. That is required for a trainable head under DDP with
  ``find_unused_parameters=True`` (the gradient must come from the forward's outputs) and for an FSDP2 head in its
  model's root unit (the root unshards it only during the root's forward).
- ``lm_head_logits(model, hidden)``: the ``LinearLogits`` itself, for a head that can be read as it is (plain or DDP
  models; inside the forward of the FSDP2 unit that holds it) or that takes no gradient (under ``torch.no_grad()``
  or a weight that does not require grad: a reference or teacher model, whose FSDP2 or ZeRO-3 head becomes a copy,
  gathered once when sharded through its FSDP2 unit's ``unshard()`` or DeepSpeed's ``GatheredParameters``). A
  trainable head that is sharded at the call gets a ``RuntimeError`` naming ``score_with_lm_head``.
- ``run_in_forward(model, fn, *args)``: ``fn(*args)`` as the model's forward, through whatever wraps it (TRL's
  ``_ForwardRedirection``), to call ``score_with_lm_head`` from a loop.

Both read the head's ``logit_scale`` and ``softcap`` from the model's config
(``kltriton.linear_logits.head_scaling``) and give ``hidden`` the head weight's dtype.

A tensor-parallel head (a ``DTensor`` weight that no FSDP2 unit owns, e.g. transformers' ``tp_plan`` or torch's
``ColwiseParallel``) is not called as a module (its output hooks expect logits): ``LinearLogits`` gets the
``DTensor`` weight as it is and ``hidden`` as a ``Replicate`` ``DTensor`` on the weight's mesh, which kltriton's
DTensor front door scores vocab-parallel. A head that is both (FSDP2 over a tensor-parallel head, a 2-D mesh) is
called as its module for FSDP2's hooks, without the tensor-parallel style's output hook; inside, its unsharded weight
is the tensor-parallel ``DTensor``, scored the same way.
"""
import contextlib
from typing import Any, Callable, Optional, Tuple

import torch

from kltriton.linear_logits import LinearLogits, head_scaling

__all__ = ["lm_head_logits", "run_in_forward", "score_with_lm_head", "unwrap_model"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (``.module``), a DeepSpeed engine (``.module``) or ``torch.compile`` (``._orig_mod``).
    FSDP2 modules are the model itself."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ in (
                "DeepSpeedEngine", "PipelineEngine", "DeepSpeedHybridEngine"):
            model = model.module
        elif type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            return model


def lm_head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> LinearLogits:
    """``LinearLogits(hidden, head.weight, head.bias)`` of ``model``'s output embedding, scaled as its config says.

    Args:
        model: a causal LM (``get_output_embeddings()``, ``config``), plain or wrapped (DDP, DeepSpeed engine, FSDP2).
        hidden: ``[..., H]`` the backbone's last hidden states (cast to the head's dtype).

    The head is used as it is when it is materialized now: a plain or DDP model, an FSDP2 head inside the forward of
    the unit that holds it, a ZeRO-3 head inside its module's forward. A head that takes no gradient here (called
    under ``torch.no_grad()``, or a weight that does not require grad: a reference or teacher) and that FSDP2 or
    ZeRO-3 manages becomes a detached copy, gathered first when sharded now (FSDP2: ``unshard()`` / ``reshard()`` of
    its unit, in the unit's ``param_dtype``; ZeRO-3: ``GatheredParameters``): at most one all-gather, on every rank
    alike, and the copy stays valid after the wrapper reshards. A trainable head that is sharded now (or a ZeRO-3
    head outside its module's forward, which ZeRO-3 may release at any time) raises: use ``score_with_lm_head``.
    """
    model = unwrap_model(model)
    head = _output_head(model)
    weight, bias = head.weight, head.bias
    managed = _zero3_param(weight) or _fsdp_param(model, head)[0] is not None
    if managed and not (weight.requires_grad and torch.is_grad_enabled()):
        # No gradient to reduce: a copy, valid whenever the wrapper reshards it again (in a backward too).
        weight, bias = _gathered_copy(model, head)
    elif (_zero3_param(weight) and not _in_zero3_forward(head)) or _fsdp_sharded(model, head):
        raise RuntimeError(
            f"{type(model).__name__}'s LM head is {_sharding(weight)} here and takes a gradient: read it inside its "
            "forward, kltriton.score_with_lm_head(model, hidden, fn), so that the wrapper gathers it for the forward "
            "and the backward and reduces its gradient (or call this under torch.no_grad() for a head that takes "
            "none)")
    return _linear_logits(model, hidden, weight, bias)


def score_with_lm_head(model: torch.nn.Module, hidden: torch.Tensor, fn: Callable[[LinearLogits], Any]) -> Any:
    """``fn(lm_head_logits(model, hidden))`` computed inside the LM head module's forward: whatever wraps the
    model gathers or unshards the head around it, in the forward and the backward, and reduces its gradient.

    Args:
        model: a causal LM, plain or wrapped (DDP, DeepSpeed engine, FSDP2 with the head in any unit).
        hidden: ``[..., H]`` the backbone's last hidden states, the head module's input (FSDP2's
            ``MixedPrecisionPolicy`` casts it to ``param_dtype`` when the head is its own unit).
        fn: takes the ``LinearLogits`` and returns tensors (a tensor, a tuple, a dict or a NamedTuple of them), e.g.
            ``lambda logits: kltriton.policy_loss(logits, labels, advantages)``; they come back as the head's output.

    Call it inside the model's forward (or the wrapper's forward, ``_ForwardRedirection``-style) when the head is in
    an FSDP2 unit with other modules (the root, accelerate's ``[norm, lm_head]``): that unit is unsharded only there,
    and a head still sharded inside its own forward raises a ``RuntimeError`` saying so. A tensor-parallel head is
    not called as a module: ``fn`` gets the ``DTensor`` ``LinearLogits`` (see the module docstring).
    """
    model = unwrap_model(model)
    head = _output_head(model)
    if _tensor_parallel(model, head):
        return fn(_linear_logits(model, hidden, head.weight, head.bias))

    def forward(head_input):
        if _zero3_partitioned(head.weight) or _fsdp_sharded(model, head):
            raise RuntimeError(
                f"{type(model).__name__}'s LM head is still sharded inside its own forward ({_sharding(head.weight)}): "
                "the FSDP2 unit that holds it is an ancestor whose forward is not running. Call score_with_lm_head "
                "inside the model's forward (through the wrapped model's forward, as TRL's _ForwardRedirection does)")
        return fn(_linear_logits(model, head_input, head.weight, head.bias))

    with _without_output_layout(head):
        return call_as_forward(head, forward, hidden)


def run_in_forward(model: torch.nn.Module, fn: Callable, *args) -> Any:
    """``fn(*args)`` run as ``model``'s forward, through whatever wraps it: ``model(*args)`` with the wrapped
    module's forward replaced by ``fn`` for the call (TRL's ``_ForwardRedirection``). DDP sees the outputs of its
    forward (``find_unused_parameters``), FSDP2's root unshards its parameters, a DeepSpeed engine runs its
    forward hooks. Use it to call ``score_with_lm_head`` from a training loop."""
    return call_as_forward(unwrap_model(model), fn, *args, caller=model)


def call_as_forward(module: torch.nn.Module, fn: Callable, *args, caller: Optional[torch.nn.Module] = None) -> Any:
    """``(caller or module)(*args)`` with ``fn`` as ``module``'s forward: the hooks of ``module`` and of whatever
    wraps it (``caller``) fire around ``fn``, and ``fn``'s outputs are the module's."""
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = fn
    try:
        return (module if caller is None else caller)(*args)
    finally:
        if had_own:
            module.forward = own
        else:
            del module.forward


# ------------------------------------------------------------------------------------------------ internals
def _output_head(model):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"{type(model).__name__} has no output embedding with a weight (get_output_embeddings())")
    if hasattr(head, "base_layer"):
        raise ValueError(f"{type(model).__name__}'s LM head carries a PEFT adapter (lm_head in target_modules): "
                         "kltriton projects with the head's weight and would ignore the adapter")
    return head


def _linear_logits(model, hidden, weight, bias) -> LinearLogits:
    logit_scale, softcap = head_scaling(model.config) if hasattr(model, "config") else (1.0, None)
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    if _is_dtensor(weight) and not _is_dtensor(hidden):  # a tensor-parallel head: replicated hidden states
        from torch.distributed.tensor import DTensor, Replicate

        mesh = weight.device_mesh
        hidden = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return LinearLogits(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)


def _is_dtensor(tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _zero3_param(param) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


def _zero3_partitioned(param) -> bool:
    """A ZeRO-3 parameter that is not gathered now (its tensor is a 0-element placeholder)."""
    if not _zero3_param(param):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status != ZeroParamStatus.AVAILABLE


def _in_zero3_forward(module) -> bool:
    """ZeRO-3 is running ``module``'s forward (its parameters are gathered for it, and again for its backward);
    outside, a gathered parameter is only prefetched and may be released any time."""
    from deepspeed.runtime.zero import parameter_offload

    return any(m is module for m in getattr(parameter_offload, "FWD_MODULE_STACK", ()))


def _fsdp_param(model, module, name="weight"):
    """``(unit, fsdp_param)``: the FSDP2 module whose parameter group holds ``module.<name>``, or ``(None, None)``.
    (FSDP2 keeps this in ``FSDPState``; torch has no public lookup.)"""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None, None
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for param in getattr(group, "fsdp_params", ()):
                info = param._module_info
                if info.param_name == name and (info.module is module or module in info.shared_modules):
                    return unit, param
    return None, None


def _fsdp_sharded(model, head) -> bool:
    """The head's FSDP2 unit is sharded now: its weight is the sharded ``DTensor`` parameter."""
    if not _is_dtensor(head.weight):
        return False
    _, param = _fsdp_param(model, head)
    return param is not None and head.weight is param.sharded_param


def _tensor_parallel(model, head) -> bool:
    """A ``DTensor`` head that no FSDP2 unit owns: tensor parallel."""
    return _is_dtensor(head.weight) and _fsdp_param(model, head)[0] is None


@contextlib.contextmanager
def _without_output_layout(head):
    """The head's forward hooks without those of a tensor-parallel style (torch's ``parallelize_module``, which
    transformers' ``tp_plan`` uses too): ``distribute_module`` registers a lambda over the style's ``output_fn``
    that redistributes the module's output as logits (it reads ``outputs.placements``) and fails on what ``fn``
    returns. An FSDP2 head that is also tensor parallel (a 2-D mesh) runs ``fn`` as its forward with that hook left
    out; FSDP2's hooks and the style's input hook (the hidden states as a ``Replicate`` DTensor) stay."""
    hooks = head._forward_hooks
    layout_hooks = [key for key, hook in hooks.items()
                    if getattr(hook, "__module__", None) == "torch.distributed.tensor._api"
                    and "output_fn" in getattr(getattr(hook, "__code__", None), "co_freevars", ())]
    if not layout_hooks:
        yield
        return
    saved = hooks.copy()
    for key in layout_hooks:
        del hooks[key]
    try:
        yield
    finally:
        hooks.clear()
        hooks.update(saved)


def _sharding(weight) -> str:
    if _zero3_param(weight):
        return f"a DeepSpeed ZeRO-3 parameter {tuple(weight.ds_shape)} outside its module's forward"
    return f"an FSDP2 shard {tuple(weight.to_local().shape)} of {tuple(weight.shape)}"


def _gathered_copy(model, head) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A detached full copy of a frozen head's weight and bias, gathered first when they are sharded now: one
    all-gather, on every rank alike (the sharding state is the same on every rank)."""
    context = contextlib.nullcontext()
    if _zero3_partitioned(head.weight):
        import deepspeed

        context = deepspeed.zero.GatheredParameters([p for p in (head.weight, head.bias) if p is not None],
                                                    modifier_rank=None)
    elif _fsdp_sharded(model, head):
        context = _unsharded(_fsdp_param(model, head)[0])
    with torch.no_grad(), context:
        weight, bias = head.weight.detach().clone(), None if head.bias is None else head.bias.detach().clone()
    return weight, bias


@contextlib.contextmanager
def _unsharded(unit):
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()
