"""The ``loss`` family as custom ops: ``kltriton::loss_forward`` (logits) and ``kltriton::linear_loss_forward``
(``LinearLogits``), each computing the loss, the rows' statistics and the loss's gradient in the forward,
and ``kltriton::loss_scale_``, the backward's only work.

The backward applies the upstream gradient in place on the saved gradient (``loss_scale_``), which moves
no ``[N, V]`` bytes when that gradient is exactly 1 (checked on the device by the kernel). The loss's
per-row inputs cross the op boundary as the fields of ``kltriton.kernels.loss.LossInputs``; the loss value
is ``sum(terms.objective)`` of the kernel's statistics.
"""
from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake

from kltriton import dispatch, estimators
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.linear import Side
from kltriton.kernels.loss import LossInputs, masked, terms, wanted
from kltriton.ops._define import define_op

# The ops' return annotations (their schemas are inferred from them): the loss, the statistics, the entropy
# mask's threshold, the gradients.
LossTuple = Tuple[(torch.Tensor,) * (1 + len(statistics.NAMES) + 2)]
LinearLossTuple = Tuple[(torch.Tensor,) * (1 + len(statistics.NAMES) + 4)]


def loss_value(target, loss_type, estimator, stats, inputs, hp):
    """The loss from a ``loss`` kernel's statistics and its ``LossInputs`` (the reference log-probs read from
    the reference logits where the kernel had them, else the given ones)."""
    ref_logp = stats.ref_logp if stats.ref_logp.shape == stats.logp.shape else inputs.ref_logp
    full_kl = stats.full_kl if estimator == "full" else None
    est = estimators.parse(estimator) if estimator else None
    token = terms.token_terms(loss_type, est, stats.logp, ref_logp, full_kl, inputs.old_logp, inputs.advantages, hp,
                              target >= 0)
    entropy = stats.entropy if stats.entropy.shape == stats.logp.shape else torch.zeros_like(stats.logp)
    return terms.objective(token, entropy, inputs.w_pg, inputs.w_kl, inputs.w_ent).sum()


def _no_threshold(like):
    return like.new_full((), float("nan"), dtype=torch.float32)


def _forward(
    logits: torch.Tensor,                # [..., V]
    ref_logits: Optional[torch.Tensor],  # [..., V] or None
    target: torch.Tensor,                # [N] int64 (kltriton.kernels.constants)
    temperature: torch.Tensor,           # float64 [] or [N]
    old_logp: Optional[torch.Tensor],    # [N] or None (on-policy)   -- LossInputs from here
    advantages: torch.Tensor,            # [N]
    w_pg: torch.Tensor,                  # [N]
    w_kl: torch.Tensor,                  # [N]
    w_ent: torch.Tensor,                 # [N]
    ref_logp: Optional[torch.Tensor],    # [N] given reference log-probs, or None   -- to here
    hyperparameters: torch.Tensor,       # float64, slots of constants.HYPERPARAMETERS
    loss_type: str,
    estimator: str,
    entropy_grad: bool,
    with_grad: bool,
    with_entropy: bool,
    entropy_quantile: Optional[torch.Tensor],  # 0-dim: TRL's entropy mask (kltriton.kernels.loss.masked)
    backend: str,
) -> LossTuple:
    inputs = LossInputs(old_logp, advantages, w_pg, w_kl, w_ent, ref_logp)
    impl = dispatch.implementation("loss", backend)
    if entropy_quantile is None:
        stats, grad = impl.forward(logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type,
                                   estimator, entropy_grad, with_grad, with_entropy)
        threshold = _no_threshold(logits)
    else:
        stats, grad, keep, threshold = masked.forward(impl, logits, ref_logits, target, temperature, inputs,
                                                      hyperparameters, loss_type, estimator, with_grad,
                                                      entropy_quantile)
        inputs = inputs._replace(w_pg=inputs.w_pg * keep.to(inputs.w_pg.dtype))
    return (loss_value(target, loss_type, estimator, stats, inputs, hyperparameters), *stats, threshold, grad)


def _forward_fake(logits, ref_logits, target, temperature, old_logp, advantages, w_pg, w_kl, w_ent, ref_logp,
                  hyperparameters, loss_type, estimator, entropy_grad, with_grad, with_entropy, entropy_quantile,
                  backend):
    n, acc = target.shape[0], accumulation_dtype(logits.dtype)
    new = lambda size: logits.new_empty(size, dtype=acc)  # noqa: E731
    stats = statistics.empty_stats(n, wanted(ref_logits is not None, estimator,
                                             with_entropy or entropy_quantile is not None), new)
    return (new(()), *stats, logits.new_empty((), dtype=torch.float32),
            logits.new_empty((n if with_grad else 0, logits.shape[-1])))


@torch.library.custom_op("kltriton::loss_scale_", mutates_args=("grad",))
def loss_scale_(grad: torch.Tensor, upstream: torch.Tensor, backend: str) -> None:
    """``grad *= upstream`` in place; no ``[N, V]`` traffic when ``upstream == 1`` (cpp / triton)."""
    dispatch.implementation("loss", backend).scale_(grad, upstream.detach())


@loss_scale_.register_fake
def _loss_scale_fake(grad, upstream, backend):
    return None


