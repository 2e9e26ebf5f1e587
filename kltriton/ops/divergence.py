"""Distillation's custom ops (namespace ``kltriton``): the ``divergence`` family and the ``K``-column gather of a
sparse (top-k) teacher.

- ``jsd_forward`` / ``linear_jsd_forward``: the generalized JSD's second pass (``kltriton.kernels.divergence``),
  differentiable w.r.t. the student's logits (or hidden states, weight and bias); their backward is the family's
  gradient kernel (``jsd_backward`` / ``linear_jsd_backward``, ops of their own so ``torch.compile`` traces them).
- ``divergence_loss`` / ``linear_divergence_loss``: ``sum_n weight_n * D_n`` with the gradient written in the
  forward (``composed.py`` / ``tiles.bind_divergence``); the backward only scales it (``ops.loss.scaled``).
- ``column_logprobs`` / ``linear_column_logprobs``: ``log softmax(x / T)`` at ``K`` ids per row from the row's
  ``lse`` (a ``stream`` statistic) and a ``K``-column gather; their gradient is the ``stream`` / ``linear``
  backward's dense ``p`` term plus a scatter of ``[N, K]`` values, nothing else of size ``[N, V]``.

Each side of a ``LinearLogits`` crosses the op boundary as the five tensors of a ``kltriton.kernels.linear.Side``
(the teacher's prefixed ``ref_``).
"""
from typing import Optional, Tuple

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype, statistics
from kltriton.kernels.linear import Side, tiles
from kltriton.ops._define import define_op
from kltriton.ops.loss import scaled
from kltriton.ops.stream import stream_backward

Pair = Tuple[torch.Tensor, torch.Tensor]
Triple = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _new_rows(like, n, count=1):
    acc = accumulation_dtype(like.dtype)
    return tuple(like.new_empty(n, dtype=acc) for _ in range(count))


def jsd_coefficients(g: torch.Tensor, beta: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The JSD gradient's per-row ``coef = g * (1 - beta) / T`` (fp32 ``[N]``) for an upstream ``g``."""
    return (g.double() * (1.0 - beta) / temperature).float()


# ------------------------------------------------------------------------------------------- JSD, logits
def _jsd_forward(
    logits: torch.Tensor,        # [..., V] student
    ref_logits: torch.Tensor,    # [..., V] teacher (no gradient)
    target: torch.Tensor,        # [N] int64 (kltriton.kernels.constants)
    temperature: torch.Tensor,   # float64 [] or [N]
    lse: torch.Tensor,           # [N] whole rows' log-sum-exps of x / T and y / T (stream statistics)
    ref_lse: torch.Tensor,
    beta: torch.Tensor,          # float64 []
    backend: str,
) -> Pair:
    return tuple(dispatch.implementation("divergence", backend).forward(logits, ref_logits, target, temperature, lse,
                                                                        ref_lse, beta))


def _jsd_backward_kernel(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    target: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    ref_lse: torch.Tensor,
    beta: torch.Tensor,
    kl_student: torch.Tensor,    # [N] KL(p || m) of the whole rows
    coef: torch.Tensor,          # [N] fp32 g (1 - beta) / T
    backend: str,
) -> torch.Tensor:
    return dispatch.implementation("divergence", backend).backward(logits, ref_logits, target, temperature, lse,
                                                                   ref_lse, beta, kl_student, coef)


jsd_backward = define_op("jsd_backward", _jsd_backward_kernel, outputs=("grad",),
                         fake=lambda logits, *rest: logits.new_empty(logits.shape))


def _jsd_backward(saved, grads):
    if grads["jsd"] is None:
        return {}
    coef = jsd_coefficients(grads["jsd"], saved.beta, saved.temperature)
    return {"logits": jsd_backward(saved.logits, saved.ref_logits, saved.target, saved.temperature, saved.lse,
                                   saved.ref_lse, saved.beta, saved.kl_student, coef, saved.backend)}


jsd_forward = define_op(
    "jsd_forward", _jsd_forward, outputs=("jsd", "kl_student"),
    fake=lambda logits, ref_logits, target, *rest: _new_rows(logits, target.shape[0], 2),
    save=("logits", "ref_logits", "target", "temperature", "lse", "ref_lse", "beta", "backend", "kl_student"),
    backward=_jsd_backward, materialize_grads=False)


# ------------------------------------------------------------------------------------- JSD, LinearLogits
def _linear_jsd_forward(
    x: torch.Tensor,                     # student hidden [..., H] (or dense logits [..., V] when weight is None)
    weight: Optional[torch.Tensor],      # [V, H]
    bias: Optional[torch.Tensor],        # [V]
    scale: Optional[torch.Tensor],       # 0-dim float64
    softcap: Optional[torch.Tensor],     # 0-dim float64
    ref_x: torch.Tensor,                 # teacher side, as the student's (no gradient)
    ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor],
    ref_scale: Optional[torch.Tensor],
    ref_softcap: Optional[torch.Tensor],
    target: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    ref_lse: torch.Tensor,
    beta: torch.Tensor,
    tile_elements: int,
    backend: str,
) -> Pair:
    return tuple(dispatch.implementation("linear", backend).jsd_forward(
        Side(x, weight, bias, scale, softcap), Side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap), target,
        temperature, lse, ref_lse, beta, tile_elements))


