"""The ``loss`` family as custom ops: ``kltriton::loss`` computes the loss, the rows' statistics and the loss's
gradient in the forward, for dense logits (the backend's ``loss`` family) or an LM head (its ``linear`` family, on
tiles of whole rows); ``kltriton::loss_scale_`` is the backward's only work.

The backward applies the upstream gradient in place on the saved gradient (``loss_scale_``), which moves no
``[N, V]`` bytes when that gradient is exactly 1 (checked on the device by the kernel). The loss value, the per-token
KL and ratio and the metrics come from the family's ``terms`` kernel on the rows' statistics, in the same op.
"""
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import is_fake

from kltriton import dispatch
from kltriton._autograd import first_order, used_up
from kltriton.kernels import accumulation_dtype, constants, statistics
from kltriton.kernels.loss import masked, statistics_request
from kltriton.ops._define import (BOOL, INT, LOSS_INPUTS, MUTABLE, OPTIONAL, SIDE, STR, TENSOR, NEEDS_GRAD, define_op,
                                  eager)
from kltriton.ops.statistics import empty_gradients


def _forward(args):
    """``(loss, *statistics, threshold, d_x, d_weight, d_bias)``: dense logits through the ``loss`` family (its
    gradient is ``d_x``), an LM head through the ``linear`` family's ``loss_forward``. With ``entropy_quantile``,
    TRL's entropy mask (``masked.py``; ``threshold`` its quantile, else NaN)."""
    policy, ref, inputs, hyperparameters, needs_grad = args.policy, args.ref, args.inputs, args.hyperparameters, args.needs_grad
    common = (args.target, args.temperature)
    dense = policy.weight is None
    impl = dispatch.implementation("loss" if dense else "linear", args.backend)
    threshold = policy.x.new_empty(0, dtype=torch.float32)  # the entropy mask's quantile: [] with the mask
    if dense:
        with_grad = needs_grad.x
        ref_logits = None if ref is None else ref.x
        if args.entropy_quantile is None:
            stats, grad = impl.forward(policy.x, ref_logits, *common, inputs, hyperparameters, args.loss_type, args.estimator,
                                       args.entropy_grad, with_grad, args.with_entropy)
        else:
            stats, grad, keep, threshold = masked.forward(impl, policy.x, ref_logits, *common, inputs, hyperparameters,
                                                          args.loss_type, args.estimator, with_grad,
                                                          args.entropy_quantile)
            inputs = inputs._replace(w_pg=inputs.w_pg * keep.to(inputs.w_pg.dtype))
        grads = (grad if with_grad else None, None, None)
    elif args.entropy_quantile is None:
        stats, *grads = impl.loss_forward(policy, ref, *common, inputs, hyperparameters, args.loss_type, args.estimator,
                                          args.entropy_grad, *needs_grad, args.tile_elements, args.with_entropy)
    else:
        stats, *grads, keep, threshold = masked.linear_forward(impl, policy, ref, *common, inputs, hyperparameters, args.loss_type,
                                                               args.estimator, *needs_grad, args.tile_elements,
                                                               args.entropy_quantile)
        inputs = inputs._replace(w_pg=inputs.w_pg * keep.to(inputs.w_pg.dtype))
    grads = tuple(policy.x.new_empty(0) if d is None else d for d in grads)  # no None or aliased outputs
    out = dispatch.implementation("loss", args.backend).terms(stats, args.target, inputs, hyperparameters,
                                                               args.loss_type, args.estimator)
    return (out.loss, *stats, threshold, *grads, out.kl, out.ratio, out.metrics)


def _forward_fake(args):
    policy, n = args.policy, args.target.shape[0]
    new = lambda size: policy.x.new_empty(size, dtype=accumulation_dtype(policy.x.dtype))  # noqa: E731
    stats = statistics.empty_stats(n, statistics_request(args.ref is not None, args.estimator,
                                             args.with_entropy or args.entropy_quantile is not None), new)
    if policy.weight is None:
        grads = (policy.x.new_empty((n, policy.x.shape[-1])) if args.needs_grad.x else policy.x.new_empty(0),
                 policy.x.new_empty(0), policy.x.new_empty(0))
    else:
        grads = empty_gradients(policy, args.needs_grad)
    f32 = lambda size: policy.x.new_empty(size, dtype=torch.float32)  # noqa: E731
    return (new(()), *stats, f32(0 if args.entropy_quantile is None else ()), *grads, new(n), new(n),
            f32(len(constants.LOSS_METRICS)))


def _scale(args):
    dispatch.implementation("loss", args.backend).scale_(args.grad, args.upstream.detach())


# ``grad *= upstream`` in place; no ``[N, V]`` traffic when ``upstream == 1`` (cpp / triton). Declared like every other
# op (not with ``torch.library.custom_op``, whose eager path costs more than a small forward).
loss_scale_ = define_op("loss_scale_", inputs=(("grad", MUTABLE), ("upstream", TENSOR), ("backend", STR)), outputs=(),
                        launch=_scale, fake=lambda args: None)


def scaled(grad, g_loss, backend, eager=False):
    """``grad * g_loss``: in place in eager calls (the gradient was written in the forward; nothing is read
    or written when the upstream gradient is 1, decided by the kernel); out of place while traced. ``eager``: the
    backward of an eager call (``saved.eager``), whose gradient is its own."""
    if not eager and is_fake(grad):
        # Traced by torch.compile (AOTAutograd): an in-place update of a saved forward output cannot be
        # partitioned, and functionalization would copy the buffer anyway.
        return grad * g_loss.to(grad.dtype)
    loss_scale_(grad, g_loss, backend)
    return grad


