"""The invariant mode: ``kltriton.set_invariant(True)`` (or ``KLTRITON_INVARIANT=1``).

In this mode every log-prob, log-sum-exp and entropy (of the policy, the reference, and of a truncated
distribution) is bitwise independent of the batch composition, the ``LinearLogits`` tile size, the kernels' block
sizes, the replay support's padding and the number of vocab shards (where they cut the vocabulary): a row's
reductions are a maximum and int64 fixed-point sums (the ``invariant`` kernel family, ``kltriton.kernels.invariant``),
both associative. ``kltriton.route`` sends the statistics here in this mode; this module runs them on this rank's
rows or over vocab shards (each rank holds ``[start, start + size)``):

- dense logits (``dense``): the rows' maxima, one all-reduce max of ``[N]`` values over the ranks, the fixed-point
  sums (and the label's logit) of each shard, one int64 all-reduce of ``[k + 2, N]``, then ``finalize``;
- an LM head (``linear``): the same per token tile, the logits built by GEMMs of one fixed shape
  (``kltriton.kernels.invariant.linear``);
- a truncation (recompute mode): the floor by ``kltriton.sharded_floor`` with fixed-point masses (``floor``), then
  the statistics of the entries above it. Replay is invariant in every mode.

Gradients w.r.t. the logits are per entry given the row's ``lse`` (the ``stream`` / ``truncation`` families'
backward), so they are invariant too; an LM head's hidden-state gradient is a sum over the vocabulary (over GEMM
blocks and ranks, in floating point) and is not.
"""
from typing import NamedTuple, Optional

import torch

from kltriton import dispatch
from kltriton._env import invariant_default
from kltriton._autograd import first_order
from kltriton.kernels import OUT_OF_RANGE, accumulation_dtype, constants
from kltriton.kernels import statistics as table
from kltriton.kernels.invariant import pack, unpack
from kltriton.kernels.linear import Side, fixed
from kltriton.kernels.row_views import as_rows3d
from kltriton.kernels.statistics import StreamStats
from kltriton.ops import invariant as invariant_ops
from kltriton.ops import statistics as statistics_ops
from kltriton.ops import truncation as truncation_ops
from kltriton.ops._define import NeedsGrad
from kltriton import collectives

_ENABLED = invariant_default()


def set_invariant(enabled: bool) -> bool:
    """Turn the invariant mode on or off (default: off, or ``KLTRITON_INVARIANT=1`` at import).

    On: ``token_logprobs``, ``token_kl`` (per-token estimators), ``fused_kl_reward`` and ``policy_loss`` (its two-pass
    route) give log-probs, log-sum-exps and entropies bitwise independent of the batch composition, the
    ``LinearLogits`` tile size, the kernels' block sizes, the replay support's padding and the number of vocab shards
    (``process_group`` / DTensor), on each backend; their logits gradients follow. The exact KL over the vocabulary
    (``estimator="full"``) and ``token_divergence`` raise a ``ValueError`` in this mode. See
    ``docs/engine.md`` for what it costs.

    Returns the previous setting, so a caller can restore it.
    """
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


def enabled() -> bool:
    """Whether the invariant mode is on."""
    return _ENABLED


def refuse(what: str):
    """The error of a computation the invariant mode does not cover."""
    raise ValueError(f"{what} is not available in the invariant mode (kltriton.set_invariant(True)): its sums over the "
                     "vocabulary merge in floating point, so they depend on where vocab shards and tiles cut it. "
                     "Switch the mode off for this call (kltriton.set_invariant(False) returns the previous setting).")


def check_request(request: int):
    """The invariant mode computes ``logp``, ``lse``, ``entropy`` and the reference's ``logp`` / ``lse``."""
    if request & constants.FULL_KL:
        refuse("the exact KL over the vocabulary (estimator='full')")
    if request & constants.FORWARD_KL:
        refuse("the forward KL over the vocabulary")


class Setup(NamedTuple):
    """Plain values of a pass: the vocab shard (``group`` None: this rank's rows are whole) and the kernels."""
    group: object
    start: object   # the shard's first global id (an int, or a 0-dim tensor learned on the device)
    size: int       # V_local
    request: int    # request bits (ENTROPY or 0)
    backend: str


