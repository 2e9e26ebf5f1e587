"""Family ``loss``: a policy loss whose gradient w.r.t. the logits is produced in the forward.

For the loss types of ``terms.FUSED`` the derivative of the loss w.r.t. a row's log-prob, entropy and full
KL depends on that row alone (its statistics and per-row weights known before the kernel: aggregation
weights from the mask, importance-sampling weights, advantages), so one call computes the statistics and
writes the logits gradient. Two routes, one contract:

- ``composed.forward(stream, ...)``: the ``stream`` backend module ``stream``'s forward, the coefficients of
  ``terms.coefficients``, then its backward; the logits are read twice inside the forward call. The
  reference backend is this.
- the fused kernels (``cpp.py``: CPU; ``triton.py``: CUDA, or CPU under ``TRITON_INTERPRET=1``): per row, the
  statistics, the row's coefficients, then its gradient while the row is still in cache, so the logits are
  read from memory once. The cases a kernel does not take (C++: a reference in another dtype; Triton: no
  gradient request) run ``composed`` on the backend's own stream kernels.

Loss types whose derivative needs whole sequences or batch statistics (``terms.SEQUENCE``, ``terms.BATCH``)
are not members: ``kltriton.route`` sends them to the two-pass route (statistics, formulas, autograd). The
entropy mask (``masked.py``) runs a member's kernel, then ``accumulate_`` on the kept rows.

Each backend module provides:

``forward(logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator,
entropy_grad, with_grad, with_entropy=True) -> (StreamStats, grad)``
    logits, ref_logits, target, temperature: as in ``kltriton.kernels.stream``.
    inputs:      ``LossInputs`` of ``[N]`` tensors in ``accumulation_dtype(logits.dtype)``.
    hyperparameters: float64 vector, slots ``constants.HYPERPARAMETERS`` (``terms.hyperparameters``). Data,
                 so new values never recompile.
    loss_type:   a formula of ``terms.FUSED``.
    estimator:   ``""`` (no KL term) or an estimator's canonical name (``kltriton.estimators``).
    entropy_grad: whether ``inputs.w_ent`` may be nonzero (the entropy term of the gradient is skipped
                 otherwise).
    with_grad:   write the gradient; otherwise ``grad`` is ``[0, V]``.
    with_entropy: compute the entropy (False: no entropy work; ``entropy`` is ``[0]``; needs ``entropy_grad``
                 False).
    The loss is ``sum_n objective_n`` (``terms.objective``). Returns ``StreamStats`` (``[N]``, statistics
    dtype: ``logp``, ``lse``, ``entropy``; the reference pair with ``ref_logits``; ``full_kl`` for the ``"full"``
    estimator) and ``grad``: ``d loss / d logits``, contiguous ``[N, V]`` in ``logits.dtype``, zero on rows
    with ``target < 0`` or without a distribution.

``forward_labels(logits, ref_logits, labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, shift, flags,
weights, temperature, old_logp, ref_logp, hyperparameters, loss_type, estimator, entropy_grad, with_grad,
with_entropy) -> (target, StreamStats, grad, LossTerms)``
    The ``layout`` family's ``target_weights`` of the label side (its arguments as in ``kltriton.kernels.stream``'s
    ``forward_labels``, the vocabulary the logits'; ``weights`` a ``kltriton.kernels.layout.RowWeights``), then
    ``forward`` and ``terms`` at that target on ``LossInputs(old_logp, advantages, w_pg, w_kl, w_ent, ref_logp,
    w_agg)`` of its rows (``old_logp`` and ``ref_logp`` ``[N]`` or of the logits' leading shape, or None). One op on
    the cpp backend (each op called from Python costs the host more than the three kernels at small ``N``); the
    others compose the three (``composed.forward_labels``).

``accumulate_(grad, logits, target, temperature, lse, basis) -> None``
    ``grad += `` the gradient on ``basis`` (``kltriton.kernels.statistics.Basis``, the ``label``, ``p`` and
    optional ``p_logp`` terms) of the rows with ``target >= 0``, a finite ``lse`` and a nonzero coefficient;
    the other rows are neither read nor written (the entropy mask's last pass, ``masked.py``).

``terms(stats, target, inputs, hyperparameters, loss_type, estimator) -> LossTerms``
    After ``forward``: the per-token terms of every row from its statistics and ``inputs`` (``terms.token_terms``),
    the loss ``sum(w_pg * pg + w_kl * kl + w_ent * entropy)``, and the metrics (``constants.LOSS_METRICS``: ``pg_loss
    = sum(w_pg * pg)``, ``kl_loss`` and ``entropy_loss`` with ``w_agg``; the means of verl's clip flags, of
    ``-log_ratio`` (``ppo_kl``), of the KL and of the entropy over the rows with ``target != SKIP``; the ratio's
    largest and smallest value there, 0 without any), summed in row order. One kernel on the cpp and triton backends.

``scale_(grad, upstream) -> None``
    ``grad *= upstream`` in place (``upstream`` 0-dim on the same device). When ``upstream`` is exactly
    1 the cpp and triton backends move no ``[N, V]`` bytes, decided on the device (no host sync).
"""
from typing import NamedTuple, Optional

import torch

from kltriton.kernels import constants, statistics


class LossInputs(NamedTuple):
    """The loss's per-row inputs (``[N]``)."""
    old_logp: Optional[torch.Tensor]   # old log-probs, or None: on-policy (old = logp, ratio 1)
    advantages: torch.Tensor
    w_pg: torch.Tensor                 # aggregation weight * importance-sampling weight
    w_kl: torch.Tensor                 # kl_coef * aggregation weight
    w_ent: torch.Tensor                # -entropy_coef * aggregation weight
    ref_logp: Optional[torch.Tensor]   # given reference log-probs (None with ref_logits or no KL)
    w_agg: Optional[torch.Tensor] = None  # the aggregation weight alone (the metrics' pg / kl / entropy loss); None: w_pg


class LossTerms(NamedTuple):
    """``terms``' results."""
    loss: torch.Tensor     # [] the loss
    kl: torch.Tensor       # [N] the KL term (times the ratio with kl_ratio), 0 where not scored
    ratio: torch.Tensor    # [N] the importance ratio, 0 where not scored
    metrics: torch.Tensor  # [len(constants.LOSS_METRICS)] fp32


def row_inputs(prepared, old_logp, ref_logp) -> LossInputs:
    """The ``LossInputs`` of the layout family's ``prepared [5, N]`` rows (advantages, aggregation weights, ``w_pg``,
    ``w_kl``, ``w_ent``: ``target_weights``) and the given old and reference log-probs (or None)."""
    advantages, w_agg, w_pg, w_kl, w_ent = prepared.unbind()
    return LossInputs(old_logp, advantages, w_pg, w_kl, w_ent, ref_logp, w_agg)


def reference_logp(stats, inputs):
    """The reference log-probs a loss's KL reads: the forward's (reference logits) or the given ones."""
    return stats.ref_logp if stats.ref_logp.shape == stats.logp.shape else inputs.ref_logp


def statistics_request(has_ref_logits: bool, estimator: str, entropy: bool = True) -> int:
    """The statistics a loss forward computes: the entropy unless told not to, the reference pair with reference
    logits, the full KL for the ``"full"`` estimator."""
    return statistics.request(entropy=entropy, ref=has_ref_logits, full_kl=estimator == "full")


__all__ = ["LossInputs", "LossTerms", "constants", "reference_logp", "row_inputs", "statistics_request"]