def _linear_jsd_backward_kernel(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    softcap: Optional[torch.Tensor],
    ref_x: torch.Tensor,
    ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor],
    ref_scale: Optional[torch.Tensor],
    ref_softcap: Optional[torch.Tensor],
    target: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    ref_lse: torch.Tensor,
    beta: torch.Tensor,
    kl_student: torch.Tensor,
    coef: torch.Tensor,
    want_x: bool,
    want_weight: bool,
    want_bias: bool,
    tile_elements: int,
    backend: str,
) -> Triple:
    grads = dispatch.implementation("linear", backend).jsd_backward(
        Side(x, weight, bias, scale, softcap), Side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap), target,
        temperature, lse, ref_lse, beta, kl_student, coef, want_x, want_weight, want_bias, tile_elements)
    return tuple(x.new_empty(0) if d is None else d for d in grads)  # no aliased outputs


def _like_wanted(x, weight, bias, want):
    """Empty tensors shaped like the wanted ones of ``(x, weight, bias)`` (``[0]`` for the others)."""
    like = lambda t, wanted: t.new_empty(t.shape) if wanted and t is not None else x.new_empty(0)  # noqa: E731
    return tuple(like(t, w) for t, w in zip((x, weight, bias), want))


linear_jsd_backward = define_op(
    "linear_jsd_backward", _linear_jsd_backward_kernel, outputs=("d_x", "d_weight", "d_bias"),
    fake=lambda x, weight, bias, *rest: _like_wanted(x, weight, bias, rest[-5:-2]))

SIDE_NAMES = ("x", "weight", "bias", "scale", "softcap", "ref_x", "ref_weight", "ref_bias", "ref_scale", "ref_softcap")
PARAMETERS = ("x", "weight", "bias")


def _linear_jsd_backward(saved, grads):
    if grads["jsd"] is None:
        return {}
    want = [saved.needs_grad[name] for name in PARAMETERS]
    coef = jsd_coefficients(grads["jsd"], saved.beta, saved.temperature)
    out = linear_jsd_backward(*(getattr(saved, name) for name in SIDE_NAMES), saved.target, saved.temperature,
                              saved.lse, saved.ref_lse, saved.beta, saved.kl_student, coef, *want,
                              saved.tile_elements, saved.backend)
    return {name: d for name, d, w in zip(PARAMETERS, out, want) if w}


linear_jsd_forward = define_op(
    "linear_jsd_forward", _linear_jsd_forward, outputs=("jsd", "kl_student"),
    fake=lambda x, *rest: _new_rows(x, rest[9].shape[0], 2),
    save=(*SIDE_NAMES, "target", "temperature", "lse", "ref_lse", "beta", "tile_elements", "backend", "kl_student"),
    backward=_linear_jsd_backward, materialize_grads=False)