def setup(shard, request: int, backend: str, width: int) -> Setup:
    """The ``Setup`` of a pass over ``width`` ids (``shard``: a ``parallel.VocabShard`` or None)."""
    if shard is None:
        return Setup(None, 0, width, request, backend)
    return Setup(shard.group, shard.start, shard.size, request, backend)


def _collectives():

    return collectives.all_reduce_max, collectives.all_reduce


def localize(target, start, size):
    """``(kernel_target, own)``: this shard's column of each scored row's label, column 0 where another shard holds
    it (the row is read all the same); the sentinels stay. ``own``: ``[N]`` bool, the label is in this shard."""
    local = target - start
    own = (target >= 0) & (local >= 0) & (local < size)
    return torch.where(target < 0, target, torch.where(own, local, torch.zeros_like(local))), own


def label_logits(logits, target, floor) -> torch.Tensor:
    """``[N]`` float64 logit at each row's ``target`` column (column 0 for a sentinel), ``-inf`` below the floor."""
    rows3d = as_rows3d(logits)
    a, b, _ = rows3d.shape
    x = rows3d.gather(2, target.clamp(min=0).view(a, b, 1)).reshape(-1).double()
    if floor is not None:
        x = torch.where(x < floor.double(), torch.full((), float("-inf"), dtype=torch.float64, device=x.device), x)
    return x


def _dense_forward(s: Setup, logits, target, temperature, floor):
    """``(StreamStats, backward target, own)`` of dense rows (``own`` None when whole)."""
    acc = accumulation_dtype(logits.dtype)
    if s.group is None:
        row_max, sums = invariant_ops.forward(logits, target, temperature, floor, s.request, s.backend)
        stats = invariant_ops.finalize(row_max, sums, label_logits(logits, target, floor), target >= 0, target,
                                       temperature, s.request, acc)
        return stats, target, None
    all_reduce_max, all_reduce = _collectives()
    kernel_target, own = localize(target, s.start, s.size)
    row_max = all_reduce_max(invariant_ops.maxima(logits, kernel_target, floor, s.backend), s.group)
    sums = invariant_ops.sums(logits, kernel_target, temperature, row_max, floor, s.request, s.backend)
    label = label_logits(logits, kernel_target, floor)
    sums, held, label = unpack(all_reduce(pack(sums, own, label), s.group))
    stats = invariant_ops.finalize(row_max, sums, label, held, target, temperature, s.request, acc)
    # a label no shard holds: NaN statistics, no gradient
    backward_target = torch.where((target >= 0) & ~held, torch.full_like(target, OUT_OF_RANGE), kernel_target)
    return stats, backward_target, own


def stats_of(logp, lse, entropy) -> StreamStats:
    """``StreamStats`` with these three (the others empty)."""
    none = lse.new_empty(0)
    found = {"logp": logp, "lse": lse, "entropy": entropy}
    return StreamStats(*(found.get(name, none) for name in table.NAMES))


class _Dense(torch.autograd.Function):
    """``(logp, lse, entropy)`` of dense rows (``entropy`` empty unless asked), differentiable w.r.t. the logits: the
    ``stream`` backward (with a floor: the ``truncation`` one) on the statistics' basis, the label term on the shard
    that holds the label."""

    @staticmethod
    def forward(ctx, s: Setup, logits, target, temperature, floor):
        stats, backward_target, own = _dense_forward(s, logits.detach(), target, temperature, floor)
        ctx.s = s
        ctx.save_for_backward(logits, backward_target, own, temperature, floor, stats.logp, stats.lse, stats.entropy)
        ctx.mark_non_differentiable(stats.lse)
        ctx.set_materialize_grads(False)
        return stats.logp, stats.lse, stats.entropy

    @staticmethod
    @first_order("the invariant mode's dense statistics")
    def backward(ctx, g_logp, _g_lse, g_entropy):
        logits, target, own, temperature, floor, logp, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[1] or (g_logp is None and g_entropy is None):
            return None, None, None, None, None
        stats, grads, name = stats_of(logp, lse, entropy), {"logp": g_logp, "entropy": g_entropy}, ctx.s.backend
        if floor is None:
            dense_side = Side(logits, None, None, None, None)
            d = statistics_ops.gradients(dense_side, None, target, temperature, 0, name, grads, stats,
                                         NeedsGrad(True, False, False), label_here=own)[0]
        else:
            d = truncation_ops.gradient(logits, target, temperature, floor, stats, grads, name, label_here=own)
        return None, d, None, None, None


