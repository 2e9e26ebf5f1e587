"""Distillation's custom ops, keyed on sides (dense logits, or an LM head's GEMM tiles): the ``divergence`` family
and the ``K``-column gather of a sparse (top-k) teacher.

- ``jsd`` / ``jsd_backward``: the generalized JSD's second pass (``kltriton.kernels.divergence``) given both rows'
  log-sum-exps, differentiable w.r.t. the student.
- ``divergence_loss``: ``sum_n weight_n * D_n`` with the student's gradient written in the forward; the backward only
  scales it (``ops.loss.scaled_gradients``).
- ``columns`` / ``columns_backward``: ``log softmax(x / T)`` at ``K`` ids per row, from the row's ``lse`` and a
  ``K``-column gather; the gradient is the ``stream`` backward's dense ``p`` term plus the ``K`` columns, nothing
  else of size ``[N, V]``.
"""
import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.linear import Side, tiles
from kltriton.kernels.statistics import Basis
from kltriton.ops._define import BOOL, INT, OPTIONAL, SIDE, STR, TENSOR, NEEDS_GRAD, NeedsGrad, define_op
from kltriton.ops.loss import scaled_gradients
from kltriton.ops.statistics import empty_gradients


def _rows(like, n, count):
    acc = accumulation_dtype(like.dtype)
    return tuple(like.new_empty(n, dtype=acc) for _ in range(count))


def _no_gradients(side, gradients):
    return tuple(side.x.new_empty(0) if d is None else d for d in gradients)


def _gradient_fake(args):
    return empty_gradients(args.policy, (True, False, False) if args.policy.weight is None else args.needs_grad)


