"""The ``linear`` family (``LinearLogits``) as custom ops: ``kltriton::linear_forward`` (differentiable w.r.t.
the policy's hidden states, weight and bias) and ``kltriton::linear_backward``.

Each side (policy, reference) crosses the op boundary as the five tensors of a ``kltriton.kernels.linear.Side``
(``x``, ``weight``, ``bias``, ``scale``, ``softcap``; the reference's prefixed ``ref_``, all None without one).
Kernel: ``kltriton.dispatch.implementation("linear", backend)`` (GEMM tiles + the backend's ``stream`` kernel).
"""
from typing import Optional, Tuple

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.linear import Side
from kltriton.kernels.statistics import Basis
from kltriton.ops._define import define_op

SIDE_NAMES = ("x", "weight", "bias", "scale", "softcap", "ref_x", "ref_weight", "ref_bias", "ref_scale", "ref_softcap")


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
    wanted: int,                         # request bits
    tile_elements: int,
    backend: str,
) -> statistics.StatsTuple:
    return tuple(dispatch.implementation("linear", backend).forward(
        Side(x, weight, bias, scale, softcap), _side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap),
        target, temperature, wanted, tile_elements))


def _forward_fake(x, weight, bias, scale, softcap, ref_x, ref_weight, ref_bias, ref_scale, ref_softcap, target,
                  temperature, wanted, tile_elements, backend):
    acc = accumulation_dtype(x.dtype)
    return tuple(statistics.empty_stats(target.shape[0], wanted, lambda size: x.new_empty(size, dtype=acc)))


def _backward_kernel(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    softcap: Optional[torch.Tensor],
    ref_x: Optional[torch.Tensor],       # read only for the p_logq and q terms
    ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor],
    ref_scale: Optional[torch.Tensor],
    ref_softcap: Optional[torch.Tensor],
    target: torch.Tensor,                # [N] int64
    temperature: torch.Tensor,           # float64 [] or [N]
    lse: torch.Tensor,                   # [N]
    ref_lse: Optional[torch.Tensor],     # [N], with the p_logq or q term
    c_label: torch.Tensor,               # [N] gradient basis (kltriton.kernels.statistics.Basis), / T
    c_p: torch.Tensor,
    c_p_logp: Optional[torch.Tensor],
    c_p_logq: Optional[torch.Tensor],
    c_q: Optional[torch.Tensor],
    want_x: bool,
    want_weight: bool,
    want_bias: bool,
    tile_elements: int,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d_x, d_weight, d_bias = dispatch.implementation("linear", backend).backward(
        Side(x, weight, bias, scale, softcap), _side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap),
        target, temperature, lse, ref_lse, Basis(c_label, c_p, c_p_logp, c_p_logq, c_q), want_x, want_weight,
        want_bias,
        tile_elements)
    return tuple(x.new_empty(0) if d is None else d for d in (d_x, d_weight, d_bias))  # no aliased outputs


def _backward_fake(x, weight, bias, *rest):
    want_x, want_weight, want_bias = rest[-5:-2]
    like = lambda t, wanted: t.new_empty(t.shape) if wanted and t is not None else x.new_empty(0)  # noqa: E731
    return like(x, want_x), like(weight, want_weight), like(bias, want_bias)


linear_backward = define_op("linear_backward", _backward_kernel, outputs=("d_x", "d_weight", "d_bias"),
                            fake=_backward_fake)


def backward_from_grads(sides, target, temperature, tile_elements, backend, grads, stats, want):
    """``(d_x, d_weight, d_bias)`` of upstream gradients ``grads`` (name -> ``[N]`` or None) on the statistics
    ``stats`` of a forward of the ten ``sides`` tensors (``want``: which of the three to compute; the others
    come back empty)."""
    basis = statistics.gradient_basis(grads, stats, temperature)
    with_ref = basis.reads_ref()
    sides = list(sides[:5]) + (list(sides[5:]) if with_ref else [None] * 5)  # the reference: for log q and q only
    return linear_backward(*sides, target, temperature, stats.lse, stats.ref_lse if with_ref else None, *basis,
                           *want, tile_elements, backend)


def _backward(saved, grads):
    stats = statistics.StreamStats(*(getattr(saved, name) for name in statistics.NAMES))
    want = [saved.needs_grad[name] for name in ("x", "weight", "bias")]
    sides = [getattr(saved, name) for name in SIDE_NAMES]
    d_x, d_weight, d_bias = backward_from_grads(sides, saved.target, saved.temperature, saved.tile_elements,
                                                saved.backend, grads, stats, want)
    return {"x": d_x if want[0] else None, "weight": d_weight if want[1] else None,
            "bias": d_bias if want[2] else None}


linear_forward = define_op(
    "linear_forward", _forward, outputs=statistics.NAMES, fake=_forward_fake,
    save=(*SIDE_NAMES, "target", "temperature", "tile_elements", "backend", *statistics.NAMES), backward=_backward,
    materialize_grads=False)
