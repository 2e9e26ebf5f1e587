"""Family ``loss``: a policy loss whose gradient w.r.t. the logits is produced in the forward.

For token-level losses (``ppo``, ``cispo``) the derivative of the loss w.r.t. a row's log-prob,
entropy and full KL is closed-form in row-local values and per-row weights known before the
kernel (aggregation weights from the mask, importance-sampling weights, advantages), so one call
computes the row's statistics and writes the row's logits gradient. ``gspo`` (a sequence-level
ratio) is not a member: ``kltriton.ops.policy_loss`` runs it as the stream family plus autograd.

Backends: ``cpp.py`` (CPU) and ``triton.py`` (CUDA, or CPU under ``TRITON_INTERPRET=1``): one
pass per row, the statistics, the row's coefficients, then its gradient while the row is still in
cache, so the logits are read from memory once; ``reference.py`` (any float dtype: the stream
family's forward, the coefficients of ``terms.coefficients`` on ``[N]`` tensors, the stream
family's backward; two reads of the logits inside the forward call). ``composed.py`` is that
composition for any stream backend: the C++ backend runs it for a reference in another dtype, the
Triton backend when no gradient is wanted. Each module provides:

``forward(logits, ref_logits, target, temperature, rows, bounds, loss_type, estimator, entropy_grad,
with_grad) -> (LossStats, grad)``
    logits, ref_logits, target, temperature: as in ``kltriton.kernels.stream``.
    rows:        ``LossRows`` of ``[N]`` tensors in ``accumulation_dtype(logits.dtype)``.
    bounds:      float64 ``[4]``: ``1 - clip_low``, ``1 + clip_high``, the dual clip (``inf``: off), the
                 KL clamp (``inf``: off). Data, so new values never recompile.
    loss_type:   ``"ppo"`` or ``"cispo"``.
    estimator:   ``""`` (no KL term), or a canonical estimator (``kltriton.estimators``) with an optional
                 ``"+"`` (value of the estimator, gradient of ``k2``; not for ``"full"``).
    entropy_grad: whether ``rows.w_ent`` may be nonzero (the entropy term of the gradient is skipped
                 otherwise).
    with_grad:   write the gradient; otherwise ``grad`` is ``[0, V]``.
    The loss is ``sum_n objective_n`` (``terms.objective``). Returns ``LossStats`` (``[N]``, statistics
    dtype; ``ref_logp`` empty without ``ref_logits``, ``full_kl`` empty unless the estimator is ``"full"``)
    and ``grad``: ``d loss / d logits``, contiguous ``[N, V]`` in ``logits.dtype``, zero on rows with
    ``target < 0`` or without a distribution.

``scale_(grad, upstream) -> None``
    ``grad *= upstream`` in place (``upstream`` 0-dim on the same device). When ``upstream`` is exactly
    1 the cpp and triton backends move no ``[N, V]`` bytes, decided on the device (no host sync).
"""
from typing import NamedTuple, Optional

import torch


class LossRows(NamedTuple):
    old_logp: Optional[torch.Tensor]  # [N] old log-probs, or None: on-policy (old = logp, ratio 1)
    advantages: torch.Tensor          # [N]
    w_pg: torch.Tensor                # [N] aggregation weight * importance-sampling weight
    w_kl: torch.Tensor                # [N] kl_coef * aggregation weight
    w_ent: torch.Tensor               # [N] -entropy_coef * aggregation weight
    ref_logp: Optional[torch.Tensor]  # [N] given reference log-probs (None with ref_logits or no KL)


class LossStats(NamedTuple):
    logp: torch.Tensor      # [N]
    entropy: torch.Tensor   # [N]
    ref_logp: torch.Tensor  # [N] or [0]
    full_kl: torch.Tensor   # [N] or [0]