def scaled(grad, g_loss, backend):
    """``grad * g_loss``: in place in eager calls (the gradient was written in the forward; nothing is read
    or written when the upstream gradient is 1, decided by the kernel); out of place while traced."""
    if is_fake(grad):
        # Traced by torch.compile (AOTAutograd): an in-place update of a saved forward output cannot be
        # partitioned, and functionalization would copy the buffer anyway.
        return grad * g_loss.to(grad.dtype)
    loss_scale_(grad, g_loss, backend)
    return grad


def _backward(saved, grads):
    g_loss = grads["loss"]
    if g_loss is None:
        return {}
    return {"logits": scaled(saved.grad, g_loss, saved.backend).view(saved.logits.shape)}


loss_forward = define_op(
    "loss_forward", _forward, outputs=("loss", *statistics.NAMES, "threshold", "grad"), fake=_forward_fake,
    save=("logits", "backend", "grad"), backward=_backward, materialize_grads=False)


def _linear_forward(
    x: torch.Tensor,                     # policy hidden [..., H]
    weight: torch.Tensor,                # [V, H]
    bias: Optional[torch.Tensor],        # [V]
    scale: Optional[torch.Tensor],       # 0-dim float64
    softcap: Optional[torch.Tensor],     # 0-dim float64
    ref_x: Optional[torch.Tensor],       # reference hidden [..., H] or logits [..., V] (no gradient)
    ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor],
    ref_scale: Optional[torch.Tensor],
    ref_softcap: Optional[torch.Tensor],
    target: torch.Tensor,                # [N] int64 (kltriton.kernels.constants)
    temperature: torch.Tensor,           # float64 [] or [N]
    old_logp: Optional[torch.Tensor],    # [N] or None (on-policy)   -- LossInputs from here
    advantages: torch.Tensor,            # [N]
    w_pg: torch.Tensor,                  # [N]
    w_kl: torch.Tensor,                  # [N]
    w_ent: torch.Tensor,                 # [N]
    ref_logp: Optional[torch.Tensor],    # [N] given reference log-probs, or None   -- to here
    hyperparameters: torch.Tensor,       # float64, slots of constants.HYPERPARAMETERS
    loss_type: str,
    estimator: str,
    entropy_grad: bool,
    want_x: bool,
    want_weight: bool,
    want_bias: bool,
    tile_elements: int,
    with_entropy: bool,
    entropy_quantile: Optional[torch.Tensor],  # 0-dim: TRL's entropy mask (kltriton.kernels.loss.masked)
    backend: str,
) -> LinearLossTuple:
    inputs = LossInputs(old_logp, advantages, w_pg, w_kl, w_ent, ref_logp)
    ref = None if ref_x is None else Side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap)
    impl = dispatch.implementation("linear", backend)
    policy = Side(x, weight, bias, scale, softcap)
    if entropy_quantile is None:
        stats, d_x, d_weight, d_bias = impl.loss_forward(policy, ref, target, temperature, inputs, hyperparameters,
                                                         loss_type, estimator, entropy_grad, want_x, want_weight,
                                                         want_bias, tile_elements, with_entropy)
        threshold = _no_threshold(x)
    else:
        stats, d_x, d_weight, d_bias, keep, threshold = masked.linear_forward(
            impl, policy, ref, target, temperature, inputs, hyperparameters, loss_type, estimator, want_x,
            want_weight, want_bias, tile_elements, entropy_quantile)
        inputs = inputs._replace(w_pg=inputs.w_pg * keep.to(inputs.w_pg.dtype))
    grads = tuple(x.new_empty(0) if d is None else d for d in (d_x, d_weight, d_bias))  # no aliased outputs
    return (loss_value(target, loss_type, estimator, stats, inputs, hyperparameters), *stats, threshold, *grads)


def _linear_forward_fake(x, weight, bias, scale, softcap, ref_x, ref_weight, ref_bias, ref_scale, ref_softcap,
                         target, temperature, old_logp, advantages, w_pg, w_kl, w_ent, ref_logp,
                         hyperparameters, loss_type, estimator, entropy_grad, want_x, want_weight, want_bias,
                         tile_elements, with_entropy, entropy_quantile, backend):
    new = lambda size: x.new_empty(size, dtype=accumulation_dtype(x.dtype))  # noqa: E731
    like = lambda t, wanted: t.new_empty(t.shape) if wanted and t is not None else x.new_empty(0)  # noqa: E731
    stats = statistics.empty_stats(target.shape[0], wanted(ref_x is not None, estimator,
                                                           with_entropy or entropy_quantile is not None), new)
    return (new(()), *stats, x.new_empty((), dtype=torch.float32), like(x, want_x), like(weight, want_weight),
            like(bias, want_bias))


def _linear_backward(saved, grads):
    g_loss = grads["loss"]
    if g_loss is None:
        return {}
    return {name: scaled(getattr(saved, "d_" + name), g_loss, saved.backend)
            for name in ("x", "weight", "bias") if saved.needs_grad[name]}


linear_loss_forward = define_op(
    "linear_loss_forward", _linear_forward, outputs=("loss", *statistics.NAMES, "threshold", "d_x", "d_weight",
                                                     "d_bias"),
    fake=_linear_forward_fake, save=("backend", "d_x", "d_weight", "d_bias"), backward=_linear_backward,
    materialize_grads=False)