def dense(logits, target, temperature, floor: Optional[torch.Tensor], request: int, backend: str,
          shard) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``request`` asks) of dense logits (this rank's vocab
    shard with ``shard``) restricted to the entries ``>= floor`` (None: all), differentiable w.r.t. the logits."""
    s = setup(shard, request, backend, logits.shape[-1])
    return stats_of(*_Dense.apply(s, logits, target, temperature, floor))


def _identity(tensor, *_):
    return tensor


class _Linear(torch.autograd.Function):
    """``(logp, lse, entropy)`` of an LM head (``kernels.linear.fixed``), differentiable w.r.t. its hidden states,
    weight and bias; with a vocab shard the hidden gradient is summed over the ranks."""

    @staticmethod
    def forward(ctx, s: Setup, tile_elements, target, temperature, hidden, weight, bias, scale, softcap):
        side = Side(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), scale, softcap)
        acc = accumulation_dtype(hidden.dtype)
        if s.group is None:
            label, reduce_max, reduce_sum = torch.where(target >= 0, target, -1), _identity, _identity
        else:
            all_reduce_max, all_reduce = _collectives()
            kernel_target, own = localize(target, s.start, s.size)
            label = torch.where(own, kernel_target, -1)
            reduce_max, reduce_sum = (lambda t: all_reduce_max(t, s.group)), (lambda t: all_reduce(t, s.group))
        impl = dispatch.implementation("invariant", s.backend)
        row_max, packed = fixed.forward(side, target >= 0, label, temperature, s.request, impl, tile_elements,
                                        reduce_max, reduce_sum)
        sums, held, value = unpack(packed)
        stats = invariant_ops.finalize(row_max, sums, value, held, target, temperature, s.request, acc)
        ctx.s = s
        ctx.save_for_backward(hidden, weight, bias, scale, softcap, (target >= 0) & held, label, temperature,
                              stats.logp, stats.lse, stats.entropy)
        ctx.mark_non_differentiable(stats.lse)
        ctx.set_materialize_grads(False)
        return stats.logp, stats.lse, stats.entropy

    @staticmethod
    @first_order("the invariant mode's LM-head statistics")
    def backward(ctx, g_logp, _g_lse, g_entropy):
        hidden, weight, bias, scale, softcap, read, label, temperature, logp, lse, entropy = ctx.saved_tensors
        needs_grad = ctx.needs_input_grad[4:7]
        if not any(needs_grad) or (g_logp is None and g_entropy is None):
            return (None,) * 9
        basis = table.gradient_basis({"logp": g_logp, "entropy": g_entropy}, stats_of(logp, lse, entropy),
                                     temperature)
        side = Side(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), scale, softcap)
        stream = dispatch.implementation("stream", ctx.s.backend)
        d_x, d_weight, d_bias = fixed.backward(side, read, label, temperature, lse, basis, stream, needs_grad)
        if d_x is not None and ctx.s.group is not None:
            _, all_reduce = _collectives()
            d_x = all_reduce(d_x.contiguous(), ctx.s.group)
        return None, None, None, None, d_x, d_weight, d_bias, None, None


def linear(side: Side, target, temperature, request: int, backend: str, tile_elements: int, shard) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``request`` asks) of an LM head (its weight this rank's
    vocab shard with ``shard``), differentiable w.r.t. its hidden states, weight and bias. ``tile_elements`` only
    decides whether a token tile's whole rows are held (one GEMM per window) or each window built twice."""
    s = setup(shard, request, backend, side.weight.shape[0])
    return stats_of(*_Linear.apply(s, tile_elements, target, temperature, *side))


def floor(logits, target, temperature, knobs, shard) -> torch.Tensor:
    """The ``truncation`` family's floor with fixed-point masses: ``sharded_floor.local_floor`` of whole rows, or
    ``shard_floor`` over the shards (the same floor, bit for bit)."""
    from kltriton import sharded_floor

    if shard is None:
        return sharded_floor.local_floor(logits, target, temperature, knobs)
    return sharded_floor.shard_floor(logits, target, temperature, knobs, shard.group, fixed_point=True)


def head_rows(device) -> int:
    """Rows of an LM head's logits tile in this mode (``kernels.linear.fixed.geometry``)."""
    return fixed.geometry(device.type)[0]


head = fixed.head
