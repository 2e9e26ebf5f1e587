"""Vocab-parallel passes: each rank of a process group holds a contiguous vocabulary shard.

Imported by ``kltriton.route`` (and the front door, for ``VocabShard``). Rank ``r`` holds ``logits[..., V_r]`` or an
LM head's ``weight [V_r, H]``, the ids ``[start_r, start_r + V_r)``; labels are global ids. Two wrappers serve every
pass, both differentiable w.r.t. the policy side's logits, or hidden states, weight and bias:

- ``merged`` (``_Merged``): statistics that merge exactly over vocab pieces (``kltriton.kernels.statistics``): the
  ``statistics`` pass (dense or an LM head) and the ``truncation`` family's once its floor is known. Each rank runs
  the pass on its shard as if it were the whole row (a row whose label is on another shard is scored on a dummy
  in-shard label, column 0 for dense logits, ``V_local`` for an LM head, and its log-prob ignored), then ONE
  all-gather exchanges one fp32 number per present statistic and row, and every rank merges them with
  ``statistics.merge``. Backward: the local pass's gradient on the *global* statistics' basis, which is exactly the
  global gradient restricted to the shard (the label term kept on the shard that holds the label); no
  communication but an LM head's hidden gradient, summed over the ranks with one all-reduce of ``N x H`` values.
  In the invariant mode (a request with ``constants.INVARIANT``) the shards are joined between the kernels instead
  (``ops.invariant``: one all-reduce max of the rows' maxima, one int64 all-reduce of their fixed-point sums and label
  logits), which gives the same bits on any number of shards; the backward is the same.
- ``summed`` (``_Summed``): results that are sums over the vocabulary once the rows' log-sum-exps are known (the
  JSD's second pass, a top-k teacher's ``K`` columns): the local pass, one all-reduce of its outputs; backward as
  above.

Sequence (context) parallel, ``SequenceSplit``: each rank of a sequence group holds a contiguous slice of the sequence
dimension. ``sequence_split`` learns the slice's start (one all-gather of 3 int64 per rank, or ``chunked_split`` from
a DTensor's placement, none), ``from_next_rank`` brings the next slice's first labels for the shift (one all-gather),
and ``sum_of_parts`` / ``sum_over_ranks`` are the two gradients of a sum over the ranks (``weights.Sequences``, the
one place that reduces per sequence, calls them).

The truncation floor over shards is ``kltriton.sharded_floor``. The collectives are
``torch.distributed._functional_collectives`` (``all_gather_single``, ``all_reduce``), which ``torch.compile``
traces; the autograd functions never differentiate through a collective.
"""
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from kltriton._env import launched_world_size
from kltriton.collectives import SequenceSplit, all_gather, all_reduce, all_reduce_max, check_group
from kltriton._autograd import first_order
from kltriton._inputs import host_checks
from kltriton.kernels import OUT_OF_RANGE, SKIP, constants, statistics
from kltriton.kernels.linear import Side
from kltriton.kernels.statistics import LABEL_ELSEWHERE, StreamStats
from kltriton.ops import divergence
from kltriton.ops import invariant as invariant_ops
from kltriton.ops import statistics as statistics_ops
from kltriton.ops._define import NeedsGrad
from kltriton.ops import truncation as truncation_ops

# Label bound when the global vocabulary is not known (``vocab_start`` given, validation off): a
# label past the last shard then lies in no shard and its position gives NaN, like OUT_OF_RANGE.
UNBOUNDED = 2 ** 62


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


def check_no_group() -> None:
    """A call without a process group in a distributed launch must come after ``init_process_group``: before it,
    ``dist.group.WORLD`` is None, and a rank holding a vocab shard would score it alone without a word."""
    if not dist.is_available() or dist.is_initialized():
        return
    world = launched_world_size()
    if world > 1:
        raise ValueError(f"process_group is None in a distributed launch (WORLD_SIZE={world}) before "
                         "torch.distributed.init_process_group: dist.group.WORLD is None until then, so the call "
                         "would run on this rank's shard alone. Initialize the process group first (or run "
                         "without WORLD_SIZE for a single process).")


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
        check_no_group()
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
    table = all_gather(mine, process_group).view(-1, 3)
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


