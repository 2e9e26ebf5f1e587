"""``LinearLogits``: logits given as an LM head applied to hidden states, never built as ``[N, V]``.

The ``linear`` family as custom ops ``kltriton::linear_forward`` (differentiable w.r.t. the policy's
hidden states, weight and bias) and ``kltriton::linear_backward``, and ``logits_stats``: the one
entry point the public ops call with logits that may be tensors or ``LinearLogits`` on either side.
Kernel: ``kltriton.dispatch.implementation("linear", backend)`` (GEMM tiles + the backend's
``stream`` kernel, see ``kltriton.kernels.linear``).
"""
import math
from typing import Optional, Tuple

import torch

from kltriton import dispatch
from kltriton._inputs import LOGIT_DTYPES, runtime_scalar
from kltriton.kernels import accumulation_dtype
from kltriton.kernels.linear import Side
from kltriton.kernels.linear.tiles import default_tile_elements
from kltriton.kernels.stream import StreamStats
from kltriton.ops._define import define_op
from kltriton.ops.stream import stream, stream_backend


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
    """

    def __init__(self, hidden, weight, bias=None, *, logit_scale=1.0, softcap=None, tile_elements=None):
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
        if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not math.isfinite(logit_scale):
            raise TypeError(f"logit_scale must be a finite python float, got {logit_scale!r}")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or not 0 < softcap < math.inf):
            raise ValueError(f"softcap must be None or a finite python float > 0, got {softcap!r}")
        if tile_elements is not None and (isinstance(tile_elements, bool) or not isinstance(tile_elements, int)
                                          or tile_elements < 1):
            raise ValueError(f"tile_elements must be None or an int >= 1, got {tile_elements!r}")
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.logit_scale, self.softcap = float(logit_scale), None if softcap is None else float(softcap)
        self.tile_elements = tile_elements

    # The tensor-like surface the label checks use (``kltriton._inputs.build_layout``).
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

    def side(self) -> Side:
        scale = None if self.logit_scale == 1.0 else runtime_scalar(self.logit_scale, self.device)
        softcap = None if self.softcap is None else runtime_scalar(self.softcap, self.device)
        return Side(self.hidden, self.weight, self.bias, scale, softcap)

    def __repr__(self):
        return (f"LinearLogits(hidden={tuple(self.hidden.shape)}, weight={tuple(self.weight.shape)}, "
                f"bias={self.bias is not None}, logit_scale={self.logit_scale}, softcap={self.softcap})")


# --- custom ops -----------------------------------------------------------------------------------

def _side(x, weight, bias, scale, softcap) -> Optional[Side]:
    return None if x is None else Side(x, weight, bias, scale, softcap)


def _forward(
    x: torch.Tensor,                     # policy hidden [..., H] (or dense logits [..., V] when weight is None)
    weight: Optional[torch.Tensor],      # [V, H]
    bias: Optional[torch.Tensor],        # [V]
    scale: Optional[torch.Tensor],       # 0-dim float64
    softcap: Optional[torch.Tensor],     # 0-dim float64
    ref_x: Optional[torch.Tensor],       # reference side, as the policy's (no gradient)
    ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor],
    ref_scale: Optional[torch.Tensor],
    ref_softcap: Optional[torch.Tensor],
    target: torch.Tensor,                # [N] int64 (kltriton.kernels.constants)
    temperature: torch.Tensor,           # float64 [] or [N]
    with_entropy: bool,
    with_full_kl: bool,
    tile_elements: int,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(dispatch.implementation("linear", backend).forward(
        Side(x, weight, bias, scale, softcap), _side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap),
        target, temperature, with_entropy, with_full_kl, tile_elements))


def _forward_fake(x, weight, bias, scale, softcap, ref_x, ref_weight, ref_bias, ref_scale, ref_softcap, target,
                  temperature, with_entropy, with_full_kl, tile_elements, backend):
    n = target.shape[0]
    new = lambda wanted: x.new_empty(n if wanted else 0, dtype=accumulation_dtype(x.dtype))  # noqa: E731
    has_ref = ref_x is not None
    return new(True), new(True), new(with_entropy), new(has_ref), new(has_ref), new(with_full_kl)


def _backward_kernel(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    softcap: Optional[torch.Tensor],
    ref_x: Optional[torch.Tensor],       # read only for the full-KL term
    ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor],
    ref_scale: Optional[torch.Tensor],
    ref_softcap: Optional[torch.Tensor],
    target: torch.Tensor,                # [N] int64
    temperature: torch.Tensor,           # float64 [] or [N]
    lse: torch.Tensor,                   # [N]
    ref_lse: Optional[torch.Tensor],     # [N]
    g_logp: torch.Tensor,                # [N]
    g_entropy: Optional[torch.Tensor],   # [N]
    entropy: Optional[torch.Tensor],     # [N]
    g_full_kl: Optional[torch.Tensor],   # [N]
    full_kl: Optional[torch.Tensor],     # [N]
    want_x: bool,
    want_weight: bool,
    want_bias: bool,
    tile_elements: int,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    as_stats = lambda g: None if g is None else g.to(lse.dtype).contiguous()  # noqa: E731
    d_x, d_weight, d_bias = dispatch.implementation("linear", backend).backward(
        Side(x, weight, bias, scale, softcap), _side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap),
        target, temperature, lse, ref_lse, as_stats(g_logp), as_stats(g_entropy), entropy,
        as_stats(g_full_kl), full_kl, want_x, want_weight, want_bias, tile_elements)
    return tuple(x.new_empty(0) if d is None else d for d in (d_x, d_weight, d_bias))  # no aliased outputs


def _backward_fake(x, weight, bias, *rest):
    want_x, want_weight, want_bias = rest[-5:-2]
    like = lambda t, wanted: t.new_empty(t.shape) if wanted and t is not None else x.new_empty(0)  # noqa: E731
    return like(x, want_x), like(weight, want_weight), like(bias, want_bias)


linear_backward = define_op("linear_backward", _backward_kernel, outputs=("d_x", "d_weight", "d_bias"),
                            fake=_backward_fake)

_SIDE_NAMES = ("x", "weight", "bias", "scale", "softcap", "ref_x", "ref_weight", "ref_bias", "ref_scale",
               "ref_softcap")


def _backward(saved, grads):
    g_logp = grads["logp"] if grads["logp"] is not None else torch.zeros_like(saved.lse)
    g_entropy = grads["entropy"] if saved.with_entropy and grads["entropy"] is not None else None
    g_full_kl = grads["full_kl"] if saved.with_full_kl and grads["full_kl"] is not None else None
    full = g_full_kl is not None
    sides = [getattr(saved, name) for name in _SIDE_NAMES]
    if not full:
        sides[5:] = [None] * 5
    want = saved.needs_grad
    d_x, d_weight, d_bias = linear_backward(
        *sides, saved.target, saved.temperature, saved.lse, saved.ref_lse if full else None, g_logp, g_entropy,
        saved.entropy if g_entropy is not None else None, g_full_kl, saved.full_kl if full else None,
        want["x"], want["weight"], want["bias"], saved.tile_elements, saved.backend)
    return {"x": d_x if want["x"] else None, "weight": d_weight if want["weight"] else None,
            "bias": d_bias if want["bias"] else None}


linear_forward = define_op(
    "linear_forward", _forward, outputs=StreamStats._fields, fake=_forward_fake,
    save=(*_SIDE_NAMES, "target", "temperature", "with_entropy", "with_full_kl", "tile_elements", "backend",
          "lse", "ref_lse", "entropy", "full_kl"),
    backward=_backward)


# --- the entry point of the public ops ------------------------------------------------------------

def is_linear(logits) -> bool:
    return isinstance(logits, LinearLogits)


def _as_side(logits, detach=False) -> Side:
    if isinstance(logits, LinearLogits):
        side = logits.side()
    else:
        side = Side(logits, None, None, None, None)
    if detach:
        side = Side(*(None if t is None else t.detach() for t in side))
    return side


def logits_backend(backend, logits, ref=None) -> str:
    """The backend for ``logits`` / ``ref`` (tensors or ``LinearLogits``): the ``linear`` family when
    either side is a ``LinearLogits``, else the ``stream`` family."""
    if not (is_linear(logits) or is_linear(ref)):
        return stream_backend(backend, logits)
    return dispatch.resolve(backend, "linear", logits.device.type, logits.dtype == torch.float64)


def linear_sides(logits, ref_logits) -> Tuple[Side, Side, int]:
    """``(policy, ref, tile_elements)`` for the ``linear`` family: ``logits`` / ``ref_logits`` (each a
    tensor or ``LinearLogits``, at least one ``LinearLogits``; ``ref_logits`` may be None: a ``Side``
    of Nones) as ``Side`` tuples, the reference detached, and the working-tile budget."""
    policy = _as_side(logits)
    ref = _as_side(ref_logits, detach=True) if ref_logits is not None else Side(None, None, None, None, None)
    lin = logits if is_linear(logits) else ref_logits
    return policy, ref, lin.tile_elements or default_tile_elements(lin.device.type)


def linear_stream(logits, ref_logits, target, temperature, *, with_entropy=False, with_full_kl=False,
                  backend, shard=None) -> StreamStats:
    """``StreamStats`` (``[N]``, see ``kltriton.kernels.stream``) of ``logits`` and ``ref_logits``
    (each a tensor or ``LinearLogits``, at least one of them ``LinearLogits``; ``ref_logits`` may be
    None), differentiable w.r.t. the policy's hidden states, weight and bias (or its logits).
    ``shard``: both sides hold this rank's vocab shard (``kltriton.ops.vocab_parallel``)."""
    policy, ref, tile = linear_sides(logits, ref_logits)
    if shard is not None:
        from kltriton.ops.vocab_parallel import shard_linear_stream  # it builds on this module's ops
        return shard_linear_stream(policy, ref, target, temperature, with_entropy=with_entropy,
                                   with_full_kl=with_full_kl, tile_elements=tile, backend=backend, shard=shard)
    return StreamStats(*linear_forward(*policy, *ref, target, temperature, with_entropy, with_full_kl, tile, backend))


def logits_stats(logits, ref_logits, target, temperature, *, with_entropy=False, with_full_kl=False,
                 backend, shard=None) -> StreamStats:
    """Per-row statistics for the public ops: ``stream`` on tensors (``shard``: this rank's vocab shard,
    see ``kltriton.ops.vocab_parallel``), ``linear_stream`` when either side is a ``LinearLogits``
    (``backend`` from ``logits_backend``)."""
    if is_linear(logits) or is_linear(ref_logits):
        return linear_stream(logits, ref_logits, target, temperature, with_entropy=with_entropy,
                             with_full_kl=with_full_kl, backend=backend, shard=shard)
    return stream(logits, ref_logits, target, temperature, with_entropy=with_entropy, with_full_kl=with_full_kl,
                  backend=backend, shard=shard)
