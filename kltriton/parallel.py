"""Vocab-parallel statistics: each rank of a process group holds a contiguous vocabulary shard.

Imported by ``kltriton.route`` only. Rank ``r`` holds ``logits[..., V_r]``, the ids
``[start_r, start_r + V_r)``; labels are global ids.

Forward: each rank runs the ``stream`` kernel on its shard as if it were the whole row (a row whose
label is on another shard is scored on a dummy in-shard label, column 0, and its log-prob ignored),
then ONE all-gather exchanges one fp32 number per present statistic and row (2 for log-probs: local lse
and label log-prob; +1 entropy; +2 reference lse and label log-prob; +1 full KL), and every rank merges
them with ``kltriton.kernels.statistics.merge`` into the exact global statistics.

Backward: no communication. The ``stream`` backward on the *global* statistics' gradient basis computes
exactly the global gradient restricted to the shard; the label term is kept only on the shard that holds
the label (the other shards get a zero label coefficient at their dummy column).

``LinearLogits`` with a weight shard ``[V_local, H]`` (``_ShardLinear``): the same forward with the
``linear`` kernel (a row whose label is on another shard gets the target ``V_local``, which that
family reads as "no label here"); backward: the weight and bias gradients stay local, the hidden
gradient is summed over the ranks with one all-reduce of ``N x H`` values.

The collectives are ``torch.distributed._functional_collectives`` (``all_gather_single``,
``all_reduce``), which ``torch.compile`` traces; the autograd functions never differentiate through
a collective.
"""
import os
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from kltriton._inputs import host_checks
from kltriton.kernels import OUT_OF_RANGE, SKIP, statistics
from kltriton.kernels.statistics import NOT_HERE, StreamStats
from kltriton.kernels.linear import Side
from kltriton.kernels.rows import as_rows3d
from kltriton.ops import divergence, linear, stream
from kltriton.ops import truncation as truncation_ops