def jsd_coefficients(g: torch.Tensor, beta: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The JSD gradient's per-row ``coef = g * (1 - beta) / T`` (fp32 ``[N]``) for an upstream ``g``."""
    return (g.double() * (1.0 - beta) / temperature).float()


# ---------------------------------------------------------------------------------------------------- the JSD pass
def _jsd(args):
    if args.policy.weight is None and args.ref.weight is None:
        return tuple(dispatch.implementation("divergence", args.backend).forward(
            args.policy.x, args.ref.x, args.target, args.temperature, args.lse, args.ref_lse, args.beta))
    return tuple(dispatch.implementation("linear", args.backend).jsd_forward(
        args.policy, args.ref, args.target, args.temperature, args.lse, args.ref_lse, args.beta, args.tile_elements))


def _jsd_backward_kernel(args):
    if args.policy.weight is None and args.ref.weight is None:
        grad = dispatch.implementation("divergence", args.backend).backward(
            args.policy.x, args.ref.x, args.target, args.temperature, args.lse, args.ref_lse, args.beta,
            args.kl_student, args.coef)
        return _no_gradients(args.policy, (grad, None, None))
    return _no_gradients(args.policy, dispatch.implementation("linear", args.backend).jsd_backward(
        args.policy, args.ref, args.target, args.temperature, args.lse, args.ref_lse, args.beta, args.kl_student,
        args.coef, *args.needs_grad, args.tile_elements))


_JSD_INPUTS = (("policy", SIDE), ("ref", SIDE), ("target", TENSOR), ("temperature", TENSOR), ("lse", TENSOR),
               ("ref_lse", TENSOR), ("beta", TENSOR))

jsd_backward = define_op(
    "jsd_backward",
    inputs=(*_JSD_INPUTS, ("kl_student", TENSOR), ("coef", TENSOR), ("needs_grad", NEEDS_GRAD), ("tile_elements", INT),
            ("backend", STR)),
    outputs=("d_x", "d_weight", "d_bias"), launch=_jsd_backward_kernel, fake=_gradient_fake)


def jsd_gradients(saved, g, needs_grad):
    """``(d_x, d_weight, d_bias)`` of ``sum g * jsd`` from a ``jsd`` forward's saved state."""
    coef = jsd_coefficients(g, saved.beta, saved.temperature)
    return jsd_backward(saved.policy, saved.ref, saved.target, saved.temperature, saved.lse, saved.ref_lse,
                        saved.beta, saved.kl_student, coef, NeedsGrad(*needs_grad), saved.tile_elements, saved.backend)


def _jsd_autograd(saved, grads):
    if grads["jsd"] is None:
        return {}
    needs_grad = saved.needs_grad["policy"][:3]
    return {"policy": tuple(d if w else None for d, w in zip(jsd_gradients(saved, grads["jsd"], needs_grad), needs_grad))}


jsd = define_op(
    "jsd", inputs=(*_JSD_INPUTS, ("tile_elements", INT), ("backend", STR)), outputs=("jsd", "kl_student"),
    launch=_jsd, fake=lambda args: _rows(args.policy.x, args.target.shape[0], 2),
    save=(*(name for name, _ in _JSD_INPUTS), "tile_elements", "backend", "kl_student"), backward=_jsd_autograd,
    materialize_grads=False, grad_outputs=("jsd",))


# ------------------------------------------------------------------- a loss with its gradient in the forward
def _loss(args):
    policy, ref, needs_grad = args.policy, args.ref, args.needs_grad
    if policy.weight is None:
        stats, divergence, grad = dispatch.implementation("divergence", args.backend).loss_forward(
            policy.x, ref.x, args.target, args.temperature, args.kind, args.beta, args.weight, args.with_entropy,
            needs_grad.x)
        grads = (grad if needs_grad.x else None, None, None)
    else:
        stats, divergence, *grads = dispatch.implementation("linear", args.backend).divergence_loss(
            policy, ref, args.target, args.temperature, args.kind, args.beta, args.weight, args.with_entropy, *needs_grad,
            args.tile_elements)
    return ((args.weight * divergence).sum(), divergence, stats.entropy, *_no_gradients(policy, grads))


def _loss_fake(args):
    policy, n = args.policy, args.target.shape[0]
    acc = accumulation_dtype(policy.x.dtype)
    if policy.weight is None:
        grads = (policy.x.new_empty((n, policy.x.shape[-1])) if args.needs_grad.x else policy.x.new_empty(0),
                 policy.x.new_empty(0), policy.x.new_empty(0))
    else:
        grads = empty_gradients(policy, args.needs_grad)
    return (policy.x.new_empty((), dtype=acc), policy.x.new_empty(n, dtype=acc),
            policy.x.new_empty(n if args.with_entropy else 0, dtype=acc), *grads)


divergence_loss = define_op(
    "divergence_loss",
    inputs=(("policy", SIDE), ("ref", SIDE), ("target", TENSOR), ("temperature", TENSOR), ("weight", TENSOR),
            ("kind", STR), ("beta", TENSOR), ("with_entropy", BOOL), ("needs_grad", NEEDS_GRAD), ("tile_elements", INT),
            ("backend", STR)),
    outputs=("loss", "divergence", "entropy", "d_x", "d_weight", "d_bias"), launch=_loss, fake=_loss_fake,
    save=("policy", "backend", "d_x", "d_weight", "d_bias"),
    backward=lambda saved, grads: scaled_gradients(saved, grads["loss"]), materialize_grads=False,
    grad_outputs=("loss",))


# ------------------------------------------------------------------------------ K columns (a top-k teacher)
def column_coefficients(g: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                        temperature: torch.Tensor):
    """``(c_p [N], c_columns [N, K])`` (fp32, divided by ``T``) of the gradient of ``sum g * column log-probs``:
    ``sum_k g_k (onehot(id_k) - p) / T``, zero on padding ids, unscored rows and rows without a finite ``lse``."""
    live = ((target >= 0) & torch.isfinite(lse))[:, None] & (ids >= 0)
    inv_t = 1.0 / (temperature if temperature.dim() == 0 else temperature[:, None])
    c = torch.where(live, g.double() * inv_t, torch.zeros((), dtype=torch.float64, device=g.device))
    return c.sum(1).float(), c.float()


def columns_to_logprobs(values, ids, target, temperature, lse):
    """``[N, K]`` ``values / T - lse`` of logits ``values`` at ``ids`` (``-inf`` at padding ids, 0 on unscored
    rows)."""
    ok = target >= 0
    t = temperature if temperature.dim() == 0 else temperature[:, None]
    out = (values.double() / t - lse.double()[:, None]).to(values.dtype)
    out = torch.where((ids < 0) & ok[:, None], torch.full((), float("-inf"), dtype=out.dtype, device=out.device), out)
    return torch.where(ok[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _columns(args):
    """``(logp [N, K], lse, entropy)``: with ``lse`` given (the whole rows', e.g. merged over vocab shards), the
    columns' log-probs from a ``K``-column gather; without, the side's statistics first, in the same pass over an LM
    head's tiles."""
    policy, ids, target, temperature = args.policy, args.ids, args.target, args.temperature
    lse, entropy = args.given_lse, policy.x.new_empty(0, dtype=accumulation_dtype(policy.x.dtype))
    if lse is None and policy.weight is not None:
        stats, values = dispatch.implementation("linear", args.backend).column_forward(
            policy, target, temperature, statistics.request(entropy=args.with_entropy), ids, args.tile_elements)
        return columns_to_logprobs(values, ids, target, temperature, stats.lse), stats.lse, stats.entropy
    if lse is None:
        stats = dispatch.implementation("stream", args.backend).forward(
            policy.x, None, target, temperature, statistics.request(entropy=args.with_entropy))
        lse, entropy = stats.lse, stats.entropy
    values = tiles.column_logits(policy, ids, target >= 0, args.tile_elements)
    return columns_to_logprobs(values, ids, target, temperature, lse), lse.clone(), entropy


def _columns_fake(args):
    acc = accumulation_dtype(args.policy.x.dtype)
    n, x = args.target.shape[0], args.policy.x
    with_entropy = args.given_lse is None and args.with_entropy
    return x.new_empty(args.ids.shape, dtype=acc), x.new_empty(n, dtype=acc), x.new_empty(n if with_entropy else 0,
                                                                                             dtype=acc)


def _columns_backward_kernel(args):
    """The gradient ``c_columns`` at ``ids`` (``-1``: not on this side) ``- p * c_p`` (``[N, K]``, ``[N]``, already
    divided by ``T``): dense logits get the ``stream`` backward's ``p`` term, then the ``K`` columns set to
    ``c_k - p_k c_p``; an LM head gets the same on each GEMM tile (``linear.column_backward``)."""
    policy, target, temperature, lse = args.policy, args.target, args.temperature, args.lse
    if policy.weight is not None:
        return _no_gradients(policy, dispatch.implementation("linear", args.backend).column_backward(
            policy, target, temperature, lse, args.c_p, args.ids, args.c_columns, *args.needs_grad, args.tile_elements))
    basis = Basis(torch.zeros_like(args.c_p), args.c_p)
    grad = dispatch.implementation("stream", args.backend).backward(policy.x, None, target, temperature, lse, None,
                                                                    basis)
    live = (target >= 0) & torch.isfinite(lse)
    t = temperature if temperature.dim() == 0 else temperature[:, None]
    values = tiles.column_logits(policy, args.ids, live, args.tile_elements)
    p = torch.where(live[:, None] & (args.ids >= 0), (values.double() / t - lse.double()[:, None]).exp(), 0.0)
    tiles.set_columns(grad, args.ids, live, args.c_columns.double() - p * args.c_p.double()[:, None])
    return _no_gradients(policy, (grad, None, None))


columns_backward = define_op(
    "columns_backward",
    inputs=(("policy", SIDE), ("ids", TENSOR), ("target", TENSOR), ("temperature", TENSOR), ("lse", TENSOR),
            ("c_p", TENSOR), ("c_columns", TENSOR), ("needs_grad", NEEDS_GRAD), ("tile_elements", INT), ("backend", STR)),
    outputs=("d_x", "d_weight", "d_bias"), launch=_columns_backward_kernel, fake=_gradient_fake)


def column_gradients(policy, ids, own_ids, target, temperature, lse, g, needs_grad, tile_elements, backend):
    """``(d_x, d_weight, d_bias)`` of ``sum g * column log-probs`` (``g [N, K]`` at the global ``ids``); ``own_ids``:
    the columns this side holds (a vocab shard's local ids, ``-1`` elsewhere)."""
    c_p, c_columns = column_coefficients(g, ids, target, lse, temperature)
    return columns_backward(policy, own_ids, target, temperature, lse, c_p, c_columns, NeedsGrad(*needs_grad), tile_elements,
                            backend)


def _columns_autograd(saved, grads):
    if grads["logp"] is None:
        return {}
    needs_grad = saved.needs_grad["policy"][:3]
    d = column_gradients(saved.policy, saved.ids, saved.ids, saved.target, saved.temperature, saved.lse,
                         grads["logp"], needs_grad, saved.tile_elements, saved.backend)
    return {"policy": tuple(g if w else None for g, w in zip(d, needs_grad))}


columns = define_op(
    "columns",
    inputs=(("policy", SIDE), ("ids", TENSOR), ("target", TENSOR), ("temperature", TENSOR), ("given_lse", OPTIONAL),
            ("with_entropy", BOOL), ("tile_elements", INT), ("backend", STR)),
    outputs=("logp", "lse", "entropy"), launch=_columns, fake=_columns_fake,
    save=("policy", "ids", "target", "temperature", "tile_elements", "backend", "lse"), backward=_columns_autograd,
    materialize_grads=False, grad_outputs=("logp",))


__all__ = ["Side", "column_gradients", "columns", "columns_backward", "divergence_loss", "jsd", "jsd_backward",
           "jsd_coefficients"]