# ------------------------------------------------------------------- a loss with its gradient in the forward
def _loss_forward(
    logits: torch.Tensor,        # [..., V] student
    ref_logits: torch.Tensor,    # [..., V] teacher
    target: torch.Tensor,
    temperature: torch.Tensor,
    weight: torch.Tensor,        # [N] the loss's per-row weights (the reduction)
    kind: str,                   # a name of kltriton.kernels.divergence.KINDS
    beta: torch.Tensor,          # float64 [] (the JSD's)
    entropy: bool,               # also the student's entropy
    with_grad: bool,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    stats, divergence, grad = dispatch.implementation("divergence", backend).loss_forward(
        logits, ref_logits, target, temperature, kind, beta, weight, entropy, with_grad)
    return (weight * divergence).sum(), divergence, stats.entropy, grad


def _loss_forward_fake(logits, ref_logits, target, temperature, weight, kind, beta, entropy, with_grad, backend):
    n = target.shape[0]
    acc = accumulation_dtype(logits.dtype)
    return (logits.new_empty((), dtype=acc), logits.new_empty(n, dtype=acc),
            logits.new_empty(n if entropy else 0, dtype=acc),
            logits.new_empty((n if with_grad else 0, logits.shape[-1])))


def _loss_backward(saved, grads):
    if grads["loss"] is None:
        return {}
    return {"logits": scaled(saved.grad, grads["loss"], saved.backend).view(saved.logits.shape)}


divergence_loss = define_op(
    "divergence_loss", _loss_forward, outputs=("loss", "divergence", "entropy", "grad"), fake=_loss_forward_fake,
    save=("logits", "backend", "grad"), backward=_loss_backward, materialize_grads=False)


def _linear_loss_forward(
    x: torch.Tensor,                     # student hidden [..., H]
    weight: torch.Tensor,                # [V, H]
    bias: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    softcap: Optional[torch.Tensor],
    ref_x: torch.Tensor,                 # teacher hidden [..., H] or logits [..., V] (no gradient)
    ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor],
    ref_scale: Optional[torch.Tensor],
    ref_softcap: Optional[torch.Tensor],
    target: torch.Tensor,
    temperature: torch.Tensor,
    loss_weight: torch.Tensor,           # [N] the loss's per-row weights
    kind: str,
    beta: torch.Tensor,
    entropy: bool,
    want_x: bool,
    want_weight: bool,
    want_bias: bool,
    tile_elements: int,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    stats, divergence, *grads = dispatch.implementation("linear", backend).divergence_loss(
        Side(x, weight, bias, scale, softcap), Side(ref_x, ref_weight, ref_bias, ref_scale, ref_softcap), target,
        temperature, kind, beta, loss_weight, entropy, want_x, want_weight, want_bias, tile_elements)
    grads = tuple(x.new_empty(0) if d is None else d for d in grads)  # no aliased outputs
    return ((loss_weight * divergence).sum(), divergence, stats.entropy, *grads)


def _linear_loss_forward_fake(x, weight, bias, *rest):
    target, entropy, want = rest[7], rest[12], rest[13:16]
    n = target.shape[0]
    acc = accumulation_dtype(x.dtype)
    return (x.new_empty((), dtype=acc), x.new_empty(n, dtype=acc), x.new_empty(n if entropy else 0, dtype=acc),
            *_like_wanted(x, weight, bias, want))


def _linear_loss_backward(saved, grads):
    if grads["loss"] is None:
        return {}
    return {name: scaled(getattr(saved, "d_" + name), grads["loss"], saved.backend)
            for name in PARAMETERS if saved.needs_grad[name]}


linear_divergence_loss = define_op(
    "linear_divergence_loss", _linear_loss_forward, outputs=("loss", "divergence", "entropy", "d_x", "d_weight",
                                                             "d_bias"),
    fake=_linear_loss_forward_fake, save=("backend", "d_x", "d_weight", "d_bias"), backward=_linear_loss_backward,
    materialize_grads=False)


# ------------------------------------------------------------------------------ K columns (a top-k teacher)
def column_coefficients(g: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                        temperature: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
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


def column_logprobs_of(side, ids, target, temperature, lse, tile_elements):
    """``[N, K]`` ``x[ids] / T - lse`` of a ``Side`` by a ``K``-column gather (``-inf`` at padding ids, 0 on unscored
    rows)."""
    values = tiles.column_logits(side, ids, target >= 0, tile_elements)
    return columns_to_logprobs(values, ids, target, temperature, lse)


def _columns(
    logits: torch.Tensor,        # [..., V]
    ids: torch.Tensor,           # [N, K] int64 column ids (-1: padding)
    target: torch.Tensor,        # [N] int64: rows with target >= 0 are gathered
    temperature: torch.Tensor,   # float64 [] or [N]
    lse: torch.Tensor,           # [N] log-sum-exp of x / T (a stream statistic)
    tile_elements: int,
    backend: str,                # the stream backward's
) -> torch.Tensor:
    return column_logprobs_of(Side(logits, None, None, None, None), ids, target, temperature, lse, tile_elements)


def column_gradient(logits, ids, target, temperature, lse, logp, g, backend, own_ids=None):
    """The logits gradient of ``sum g * column log-probs`` (``g [N, K]`` on the column log-probs ``logp``): the
    ``stream`` backward's dense ``-p sum_k g_k / T``, then the ``K`` columns set to ``g_k / T - p_k sum_k g_k / T``
    from ``p_k = exp(logp_k)`` (rounded to the logits dtype once, as the kernel's label term). ``own_ids``: the columns
    this vocab shard holds, local ids (``-1`` elsewhere); default ``ids``."""
    c_p, c_cols = column_coefficients(g, ids, target, lse, temperature)
    own_ids = ids if own_ids is None else own_ids
    grad = stream_backward(logits, None, target, temperature, lse, None, torch.zeros_like(c_p), c_p, None, None, None,
                           backend)
    live = (target >= 0) & torch.isfinite(lse)
    p = torch.where(live[:, None] & (ids >= 0), logp.double().exp(), 0.0)
    tiles.set_columns(grad, own_ids, live, c_cols.double() - p * c_p.double()[:, None])
    return grad


def _columns_backward(saved, grads):
    return {"logits": column_gradient(saved.logits, saved.ids, saved.target, saved.temperature, saved.lse,
                                      saved.logp, grads["logp"], saved.backend)}


column_logprobs = define_op(
    "column_logprobs", _columns, outputs=("logp",),
    fake=lambda logits, ids, *rest: ids.new_empty(ids.shape, dtype=accumulation_dtype(logits.dtype)),
    save=("logits", "ids", "target", "temperature", "lse", "backend", "logp"), backward=_columns_backward)


def _linear_columns(
    x: torch.Tensor,                     # hidden [..., H]
    weight: torch.Tensor,                # [V, H]
    bias: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    softcap: Optional[torch.Tensor],
    ids: torch.Tensor,                   # [N, K] int64 (-1: padding)
    target: torch.Tensor,
    temperature: torch.Tensor,
    entropy: bool,                       # also the entropy (not differentiable here)
    tile_elements: int,
    backend: str,
) -> Triple:
    stats, values = dispatch.implementation("linear", backend).column_forward(
        Side(x, weight, bias, scale, softcap), target, temperature, statistics.request(entropy=entropy), ids,
        tile_elements)
    return columns_to_logprobs(values, ids, target, temperature, stats.lse), stats.lse, stats.entropy


def _linear_column_backward_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    softcap: Optional[torch.Tensor],
    target: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,                   # [N] whole rows' log-sum-exp
    c_p: torch.Tensor,                   # [N] fp32, / T
    ids: torch.Tensor,                   # [N, K] ids in this weight (-1: none)
    c_columns: torch.Tensor,             # [N, K] fp32, / T
    want_x: bool,
    want_weight: bool,
    want_bias: bool,
    tile_elements: int,
    backend: str,
) -> Triple:
    grads = dispatch.implementation("linear", backend).column_backward(
        Side(x, weight, bias, scale, softcap), target, temperature, lse, c_p, ids, c_columns, want_x, want_weight,
        want_bias, tile_elements)
    return tuple(x.new_empty(0) if d is None else d for d in grads)  # no aliased outputs


linear_column_backward = define_op(
    "linear_column_backward", _linear_column_backward_kernel, outputs=("d_x", "d_weight", "d_bias"),
    fake=lambda x, weight, bias, *rest: _like_wanted(x, weight, bias, rest[-5:-2]))


def linear_column_gradients(side, ids, target, temperature, lse, g, want, tile_elements, backend, own_ids=None):
    """``(d_x, d_weight, d_bias)`` of ``sum g * column log-probs`` of a projection ``side`` (``linear_column_backward``:
    the ``p`` term and the ``K`` columns on each GEMM tile). ``own_ids`` as in ``column_gradient``."""
    c_p, c_cols = column_coefficients(g, ids, target, lse, temperature)
    own_ids = ids if own_ids is None else own_ids
    out = linear_column_backward(*side, target, temperature, lse, c_p, own_ids, c_cols, *want, tile_elements,
                                 backend)
    return [d if w else None for d, w in zip(out, want)]


def _linear_columns_backward(saved, grads):
    if grads["logp"] is None:
        return {}
    want = [saved.needs_grad[name] for name in PARAMETERS]
    side = Side(saved.x, saved.weight, saved.bias, saved.scale, saved.softcap)
    out = linear_column_gradients(side, saved.ids, saved.target, saved.temperature, saved.lse, grads["logp"], want,
                                  saved.tile_elements, saved.backend)
    return {name: d for name, d, w in zip(PARAMETERS, out, want) if w}


def _linear_columns_fake(x, weight, bias, scale, softcap, ids, target, temperature, entropy, tile_elements, backend):
    acc = accumulation_dtype(x.dtype)
    n = target.shape[0]
    return ids.new_empty(ids.shape, dtype=acc), x.new_empty(n, dtype=acc), x.new_empty(n if entropy else 0, dtype=acc)


linear_column_logprobs = define_op(
    "linear_column_logprobs", _linear_columns, outputs=("logp", "lse", "entropy"), fake=_linear_columns_fake,
    save=("x", "weight", "bias", "scale", "softcap", "ids", "target", "temperature", "tile_elements", "backend",
          "lse"),
    backward=_linear_columns_backward, materialize_grads=False)