# Label bound when the global vocabulary is not known (``vocab_start`` given, validation off): a
# label past the last shard then lies in no shard and its position gives NaN, like OUT_OF_RANGE.
UNBOUNDED = 2 ** 62


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's ``tensor``, as a functional collective (traced by ``torch.compile``)."""
    import torch.distributed._functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[K * M, ...]``: every rank's ``[M, ...]`` tensor in rank order, as a functional collective
    (traced by ``torch.compile``). Imported here: builds without ``torch.distributed`` lack it."""
    import torch.distributed._functional_collectives as funcol
    return funcol.all_gather_single(tensor, 0, group)


class VocabShard(NamedTuple):
    group: object                    # torch.distributed.ProcessGroup
    start: Union[int, torch.Tensor]  # first global id of this rank's shard (0-dim int64 when learned on the device)
    size: int                        # V_local, this rank's number of ids
    vocab: Union[int, torch.Tensor]  # labels must be < vocab: the global V, or UNBOUNDED when not learned
    spans: str = ""                  # the ranks' shards, for error messages ("rank 0: [0, 25), ..."), when known


def _check_tiling(table, vocab_start):
    """``table``: per rank ``[start, V_local, rows]``; the shards must tile ``[0, V)`` and agree on rows."""
    if len({rows for _, _, rows in table}) != 1:
        raise ValueError("logits must have the same leading shape on every rank of process_group, got "
                         f"{[rows for _, _, rows in table]} rows")
    spans = sorted((start, start + size, rank) for rank, (start, size, _) in enumerate(table))
    end = 0
    for start, stop, _ in spans:
        if start != end:
            shown = ", ".join(f"rank {r}: [{a}, {b})" for a, b, r in sorted(spans, key=lambda s: s[2]))
            raise ValueError(f"vocab_start: the ranks' shards [vocab_start, vocab_start + V_local) must tile "
                             f"[0, V) without gaps or overlaps, got {shown} (this rank passed {vocab_start})")
        end = stop


def vocab_shard(size: int, rows: int, device, process_group, vocab_start) -> Optional[VocabShard]:
    """This rank's shard of the vocabulary (``size`` ids, the shard of ``rows`` positions on ``device``), or ``None``
    without a process group.

    ``vocab_start=None`` learns it with one all-gather of 3 int64 per rank (the sum of the lower
    ranks' ``V_local``). With validation on (``kltriton.set_validation``), the same all-gather checks
    that the shards tile ``[0, V)`` and that every rank has the same number of rows (a host sync);
    with validation off and ``vocab_start`` given, nothing is exchanged here.
    """
    if process_group is None:
        if vocab_start is not None:
            raise ValueError("vocab_start is only meaningful with a process_group")
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1 and dist.is_available() and not dist.is_initialized():
            raise ValueError(f"process_group is None in a distributed launch (WORLD_SIZE={world}) before "
                             "torch.distributed.init_process_group: dist.group.WORLD is None until then, so the call "
                             "would run on this rank's shard alone. Initialize the process group first (or run "
                             "without WORLD_SIZE for a single process).")
        return None
    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
    if vocab_start is not None:
        if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
            raise TypeError(f"vocab_start must be an int or None, got {type(vocab_start).__name__}")
        if vocab_start < 0:
            raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    validate = host_checks()
    if vocab_start is not None and not validate:
        return VocabShard(process_group, vocab_start, size, UNBOUNDED)
    rank = dist.get_rank(process_group)
    mine = torch.tensor([-1 if vocab_start is None else vocab_start, size, rows], dtype=torch.int64, device=device)
    table = _all_gather(mine, process_group).view(-1, 3)
    if not validate:  # vocab_start is None: learn it on the device, no host sync
        sizes = table[:, 1]
        return VocabShard(process_group, sizes[:rank].sum(), size, sizes.sum())
    table = table.tolist()
    lower = 0
    for entry in table:  # a rank that passed None takes the default start
        entry[0], lower = (lower if entry[0] < 0 else entry[0]), lower + entry[1]
    _check_tiling(table, vocab_start)
    spans = ", ".join(f"rank {r}: [{start}, {start + local})" for r, (start, local, _) in enumerate(table))
    return VocabShard(process_group, table[rank][0], size, sum(entry[1] for entry in table), spans)


def same_group(group, other) -> bool:
    """Whether two process groups hold the same ranks (a DeviceMesh's group may be another object)."""
    return group is other or dist.get_process_group_ranks(group) == dist.get_process_group_ranks(other)


def chunked_shard(group, start: int, size: int, vocab: int) -> VocabShard:
    """The ``VocabShard`` of a DTensor's vocabulary dimension, sharded over ``group`` as ``torch.chunk`` splits it
    (``ceil(V / n)`` ids a rank, the last ones shorter or empty): known from the placement, no collective."""
    parts = dist.get_world_size(group)
    chunk = -(-vocab // parts)
    spans = ", ".join(f"rank {r}: [{min(r * chunk, vocab)}, {min((r + 1) * chunk, vocab)})" for r in range(parts))
    return VocabShard(group, start, size, vocab, spans)


def exchange_stats(local: StreamStats, has_label: torch.Tensor, wanted: int, group) -> Tuple[StreamStats, torch.Tensor]:
    """Global statistics from every rank's local ones: one all-gather of one value per present statistic and row.

    Args:
        local: this rank's ``StreamStats`` of its shard (``[N]`` each; absent ones empty), as the
            ``stream`` kernel returns them for the shard alone.
        has_label: ``[N]`` bool, whether this rank's shard holds the row's label (its ``logp`` /
            ``ref_logp`` are then the label's local log-probs; elsewhere they are ignored).
        wanted: the request bits that produced ``local``.
    Returns:
        ``(StreamStats, labelled)``: the merged global ``[N]`` statistics (``statistics.merge``) and
        ``[N]`` bool, whether any rank holds the row's label (no outputs are masked here).
    """
    n = local.lse.shape[0]
    names = [name for name in statistics.NAMES if statistics.present(wanted, name)]
    columns = [torch.where(has_label, value, torch.full_like(value, NOT_HERE)) if name in ("logp", "ref_logp")
               else value for name, value in ((name, getattr(local, name)) for name in names)]
    gathered = _all_gather(torch.stack(columns), group)  # [K * m, N], rank-major
    pieces = dict(zip(names, gathered.view(-1, len(columns), n).unbind(1)))  # m tensors [K, N]
    return statistics.merge(pieces, wanted), (pieces["logp"] != NOT_HERE).any(0)


def _masked(value, skip, bad):
    """0 at unscored rows, NaN at rows scored on a label no shard holds (as the kernels do)."""
    if value.shape[0] != skip.shape[0]:
        return value
    value = torch.where(bad, torch.full_like(value, float("nan")), value)
    return torch.where(skip, torch.zeros_like(value), value)


def _localize(target, start, size, elsewhere):
    """``(kernel_target, own)``: this shard's column of each row's global label, ``elsewhere`` for a
    label on another shard; the sentinels (``SKIP``, ``OUT_OF_RANGE``) stay. ``own``: ``[N]`` bool,
    the label is in this shard."""
    local_id = target - start
    own = (target >= 0) & (local_id >= 0) & (local_id < size)
    return torch.where(target < 0, target, torch.where(own, local_id, torch.full_like(local_id, elsewhere))), own


def _global_stats(local: StreamStats, target, kernel_target, own, wanted, group):
    """``(stats, backward_target)``: the global statistics (one all-gather), 0 at unscored rows and
    NaN at rows scored on a label no shard holds; the kernel target of the backward, where those
    rows are ``OUT_OF_RANGE`` (no gradient)."""
    stats, labelled = exchange_stats(local, own, wanted, group)
    skip = target == SKIP
    bad = (target == OUT_OF_RANGE) | ((target >= 0) & ~labelled)
    no_nan = torch.zeros_like(bad)
    stats = StreamStats(*(_masked(getattr(stats, name), skip, no_nan if name.endswith("lse") else bad)
                          for name in statistics.NAMES))
    backward_target = torch.where(bad, torch.full_like(kernel_target, OUT_OF_RANGE), kernel_target)
    return stats, backward_target


class _ShardStream(torch.autograd.Function):
    """``stream`` over vocab shards: local kernel, one all-gather, merge; backward from the saved
    global statistics' gradient basis (no collective, nothing differentiated through one)."""

    @staticmethod
    def forward(ctx, logits, ref_logits, target, temperature, wanted, backend, group, start):
        # A row whose label is on another shard is scored on a dummy in-shard label, column 0.
        kernel_target, own = _localize(target, start, logits.shape[-1], 0)
        local = StreamStats(*stream.stream_forward(logits, ref_logits, kernel_target, temperature, wanted, backend))
        stats, backward_target = _global_stats(local, target, kernel_target, own, wanted, group)
        ctx.save_for_backward(logits, ref_logits, backward_target, temperature, own, *stats)
        ctx.backend = backend
        ctx.mark_non_differentiable(stats.lse, stats.ref_logp, stats.ref_lse)
        ctx.set_materialize_grads(False)
        return tuple(stats)

    @staticmethod
    def backward(ctx, *grads):
        logits, ref_logits, target, temperature, own, *values = ctx.saved_tensors
        stats = StreamStats(*values)
        basis = statistics.gradient_basis(dict(zip(statistics.NAMES, grads)), stats, temperature)
        basis = basis._replace(label=torch.where(own, basis.label, 0))  # the label term on its own shard only
        with_ref = basis.reads_ref()
        grad = stream.stream_backward(logits, ref_logits if with_ref else None, target, temperature, stats.lse,
                                      stats.ref_lse if with_ref else None, *basis, ctx.backend)
        return grad, None, None, None, None, None, None, None


class _ShardLinear(torch.autograd.Function):
    """``linear`` (``LinearLogits``) over vocab shards: each rank holds ``weight [V_local, H]`` (and
    ``bias [V_local]``), the hidden states are replicated. Forward: the local ``linear`` kernel (a row
    whose label is on another shard gets the target ``V_local``: statistics without a label), one
    all-gather, merge. Backward: the local kernel from the global statistics gives the shard's
    weight / bias gradient (kept local) and its part of the hidden gradient, summed over the ranks
    by one all-reduce (in the hidden states' dtype, as Megatron's tensor-parallel LM head does)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, softcap, ref_x, ref_weight, ref_bias, ref_scale, ref_softcap, target,
                temperature, wanted, tile_elements, backend, group, start):
        sides = (x, weight, bias, scale, softcap, ref_x, ref_weight, ref_bias, ref_scale, ref_softcap)
        size = x.shape[-1] if weight is None else weight.shape[0]
        kernel_target, own = _localize(target, start, size, size)
        local = StreamStats(*linear.linear_forward(*sides, kernel_target, temperature, wanted, tile_elements, backend))
        stats, backward_target = _global_stats(local, target, kernel_target, own, wanted, group)
        ctx.save_for_backward(*sides, backward_target, temperature, *stats)
        ctx.flags = (backend, tile_elements, group)
        ctx.mark_non_differentiable(stats.lse, stats.ref_logp, stats.ref_lse)
        ctx.set_materialize_grads(False)
        return tuple(stats)

    @staticmethod
    def backward(ctx, *grads):
        saved_tensors = ctx.saved_tensors
        sides, (target, temperature), values = saved_tensors[:10], saved_tensors[10:12], saved_tensors[12:]
        backend, tile_elements, group = ctx.flags
        want = list(ctx.needs_input_grad[:3])
        d_x, d_weight, d_bias = linear.backward_from_grads(sides, target, temperature, tile_elements, backend,
                                                           dict(zip(statistics.NAMES, grads)), StreamStats(*values),
                                                           want)
        if want[0] and sides[1] is not None:  # hidden states: every shard's part of the sum
            d_x = _all_reduce(d_x, group)
        return (*(d if w else None for d, w in zip((d_x, d_weight, d_bias), want)), *[None] * 14)


def shard_stream(logits, ref_logits, target, temperature, wanted, backend, shard: VocabShard) -> StreamStats:
    """``stream`` statistics of the full rows, from this rank's shard ``logits [..., V_local]``; ``target``
    holds global ids. Every rank of ``shard.group`` must call it with the same ``target``, ``temperature``
    and request. Differentiable w.r.t. ``logits``."""
    return StreamStats(*_ShardStream.apply(logits, ref_logits, target, temperature, wanted, backend, shard.group,
                                           shard.start))


def shard_linear(policy, ref, target, temperature, wanted, tile_elements, backend, shard: VocabShard) -> StreamStats:
    """``linear`` statistics of the full rows from this rank's vocab shard: ``policy`` / ``ref`` are
    ``kltriton.kernels.linear.Side`` tuples whose weight (or dense logits) hold the shard; ``target`` holds
    global ids. Every rank of ``shard.group`` must call it with the same hidden states, ``target``,
    ``temperature`` and request. Differentiable w.r.t. the policy's hidden states (gradient all-reduced),
    weight and bias (local)."""
    return StreamStats(*_ShardLinear.apply(*policy, *ref, target, temperature, wanted, tile_elements, backend,
                                           shard.group, shard.start))


# --- the truncation family over vocab shards ---------------------------------------------------------------

class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of every rank's tensor (one all-reduce). Backward: the gradient as it is (every rank
    computes the same loss from the sum, so its own part's gradient needs no communication)."""

    @staticmethod
    def forward(ctx, tensor, group):
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Replicated(torch.autograd.Function):
    """Forward: the tensor as it is (replicated on every rank). Backward: the gradient summed over the ranks
    (each rank holds the part that flows through its vocab shard)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group), None


def sum_over_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    return _SumOverRanks.apply(tensor, group)


def replicated(tensor: torch.Tensor, group) -> torch.Tensor:
    return _Replicated.apply(tensor, group)


def _all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_reduce(tensor, "max", group))


def widest_shard(size: int, device, group) -> int:
    """The largest ``V_local`` of the group (one all-reduce of one value; a host sync)."""
    return int(_all_reduce_max(torch.tensor([size], dtype=torch.int64, device=device), group).item())


THRESHOLDS_PER_ROUND = 15  # thresholds per collective round of the floor search: 16-way, 8 rounds for 32 bits
_KEY_FLIP = 0x7FFFFFFF


def _key(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 key of float32 values (``a >= b`` iff ``key(a) >= key(b)`` for non-NaN)."""
    bits = x.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ _KEY_FLIP, bits)


def _from_key(key: torch.Tensor) -> torch.Tensor:
    bits = torch.where(key < 0, key ^ _KEY_FLIP, key).to(torch.int32)
    return bits.view(torch.float32)


def _largest_reaching(rows, weight_of, lower, goal, group):
    """Per row, the largest fp32 value ``v >= lower`` whose summed weight over the ranks of ``{x >= v}`` reaches
    ``goal`` (``weight_of(rows, thresholds [N, G]) -> [N, G]`` float64 local sums over ``x >= threshold``), by a
    ``G + 1``-way bisection on the order-preserving keys: one all-reduce of ``[N, G]`` values per round, 8
    rounds for the 32 bits, exact (the answer is the key where the step function crosses ``goal``)."""
    lo = _key(lower)                                          # weight(lo) >= goal
    hi = torch.full_like(lo, _KEY_FLIP + 1)                   # above +inf: weight 0 < goal
    steps = torch.arange(1, THRESHOLDS_PER_ROUND + 1, device=lo.device)
    while True:
        width = hi - lo
        if not bool((width > 1).any()):  # the rounds are the same on every rank: the data decides when all stop
            return _from_key(lo)
        keys = lo[:, None] + (width[:, None] * steps) // (THRESHOLDS_PER_ROUND + 1)
        keys = torch.maximum(keys, lo[:, None] + 1).clamp(max=_KEY_FLIP)
        reached = _all_reduce(weight_of(rows, _from_key(keys)), group) >= goal[:, None]
        reached &= keys < hi[:, None]
        best = torch.where(reached, keys, lo[:, None]).amax(1)
        above = torch.where(~reached & (keys > best[:, None]), keys, hi[:, None]).amin(1)
        lo, hi = best, torch.minimum(above, hi)


def shard_floor(logits: torch.Tensor, target, temperature, knobs, group) -> torch.Tensor:
    """The ``truncation`` family's floor (``kltriton.kernels.truncation``) of the full rows from this rank's shard
    ``logits [..., V_local]``: the row max by one all-reduce, min-p from it, top-k and top-p by
    ``_largest_reaching`` (counts, then masses above candidate thresholds, summed over the ranks). The same on
    every rank; the local work is PyTorch on the shard (``[N, G]`` compares per round)."""
    x = as_rows3d(logits.detach()).reshape(-1, logits.shape[-1]).float()
    n = x.shape[0]
    t = (temperature.reshape(1).expand(n) if temperature.dim() == 0 else temperature).double()
    m = _all_reduce_max(x.amax(-1) if x.shape[-1] else x.new_full((n,), float("-inf")), group).double()
    top_k, top_p, min_p = knobs
    log_min_p = torch.where(min_p > 0, min_p.clamp(min=1e-300).log(), torch.full_like(min_p, float("-inf")))
    exact = torch.where(min_p > 0, m + t * log_min_p, torch.full_like(m, float("-inf")))
    lower = exact.float()
    lower = torch.where(lower.double() < exact, torch.nextafter(lower, torch.full_like(lower, float("inf"))), lower)

    def counts(rows, thresholds):  # one [N, V_local] compare per threshold
        return torch.stack([(x >= th[:, None]).sum(-1) for th in thresholds.unbind(1)], 1).double()

    def masses(rows, thresholds):
        e = torch.where(x >= lower[:, None], ((x.double() - m[:, None]) / t[:, None]).exp(), torch.zeros_like(x,
                        dtype=torch.float64))
        return torch.stack([torch.where(x >= th[:, None], e, 0).sum(-1) for th in thresholds.unbind(1)], 1)

    if bool((top_k > 0).any()):
        kept = _all_reduce(counts(None, lower[:, None]).squeeze(1), group)
        active = (top_k > 0) & (kept > top_k)
        kth = _largest_reaching(None, counts, lower, top_k.double(), group)
        lower = torch.where(active, torch.maximum(lower, kth), lower)
    if bool((top_p < 1).any()):
        total = _all_reduce(masses(None, lower[:, None]).squeeze(1), group)
        cut = _largest_reaching(None, masses, lower, top_p * total, group)
        lower = torch.where(top_p < 1, torch.maximum(lower, cut), lower)
    bad = torch.isnan(m) | (m == float("inf"))
    lower = torch.where(bad, torch.full_like(lower, float("nan")), lower)
    return torch.where(target >= 0, lower, torch.full_like(lower, float("-inf")))


class _ShardTruncated(torch.autograd.Function):
    """``truncation`` statistics over vocab shards once the floor is known: the local restricted statistics,
    one all-gather, merge (they merge as the ``stream`` statistics do); backward without communication."""

    @staticmethod
    def forward(ctx, logits, target, temperature, knobs, floor, wanted, backend, group, start):
        kernel_target, own = _localize(target, start, logits.shape[-1], 0)
        _, local = truncation_ops.truncated_forward(logits, kernel_target, temperature, knobs, floor, wanted, backend)
        stats, backward_target = _global_stats(local, target, kernel_target, own, wanted, group)
        ctx.save_for_backward(logits, backward_target, temperature, floor, own, *stats)
        ctx.backend = backend
        ctx.mark_non_differentiable(stats.lse, stats.ref_logp, stats.ref_lse)
        ctx.set_materialize_grads(False)
        return tuple(stats)

    @staticmethod
    def backward(ctx, *grads):
        logits, target, temperature, floor, own, *values = ctx.saved_tensors
        stats = StreamStats(*values)
        grads = truncation_ops.outside_free(dict(zip(statistics.NAMES, grads)), stats.logp)
        basis = statistics.gradient_basis(grads, stats, temperature)
        basis = basis._replace(label=torch.where(own, basis.label, 0))
        grad = truncation_ops.truncated_backward(logits, target, temperature, floor, stats.lse, basis.label, basis.p,
                                                 basis.p_logp, ctx.backend)
        return grad, None, None, None, None, None, None, None, None


def shard_truncated(logits, target, temperature, knobs, wanted, backend, shard: VocabShard) -> StreamStats:
    """``truncation`` statistics (recompute mode) of the full rows from this rank's shard ``logits [..., V_local]``;
    every rank of ``shard.group`` calls it with the same ``target``, ``temperature`` and knobs."""
    floor = shard_floor(logits, target, temperature, knobs, shard.group)
    return StreamStats(*_ShardTruncated.apply(logits, target, temperature, knobs, floor, wanted, backend, shard.group,
                                              shard.start))


# --- distillation: the JSD's second pass and a top-k teacher's columns over vocab shards -----------------------

def _any_column(target):
    """A kernel target for the passes that read no label: each scored row on column 0 of the shard (sentinels
    stay)."""
    return torch.where(target >= 0, torch.zeros_like(target), target)


class _ShardJsd(torch.autograd.Function):
    """The JSD pass (``kltriton.kernels.divergence``) over vocab shards: each rank sums its shard's terms with the
    global log-sum-exps, one all-reduce of two values per row adds them; backward: the local gradient kernel with
    the global ``KL(p || m)`` (no collective)."""

    @staticmethod
    def forward(ctx, logits, ref_logits, target, temperature, lse, ref_lse, beta, backend, group):
        kernel_target = _any_column(target)
        local = divergence.jsd_forward(logits, ref_logits, kernel_target, temperature, lse, ref_lse, beta, backend)
        jsd, kl_student = _all_reduce(torch.stack(local), group).unbind(0)
        ctx.save_for_backward(logits, ref_logits, kernel_target, temperature, lse, ref_lse, beta, kl_student)
        ctx.backend = backend
        ctx.mark_non_differentiable(kl_student)
        ctx.set_materialize_grads(False)
        return jsd, kl_student

    @staticmethod
    def backward(ctx, g, _):
        logits, ref_logits, target, temperature, lse, ref_lse, beta, kl_student = ctx.saved_tensors
        if g is None:
            return (None,) * 9
        coef = divergence.jsd_coefficients(g, beta, temperature)
        grad = divergence.jsd_backward(logits, ref_logits, target, temperature, lse, ref_lse, beta, kl_student, coef,
                                       ctx.backend)
        return (grad, *[None] * 8)


class _ShardLinearJsd(torch.autograd.Function):
    """The JSD pass of ``LinearLogits`` over weight shards: local tiles, one all-reduce of two values per row;
    backward: the local weight / bias gradients, the hidden gradient all-reduced."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, softcap, ref_x, ref_weight, ref_bias, ref_scale, ref_softcap, target,
                temperature, lse, ref_lse, beta, tile_elements, backend, group):
        sides = (x, weight, bias, scale, softcap, ref_x, ref_weight, ref_bias, ref_scale, ref_softcap)
        kernel_target = _any_column(target)
        local = divergence.linear_jsd_forward(*sides, kernel_target, temperature, lse, ref_lse, beta, tile_elements,
                                              backend)
        jsd, kl_student = _all_reduce(torch.stack(local), group).unbind(0)
        ctx.save_for_backward(*sides, kernel_target, temperature, lse, ref_lse, beta, kl_student)
        ctx.flags = (tile_elements, backend, group)
        ctx.mark_non_differentiable(kl_student)
        ctx.set_materialize_grads(False)
        return jsd, kl_student

    @staticmethod
    def backward(ctx, g, _):
        saved = ctx.saved_tensors
        sides, (target, temperature, lse, ref_lse, beta, kl_student) = saved[:10], saved[10:]
        tile_elements, backend, group = ctx.flags
        want = list(ctx.needs_input_grad[:3])
        if g is None or not any(want):
            return (None,) * 18
        coef = divergence.jsd_coefficients(g, beta, temperature)
        d_x, d_weight, d_bias = divergence.linear_jsd_backward(*sides, target, temperature, lse, ref_lse, beta,
                                                               kl_student, coef, *want, tile_elements, backend)
        if want[0] and sides[1] is not None:  # hidden states: every shard's part of the sum
            d_x = _all_reduce(d_x, group)
        return (*(d if w else None for d, w in zip((d_x, d_weight, d_bias), want)), *[None] * 15)


def shard_jsd(policy, ref, target, temperature, lse, ref_lse, beta, tile_elements, backend, shard: VocabShard):
    """``(jsd, kl_student)`` ``[N]`` of the full rows from this rank's vocab shard, given the global log-sum-exps
    (``shard_stream`` / ``shard_linear``). ``policy`` / ``ref``: tensors (logits shards) or ``Side`` tuples (a
    ``LinearLogits`` with a weight shard, ``tile_elements`` its working tile). Differentiable w.r.t. the student."""
    if isinstance(policy, torch.Tensor):
        return _ShardJsd.apply(policy, ref, target, temperature, lse, ref_lse, beta, backend, shard.group)
    return _ShardLinearJsd.apply(*policy, *ref, target, temperature, lse, ref_lse, beta, tile_elements, backend,
                                 shard.group)


def _own_columns(ids, start, size):
    """``(own, local_ids)``: which of the global column ``ids [N, K]`` this shard holds, and their local ids (-1
    elsewhere)."""
    own = (ids >= start) & (ids < start + size)
    return own, torch.where(own, ids - start, torch.full_like(ids, -1))


def _gathered_columns(local, own, ids, target, group):
    """Every shard's log-probs at its own columns, summed over the ranks (one all-reduce of ``K`` values per row):
    ``-inf`` at padding ids, 0 on unscored rows."""
    summed = _all_reduce(torch.where(own, local, torch.zeros_like(local)), group)
    summed = torch.where(ids >= 0, summed, torch.full_like(summed, float("-inf")))
    return torch.where((target >= 0)[:, None], summed, torch.zeros_like(summed))


class _ShardColumns(torch.autograd.Function):
    """A top-k teacher's ``K`` columns of the student's log-probs over vocab shards (logits or ``LinearLogits``):
    each rank gathers the columns it holds with the global ``lse``, one all-reduce; backward: the dense ``p`` term
    on every shard, the columns' own terms on the shard that holds them (no collective for logits; the hidden
    gradient of a ``LinearLogits`` all-reduced)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, softcap, ids, target, temperature, lse, tile_elements, backend, group,
                start):
        side = Side(x, weight, bias, scale, softcap)
        size = x.shape[-1] if weight is None else weight.shape[0]
        own, local_ids = _own_columns(ids, start, size)
        target = _any_column(target)  # the backward's kernels read no label (their label term is 0)
        local = divergence.column_logprobs_of(side, local_ids, target, temperature, lse, tile_elements)
        logp = _gathered_columns(local, own, ids, target, group)
        ctx.save_for_backward(x, weight, bias, scale, softcap, ids, local_ids, target, temperature, lse, logp)
        ctx.flags = (tile_elements, backend, group)
        return logp

    @staticmethod
    def backward(ctx, g):
        x, weight, bias, scale, softcap, ids, local_ids, target, temperature, lse, logp = ctx.saved_tensors
        tile_elements, backend, group = ctx.flags
        want = list(ctx.needs_input_grad[:3])
        if weight is None:
            grad = divergence.column_gradient(x, ids, target, temperature, lse, logp, g, backend, local_ids)
            return (grad, *[None] * 12)
        d_x, d_weight, d_bias = divergence.linear_column_gradients(
            Side(x, weight, bias, scale, softcap), ids, target, temperature, lse, g, want, tile_elements, backend,
            local_ids)
        if want[0]:
            d_x = _all_reduce(d_x, group)
        return (d_x, d_weight, d_bias, *[None] * 10)


def shard_columns(side, ids, target, temperature, lse, tile_elements, backend, shard: VocabShard) -> torch.Tensor:
    """``[N, K]`` student log-probs at the global column ``ids`` from this rank's shard (``side``: a ``Side`` of logits
    or of a ``LinearLogits`` weight shard), given the global ``lse``; differentiable w.r.t. the student."""
    return _ShardColumns.apply(*side, ids, target, temperature, lse, tile_elements, backend, shard.group, shard.start)
