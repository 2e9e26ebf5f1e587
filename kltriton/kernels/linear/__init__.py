"""Family ``linear``: the ``stream`` statistics of logits given as ``hidden @ weight.T`` (an LM head),
without building the ``[N, V]`` logits.

Every backend is the same algorithm (``tiles.py``): the platform GEMM (``torch.mm`` / ``addmm``:
cuBLAS on CUDA, the CPU BLAS on CPU) projects a tile of *scored* rows to an fp32 (float64 for
float64 inputs) ``[tile_rows, vocab_tile]`` logits tile, ``logit_scale`` / ``softcap`` are applied in
place, and the backend's own ``stream`` kernel folds the tile into per-row statistics (vocab tiles
are merged with ``kltriton.kernels.statistics.merge``). ``reference.py``, ``cpp.py`` and ``triton.py`` differ
only in that ``stream`` kernel; they support what their ``stream`` kernel supports (float64: the
reference only). Each module provides:

``forward(policy, ref, target, temperature, request, tile_elements) -> StreamStats``
    policy:  a ``Side``: ``x`` is hidden ``[..., H]`` with ``weight [V, H]`` (``bias [V]`` or None,
             ``scale`` / ``softcap`` 0-dim float64 tensors or None), or ``x`` is dense logits
             ``[..., V]`` with ``weight=None`` (the other side is then a projection).
             The logits it stands for: ``softcap * tanh(scale * (x @ weight.T + bias) / softcap)``.
    ref:     a ``Side`` or None (same leading shape and ``V`` as ``policy``).
    target, temperature, request: as in ``kltriton.kernels.stream`` (``N`` = rows of ``policy.x``). Only
             rows with ``target >= 0`` are projected. A target ``>= V`` marks a label held by another
             vocab shard (``kltriton.parallel``): the row's statistics are computed and its ``logp`` /
             ``ref_logp`` are ``LABEL_ELSEWHERE`` (``kltriton.kernels.statistics``).
    tile_elements: the working-tile budget: ``tile_rows * vocab_tile <= max(tile_elements, MIN_ROWS)``.
    Returns ``StreamStats`` as the ``stream`` family, in ``accumulation_dtype(policy.x.dtype)``.

``backward(policy, ref, target, temperature, lse, ref_lse, basis, want_x, want_weight, want_bias,
tile_elements) -> (d_x, d_weight, d_bias)``
    The ``stream`` backward on the gradient ``basis`` per recomputed tile (the label term only in the
    tile, and on the shard, that holds the label), chained through softcap and scale, then
    ``d_x = d_logits @ weight``, ``d_weight = d_logits.T @ x``, ``d_bias = d_logits.sum(0)``
    accumulated in fp32 and returned in the parameters' dtypes (``None`` where not request or
    absent; for a dense policy ``d_x`` is the logits gradient). ``ref`` gets no gradient.

``loss_forward(policy, ref, target, temperature, inputs, hyperparameters, loss_type, estimator, entropy_grad,
want_x, want_weight, want_bias, tile_elements) -> (StreamStats, d_x, d_weight, d_bias)``
    The ``loss`` family (``kltriton.kernels.loss``: same ``inputs``, ``hyperparameters``, ``loss_type``,
    ``estimator``, ``entropy_grad``; the loss types of ``terms.FUSED``, whose derivative is per row) on GEMM
    tiles of whole rows (``tiles.whole_rows``): per token tile, the logits tile, the backend's ``loss``
    kernel (statistics, then the tile's logits gradient), and the gradient's GEMMs into ``d_x`` /
    ``d_weight`` / ``d_bias`` (as ``backward`` returns them; ``None`` where not request). Three GEMMs per tile instead of the four of
    ``forward`` + ``backward`` (no recomputed logits), and no second pass over the rows.

``column_forward(policy, target, temperature, request, ids, tile_elements) -> (StreamStats, column_logits)``
``column_backward(policy, target, temperature, lse, c_p, ids, c_columns, want_x, want_weight, want_bias,
tile_elements) -> (d_x, d_weight, d_bias)``
    A top-k teacher's columns (``kltriton.ops.divergence``): ``forward`` of the policy alone, and its logits at
    ``ids [N, K]`` (``-1``: none) gathered from the same tiles; the gradient ``c_columns`` at ``ids`` ``- p * c_p``
    (``[N, K]``, ``[N]``, already divided by ``T``; the columns set in each tile's gradient before its GEMMs).

``jsd_forward(policy, ref, target, temperature, lse, ref_lse, beta, tile_elements) -> (jsd, kl_student)``
``jsd_backward(policy, ref, target, temperature, lse, ref_lse, beta, kl_student, coef, want_x, want_weight,
want_bias, tile_elements) -> (d_x, d_weight, d_bias)``
``divergence_loss(policy, ref, target, temperature, kind, beta, weight, entropy, want_x, want_weight, want_bias,
tile_elements) -> (StreamStats, divergence, d_x, d_weight, d_bias)``
    The ``divergence`` family (``kltriton.kernels.divergence``) on GEMM tiles: the JSD pass per vocab tile (sums
    added), its gradient per tile, and the divergence loss on tiles of whole rows (``tiles.bind_divergence``).

Memory: one ``[tile_rows, vocab_tile]`` tile (two in the backward: the tile and its gradient) plus
``O(N)`` plus the fp32 accumulators of the parameter gradients. Default budget ``DEFAULT_TILE``
elements per device, or ``KLTRITON_LINEAR_TILE``, or ``LinearLogits(..., tile_elements=)``.
"""
from typing import NamedTuple, Optional

import torch


class Side(NamedTuple):
    x: torch.Tensor                  # hidden [..., H], or dense logits [..., V] when weight is None
    weight: Optional[torch.Tensor]   # [V, H]
    bias: Optional[torch.Tensor]     # [V]
    scale: Optional[torch.Tensor]    # 0-dim float64 logit scale, None = 1
    softcap: Optional[torch.Tensor]  # 0-dim float64, None = no tanh cap


def scaled_and_capped(linear: torch.Tensor, scale: Optional[torch.Tensor],
                      softcap: Optional[torch.Tensor]) -> torch.Tensor:
    """The LM head's logits from ``linear = hidden @ weight.T + bias`` (any shape): ``softcap * tanh(scale * linear /
    softcap)``, each step only when given; out of place and differentiable (the tiles apply it in place)."""
    if scale is not None:
        linear = linear * scale
    if softcap is not None:
        linear = torch.tanh(linear / softcap) * softcap
    return linear
