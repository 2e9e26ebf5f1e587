"""``LinearLogits``: logits given as an LM head applied to hidden states, never built as ``[N, V]``.

Accepted wherever kltriton accepts logits (``kltriton.route`` sends it to the ``linear`` family, see
``kltriton.kernels.linear``).
"""

import torch

from kltriton._dtensor import zero3_placeholder
from kltriton._inputs import LOGIT_DTYPES
from kltriton._values import check_float


class LinearLogits:
    """The logits ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)`` (no tanh when
    ``softcap`` is None), accepted wherever kltriton accepts logits, policy or reference side.

    Args:
        hidden: ``[..., H]`` fp32 / bf16 / fp16 (float64 on the reference backend); leading shape
            ``S`` is the logits' leading shape.
        weight: ``[V, H]`` (an LM head, e.g. ``model.lm_head.weight``), the dtype of ``hidden``.
        bias: optional ``[V]``.
        logit_scale: python float multiplying the logits (Cohere's ``logit_scale``; Granite's is
            ``1 / logits_scaling``).
        softcap: optional python float ``> 0`` (Gemma's ``final_logit_softcapping``).
        tile_elements: budget of the working logits tile (``rows * vocab_tile`` fp32 elements);
            default ``KLTRITON_LINEAR_TILE`` or 2**23 on CPU (32 MiB) and 2**25 on CUDA (128 MiB).

    Only scored positions are projected, in fp32-accumulated GEMM tiles; peak extra memory is the
    tile (two in the backward) plus ``O(N)`` plus the parameter gradients. Gradients reach
    ``hidden``, ``weight`` and ``bias`` of the policy side (a reference side gets none).

    DTensors (``docs/api/dtensor.md``): a ``Shard(0)`` weight (and bias) with ``Replicate`` DTensor hidden states on
    the same mesh dimension is a tensor-parallel head (vocab-parallel); a ``Shard(0)`` weight with plain hidden
    states is refused (an FSDP2 parameter outside its module's forward looks the same). A DeepSpeed ZeRO-3
    placeholder (0 elements) is refused with the fix.
    """

    def __init__(self, hidden, weight, bias=None, *, logit_scale=1.0, softcap=None, tile_elements=None):
        for name, t in (("weight", weight), ("bias", bias)):
            if zero3_placeholder(t):
                raise ValueError(f"LinearLogits {name} is a DeepSpeed ZeRO-3 placeholder (0 elements, real shape "
                                 f"{tuple(t.ds_shape)}): ZeRO-3 gathers a parameter only inside its module's forward. "
                                 f"Build the LinearLogits (and call kltriton) inside "
                                 f"`with deepspeed.zero.GatheredParameters([{name}]):`, or inside the module's "
                                 f"forward (kltriton.integrations do this for you inside the trainers).")
        for name, t in (("hidden", hidden), ("weight", weight)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if hidden.dtype not in LOGIT_DTYPES:
            raise TypeError(f"hidden must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
        if hidden.dim() < 1:
            raise ValueError("hidden must have shape [..., H], got a 0-dim tensor")
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(f"weight must have shape [V, H={hidden.shape[-1]}], got {tuple(weight.shape)}")
        if weight.shape[0] == 0:
            raise ValueError("weight has an empty vocabulary dimension (V == 0)")
        if bias is not None:
            if not isinstance(bias, torch.Tensor):
                raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
            if tuple(bias.shape) != (weight.shape[0],):
                raise ValueError(f"bias must have shape [V={weight.shape[0]}], got {tuple(bias.shape)}")
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.dtype != hidden.dtype:
                raise TypeError(f"{name} must have the dtype of hidden ({hidden.dtype}), got {t.dtype}")
            if t is not None and t.device != hidden.device:
                raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
        logit_scale = check_float("logit_scale", logit_scale)
        softcap = check_float("softcap", softcap, above=0.0, allow_none=True)
        if tile_elements is not None and (isinstance(tile_elements, bool) or not isinstance(tile_elements, int)
                                          or tile_elements < 1):
            raise ValueError(f"tile_elements must be None or an int >= 1, got {tile_elements!r}")
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.logit_scale, self.softcap = float(logit_scale), None if softcap is None else float(softcap)
        self.tile_elements = tile_elements

    # The tensor-like surface of logits ``[..., V]`` (global shapes for DTensors).
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def dim(self) -> int:
        return self.hidden.dim()

    def __repr__(self):
        return (f"LinearLogits(hidden={tuple(self.hidden.shape)}, weight={tuple(self.weight.shape)}, "
                f"bias={self.bias is not None}, logit_scale={self.logit_scale}, softcap={self.softcap})")


def head_scaling(config):
    """``(logit_scale, softcap)`` of a transformers causal LM's head from its config (the text config of a
    multimodal one), as TRL 1.16's fused head reads it: ``logit_scale`` (Cohere), else ``output_multiplier``,
    else ``lm_head_multiplier`` (Falcon-H1), else ``logits_scaling`` (Granite and MiniCPM3 divide by it,
    HyperCLOVA X multiplies); ``final_logit_softcapping`` (Gemma 2/3)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(config, name, None)
    scaling = getattr(config, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1.0 / scaling
    softcap = getattr(config, "final_logit_softcapping", None)
    return (1.0 if scale is None else float(scale)), (None if softcap is None else float(softcap))