def chunked_shard(group, start: int, size: int, vocab: int) -> VocabShard:
    """The ``VocabShard`` of a DTensor's vocabulary dimension, sharded over ``group`` as ``torch.chunk`` splits it
    (``ceil(V / n)`` ids a rank, the last ones shorter or empty): known from the placement, no collective."""
    parts = dist.get_world_size(group)
    chunk = -(-vocab // parts)
    spans = ", ".join(f"rank {r}: [{min(r * chunk, vocab)}, {min((r + 1) * chunk, vocab)})" for r in range(parts))
    return VocabShard(group, start, size, vocab, spans)


def exchange_stats(local: StreamStats, has_label: torch.Tensor, request: int, group,
                   before_label: Optional[torch.Tensor] = None) -> Tuple[StreamStats, torch.Tensor]:
    """Global statistics from every rank's local ones: one all-gather of one value per present statistic and row.

    Args:
        local: this rank's ``StreamStats`` of its shard (``[N]`` each; absent ones empty), as the
            ``stream`` kernel returns them for the shard alone.
        has_label: ``[N]`` bool, whether this rank's shard holds the row's label (its ``logp`` /
            ``ref_logp`` are then the label's local log-probs; elsewhere they are ignored).
        request: the request bits that produced ``local``.
        before_label: ``[N]`` bool, whether this rank's shard lies before the row's label (read by ``is_top1``'s
            merge; None: nowhere).
    Returns:
        ``(StreamStats, labelled)``: the merged global ``[N]`` statistics (``statistics.merge``) and
        ``[N]`` bool, whether any rank holds the row's label (no outputs are masked here).
    """
    n = local.lse.shape[0]
    names = [name for name in statistics.NAMES if statistics.present(request, name)]
    before = torch.zeros_like(has_label) if before_label is None else before_label
    marked = statistics.mark_pieces({name: getattr(local, name) for name in names}, has_label, before)
    columns = [marked[name] for name in names]
    gathered = all_gather(torch.stack(columns), group)  # [K * m, N], rank-major
    pieces = dict(zip(names, gathered.view(-1, len(columns), n).unbind(1)))  # m tensors [K, N]
    return statistics.merge(pieces, request), (pieces["logp"] != LABEL_ELSEWHERE).any(0)


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


def _global_stats(local: StreamStats, target, kernel_target, own, request, group, before_label):
    """``(stats, backward_target)``: the global statistics (one all-gather), 0 at unscored rows and
    NaN at rows scored on a label no shard holds; the kernel target of the backward, where those
    rows are ``OUT_OF_RANGE`` (no gradient). ``before_label``: ``[N]`` bool, this shard lies before the row's label."""
    stats, labelled = exchange_stats(local, own, request, group, before_label)
    skip = target == SKIP
    bad = (target == OUT_OF_RANGE) | ((target >= 0) & ~labelled)
    no_nan = torch.zeros_like(bad)
    stats = StreamStats(*(_masked(getattr(stats, name), skip, no_nan if name.endswith("lse") else bad)
                          for name in statistics.NAMES))
    backward_target = torch.where(bad, torch.full_like(kernel_target, OUT_OF_RANGE), kernel_target)
    return stats, backward_target


class LocalPass(NamedTuple):
    """A pass over this rank's shard (plain values only: ``torch.compile`` keeps them as constants)."""
    kind: str              # "statistics" / "truncated" (merged), "jsd" / "columns" (summed)
    group: object          # the ProcessGroup
    start: object          # this shard's first global id (an int, or a 0-dim tensor learned on the device)
    size: int              # V_local
    request: int            # the statistics request (merged passes)
    tile_elements: int
    backend: str


def _side(tensors) -> Optional[Side]:
    return None if tensors[0] is None else Side(*tensors)


def _statistics_forward(local, target, tensors):
    """``statistics`` of (policy, ref) sides: ``tensors`` = the policy's five, the reference's five, temperature."""
    policy, ref, temperature = Side(*tensors[:5]), _side(tensors[5:10]), tensors[10]
    return StreamStats(*statistics_ops.statistics(policy, ref, target, temperature, local.request,
                                                  local.tile_elements, False, None,
                                                  local.backend)[:len(statistics.NAMES)])


def _statistics_backward(local, target, own, tensors, stats, grads, needs_grad):
    policy, ref, temperature = Side(*tensors[:5]), _side(tensors[5:10]), tensors[10]
    return statistics_ops.gradients(policy, ref, target, temperature, local.tile_elements, local.backend, grads,
                                    stats, needs_grad, label_here=own,
                                    invariant=bool(local.request & constants.INVARIANT))


def _truncated_forward(local, target, tensors):
    """The ``truncation`` statistics above a known floor: ``tensors`` = logits, four Nones, temperature, the three
    knobs and the floor."""
    logits, temperature, knobs, floor = tensors[0], tensors[5], tensors[6:9], tensors[9]
    return truncation_ops.truncated_forward(logits, target, temperature, knobs, floor, local.request, local.backend)[1]


def _truncated_backward(local, target, own, tensors, stats, grads, needs_grad):
    logits, temperature, floor = tensors[0], tensors[5], tensors[9]
    grad = truncation_ops.gradient(logits, target, temperature, floor, stats, grads, local.backend, label_here=own)
    return grad, None, None


def _reduce(local):
    """The invariant mode's joins over the shards: ``(all-reduce max, all-reduce sum)``."""
    return (lambda t: all_reduce_max(t, local.group)), (lambda t: all_reduce(t, local.group))


def _fixed_statistics(local, target, kernel_target, own, tensors):
    """``(global StreamStats, held)`` of ``statistics`` in the invariant mode (``ops.invariant.statistics``)."""
    policy, ref, temperature = Side(*tensors[:5]), _side(tensors[5:10]), tensors[10]
    return invariant_ops.statistics(policy, ref, target, kernel_target, own, temperature, local.request, local.backend,
                                    local.tile_elements, _reduce(local))


def _fixed_truncated(local, target, kernel_target, own, tensors):
    """``(global StreamStats, held)`` of ``truncated`` in the invariant mode (``ops.invariant.dense_statistics``)."""
    logits, temperature, floor = tensors[0], tensors[5], tensors[9]
    return invariant_ops.dense_statistics(logits, target, kernel_target, own, temperature, floor, local.request,
                                          local.backend, _reduce(local))


# The merged passes: (forward -> this shard's statistics, the invariant mode's forward -> the global statistics and
# whether some shard holds each row's label, backward -> (d_x, d_weight, d_bias)).
MERGED = {"statistics": (_statistics_forward, _fixed_statistics, _statistics_backward),
          "truncated": (_truncated_forward, _fixed_truncated, _truncated_backward)}


def _hidden_summed(d, tensors, group):
    """``(d_x, d_weight, d_bias)`` with an LM head's hidden gradient summed over the ranks (each shard holds its
    part); a dense side's logits gradient stays local."""
    d_x, d_weight, d_bias = d
    if d_x is not None and tensors[1] is not None:
        d_x = all_reduce(d_x.contiguous(), group)
    return d_x, d_weight, d_bias


class _Merged(torch.autograd.Function):
    """Merged statistics over vocab shards (see the module docstring). ``tensors``: the pass's tensors, the policy
    side's ``x``, ``weight``, ``bias`` first (the differentiable ones)."""

    @staticmethod
    def forward(ctx, local: LocalPass, target, *tensors):
        forward, fixed_forward, _ = MERGED[local.kind]
        if local.request & constants.INVARIANT:  # the statistics joined between the kernels, global already
            kernel_target, own = _localize(target, local.start, local.size, 0)
            stats, held = fixed_forward(local, target, kernel_target, own, tensors)
            # a label no shard holds: NaN statistics (``finalize``), no gradient
            backward_target = torch.where((target >= 0) & ~held, OUT_OF_RANGE, kernel_target)
        else:
            projected = tensors[1] is not None or (local.kind == "statistics" and tensors[6] is not None)
            kernel_target, own = _localize(target, local.start, local.size, local.size if projected else 0)
            stats, backward_target = _global_stats(forward(local, kernel_target, tensors), target, kernel_target,
                                                   own, local.request, local.group, target >= local.start + local.size)
        ctx.save_for_backward(backward_target, own, *tensors, *stats)
        ctx.local = local
        ctx.mark_non_differentiable(*(getattr(stats, name) for name in statistics.NAMES
                                      if name not in statistics.DIFFERENTIABLE))
        ctx.set_materialize_grads(False)
        return tuple(stats)

    @staticmethod
    @first_order("a vocab-parallel pass")
    def backward(ctx, *grads):
        target, own, *rest = ctx.saved_tensors
        tensors, stats = rest[:-len(statistics.NAMES)], StreamStats(*rest[-len(statistics.NAMES):])
        needs_grad = ctx.needs_input_grad[2:5]
        _, _, backward = MERGED[ctx.local.kind]
        d = backward(ctx.local, target, own, tensors, stats, dict(zip(statistics.NAMES, grads)), needs_grad)
        d = _hidden_summed(d, tensors, ctx.local.group)
        return (None, None, *(g if w else None for g, w in zip(d, needs_grad)), *[None] * (len(tensors) - 3))


def merged(local: LocalPass, target, *tensors) -> StreamStats:
    return StreamStats(*_Merged.apply(local, target, *tensors))


def _any_column(target):
    """A kernel target for the passes that read no label: each scored row on column 0 of the shard (sentinels
    stay)."""
    return torch.where(target >= 0, torch.zeros_like(target), target)


def _own_columns(ids, start, size):
    """This shard's local ids of the global column ``ids [N, K]`` (``-1`` elsewhere), and which it holds."""
    own = (ids >= start) & (ids < start + size)
    return torch.where(own, ids - start, torch.full_like(ids, -1)), own


def _jsd_forward(local, target, tensors):
    """The JSD pass: ``tensors`` = the student's five, the teacher's five, temperature, lse, ref_lse, beta."""
    policy, ref = Side(*tensors[:5]), Side(*tensors[5:10])
    temperature, lse, ref_lse, beta = tensors[10:14]
    return divergence.jsd(policy, ref, _any_column(target), temperature, lse, ref_lse, beta, local.tile_elements,
                          local.backend)


def _jsd_backward(local, target, tensors, outputs, grads, needs_grad):
    policy, ref = Side(*tensors[:5]), Side(*tensors[5:10])
    temperature, lse, ref_lse, beta = tensors[10:14]
    coef = divergence.jsd_coefficients(grads[0], beta, temperature)
    return divergence.jsd_backward(policy, ref, _any_column(target), temperature, lse, ref_lse, beta, outputs[1],
                                   coef, NeedsGrad(*needs_grad), local.tile_elements, local.backend)


def _columns_forward(local, target, tensors):
    """A top-k teacher's columns: ``tensors`` = the student's five, ids (global), temperature, lse (global)."""
    policy, (ids, temperature, lse) = Side(*tensors[:5]), tensors[5:8]
    own_ids, own = _own_columns(ids, local.start, local.size)
    logp = divergence.columns(policy, own_ids, _any_column(target), temperature, lse, False, local.tile_elements,
                              local.backend)[0]
    return (torch.where(own, logp, torch.zeros_like(logp)),)


def _columns_backward(local, target, tensors, outputs, grads, needs_grad):
    policy, (ids, temperature, lse) = Side(*tensors[:5]), tensors[5:8]
    own_ids, _ = _own_columns(ids, local.start, local.size)
    return divergence.column_gradients(policy, ids, own_ids, _any_column(target), temperature, lse, grads[0], needs_grad,
                                       local.tile_elements, local.backend)


# The summed passes: (forward -> outputs, backward -> (d_x, d_weight, d_bias) of the first output).
SUMMED = {"jsd": (_jsd_forward, _jsd_backward), "columns": (_columns_forward, _columns_backward)}


class _Summed(torch.autograd.Function):
    """Results summed over vocab shards (see the module docstring): the local pass's outputs, one all-reduce;
    the backward of the first output, without communication but an LM head's hidden gradient."""

    @staticmethod
    def forward(ctx, local: LocalPass, target, *tensors):
        forward, _ = SUMMED[local.kind]
        outputs = tuple(all_reduce(out.contiguous(), local.group) for out in forward(local, target, tensors))
        ctx.save_for_backward(target, *tensors, *outputs)
        ctx.local, ctx.n_tensors = local, len(tensors)
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.set_materialize_grads(False)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    @first_order("a vocab-parallel sum")
    def backward(ctx, *grads):
        target, *rest = ctx.saved_tensors
        tensors, outputs = rest[:ctx.n_tensors], rest[ctx.n_tensors:]
        needs_grad = ctx.needs_input_grad[2:5]
        if grads[0] is None or not any(needs_grad):
            return (None,) * (2 + ctx.n_tensors)
        _, backward = SUMMED[ctx.local.kind]
        d = _hidden_summed(backward(ctx.local, target, tensors, outputs, grads, needs_grad), tensors, ctx.local.group)
        return (None, None, *(g if w else None for g, w in zip(d, needs_grad)), *[None] * (ctx.n_tensors - 3))


def summed(local: LocalPass, target, *tensors):
    return _Summed.apply(local, target, *tensors)


def _pass(kind, shard: VocabShard, request, tile_elements, backend) -> LocalPass:
    return LocalPass(kind, shard.group, shard.start, shard.size, request, tile_elements, backend)


def shard_statistics(policy: Side, ref: Optional[Side], target, temperature, request, tile_elements, backend,
                     shard: VocabShard) -> StreamStats:
    """The statistics of the full rows from this rank's shard (``policy`` / ``ref``: dense logits shards or LM heads
    with weight shards); ``target`` holds global ids. Every rank of ``shard.group`` calls it with the same hidden
    states, ``target``, ``temperature`` and request."""
    ref = ref if ref is not None else Side(None, None, None, None, None)
    return merged(_pass("statistics", shard, request, tile_elements, backend), target, *policy, *ref, temperature)


def shard_truncated(logits, target, temperature, knobs, request, backend, shard: VocabShard) -> StreamStats:
    """``truncation`` statistics (recompute mode) of the full rows from this rank's shard ``logits [..., V_local]``;
    every rank of ``shard.group`` calls it with the same ``target``, ``temperature`` and knobs."""
    from kltriton.sharded_floor import shard_floor

    floor = shard_floor(logits, target, temperature, knobs, shard.group,
                        fixed_point=bool(request & constants.INVARIANT))
    return merged(_pass("truncated", shard, request, 0, backend), target, logits, None, None, None, None, temperature,
                  *knobs, floor)


def shard_jsd(policy: Side, ref: Side, target, temperature, lse, ref_lse, beta, tile_elements, backend,
              shard: VocabShard):
    """``(jsd, kl_student)`` ``[N]`` of the full rows from this rank's vocab shard, given the global log-sum-exps;
    differentiable w.r.t. the student."""
    return summed(_pass("jsd", shard, 0, tile_elements, backend), target, *policy, *ref, temperature, lse, ref_lse,
                  beta)


def shard_columns(side: Side, ids, target, temperature, lse, tile_elements, backend, shard: VocabShard):
    """``[N, K]`` student log-probs at the global column ``ids`` from this rank's shard (dense logits or an LM head's
    weight shard), given the global ``lse``; ``-inf`` at padding ids, 0 on unscored rows; differentiable w.r.t. the
    student."""
    logp = summed(_pass("columns", shard, 0, tile_elements, backend), target, *side, ids, temperature, lse)
    logp = torch.where(ids >= 0, logp, torch.full_like(logp, float("-inf")))
    return torch.where((target >= 0)[:, None], logp, torch.zeros_like(logp))


# --- sequence (context) parallel: each rank of a group holds a contiguous slice of the sequence dimension ------------

def _check_sequence_table(table):
    """``table``: per rank ``[length, rows, ndim]``; every rank must hold the same rows (sequences) and layout."""
    if len({(r, d) for _, r, d in table}) != 1:
        shown = ", ".join(f"rank {i}: {'[B, T] with B=' + str(r) if d >= 2 else '[N]'}"
                          for i, (_, r, d) in enumerate(table))
        raise ValueError(f"sequence_group: every rank must hold a slice of the same sequences (the same B of [B, T], "
                         f"or [N] packed on every rank), got {shown}")


def sequence_split(size: int, rows: int, ndim: int, device, group) -> SequenceSplit:
    """This rank's ``SequenceSplit`` of a slice of ``size`` positions (``rows`` sequences of a ``[B, T]`` layout,
    ``ndim`` its leading dims), learned with ONE all-gather of 3 int64 per rank. With validation on
    (``kltriton.set_validation``) the same all-gather checks that every rank holds the same sequences (a host sync);
    with it off the start and the total stay on the device."""
    check_group(group, "sequence_group")
    rank = dist.get_rank(group)
    mine = torch.tensor([size, rows, ndim], dtype=torch.int64, device=device)
    table = all_gather(mine, group).view(-1, 3)
    sizes = table[:, 0]
    if not host_checks():
        return SequenceSplit(group, rank, sizes[:rank].sum(), sizes.sum(), sizes)
    rows_table = table.tolist()
    _check_sequence_table(rows_table)
    lengths = [entry[0] for entry in rows_table]
    return SequenceSplit(group, rank, sum(lengths[:rank]), sum(lengths), sizes)


def chunked_split(group, rank: int, length: int, device) -> SequenceSplit:
    """The ``SequenceSplit`` of a DTensor's sequence dimension of ``length`` positions sharded over ``group`` as
    ``torch.chunk`` splits it: known from the placement, no collective."""
    parts = dist.get_world_size(group)
    chunk = -(-length // parts)
    bounds = [min(r * chunk, length) for r in range(parts + 1)]
    sizes = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.int64, device=device)
    return SequenceSplit(group, rank, bounds[rank], length, sizes)