def scaled_gradients(saved, g_loss):
    """The gradients a forward wrote (``saved.d_x``, ``d_weight``, ``d_bias``) scaled by the upstream ``g_loss``, for
    the policy tensors that needs_grad one (a dense policy's ``d_x`` is its logits gradient, ``[N, V]``)."""
    if g_loss is None:
        return {}
    policy, needs_grad = saved.policy, saved.needs_grad["policy"][:3]
    eager = getattr(saved, "eager", False)
    if getattr(saved, "repeated", False):
        raise used_up("loss")
    d = tuple(scaled(getattr(saved, name), g_loss, saved.backend, eager) if w else None
              for name, w in zip(("d_x", "d_weight", "d_bias"), needs_grad))
    if policy.weight is None and d[0] is not None:
        d = (d[0].view(policy.x.shape), None, None)
    return {"policy": d}


loss = define_op(
    "loss",
    inputs=(("policy", SIDE), ("ref", SIDE), ("target", TENSOR), ("temperature", TENSOR), ("inputs", LOSS_INPUTS),
            ("hyperparameters", TENSOR), ("loss_type", STR), ("estimator", STR), ("entropy_grad", BOOL),
            ("needs_grad", NEEDS_GRAD), ("with_entropy", BOOL), ("entropy_quantile", OPTIONAL), ("tile_elements", INT),
            ("backend", STR)),
    outputs=("loss", *statistics.NAMES, "threshold", "d_x", "d_weight", "d_bias", "kl", "ratio", "metrics"),
    launch=_forward,
    fake=_forward_fake, save=("policy", "backend", "d_x", "d_weight", "d_bias"),
    backward=lambda saved, grads: scaled_gradients(saved, grads["loss"]), materialize_grads=False,
    grad_outputs=("loss",))

_D_X, _NEEDS_GRAD = loss.outputs.index("d_x"), loss.names.index("needs_grad")


class _DenseLoss(torch.autograd.Function):
    """The fused loss of dense logits in an eager call whose logits need the gradient (``fused``, ``fused_labels``):
    the ``loss`` family's kernels through one plain autograd node, without ``Op``'s generic bookkeeping (``python -m
    benchmarks host``). ``plan``: ``(backend, launch)``; ``launch()`` runs the kernels and returns ``(loss, d_x,
    outputs)``. The forward puts ``outputs`` in ``out`` and returns the loss; it holds the logits gradient ``d_x`` it
    wrote (no other reference to it exists), which the backward scales in place by the upstream gradient."""

    @staticmethod
    def forward(ctx, logits, plan, out):
        ctx.backend, launch = plan
        value, ctx.d_x, outputs = launch()
        out.append(outputs)
        ctx.sizes = tuple(logits.shape)
        ctx.save_for_backward(logits)  # what a second derivative would differentiate (``first_order``)
        return value

    @staticmethod
    @first_order("kltriton::loss")
    def backward(ctx, g_loss):
        if g_loss is None:
            return None, None, None
        d_x, ctx.d_x = ctx.d_x, None  # scaled in place below: a second backward (retain_graph) has none to give
        if d_x is None:
            raise used_up("policy_loss")
        dispatch.implementation("loss", ctx.backend).scale_(d_x, g_loss.detach())
        return d_x.view(*ctx.sizes), None, None  # the sizes one by one: a torch.Size costs view twice as much


def fused(*args) -> tuple:
    """The ``loss`` op's outputs for its arguments (in ``loss``'s order); dense logits in an eager call that needs
    their gradient go through ``_DenseLoss``, anything else through the op (``torch.compile``, fakes, an LM head)."""
    policy, needs_grad = args[0], args[_NEEDS_GRAD]
    if policy.weight is not None or not needs_grad.x or not eager(args):
        return loss(*args)
    named = SimpleNamespace(**dict(zip(loss.names, args)))

    def launch():
        outputs = _forward(named)
        return outputs[0], outputs[_D_X], outputs

    out = []
    value = _DenseLoss.apply(policy.x, (named.backend, launch), out)
    return (value, *out[0][1:])


def fused_labels(logits, ref_logits, layout, weights, temperature, old_logp, ref_logp, hyperparameters, loss_type,
                 estimator, entropy_grad, with_entropy, backend) -> tuple:
    """``(loss, StreamStats, LossTerms)`` of the fused loss of dense ``logits`` in an eager call, at the targets of
    ``layout`` (an ``_inputs.Layout`` whose target is not made yet, ``pending``), made with the loss's per-row inputs
    (``weights``, a ``kernels.layout.RowWeights``) in the same call: the loss family's ``forward_labels``, one op on
    the C++ backend. Through ``_DenseLoss`` when the logits need the gradient."""
    impl = dispatch.implementation("loss", backend)
    source = layout.kernel_source()
    with_grad = torch.is_grad_enabled() and logits.requires_grad

    def launch():
        target, stats, d_x, terms = impl.forward_labels(logits, ref_logits, *source, weights, temperature, old_logp,
                                                        ref_logp, hyperparameters, loss_type, estimator,
                                                        entropy_grad, with_grad, with_entropy)
        return terms.loss, d_x, (target, stats, terms)

    if with_grad:
        out = []
        value = _DenseLoss.apply(logits, (backend, launch), out)
        target, stats, terms = out[0]
    else:
        value, _, (target, stats, terms) = launch()
    layout.made(target)
    return value, stats, terms
