"""The collectives of every sharded path, a leaf module (torch, torch.distributed and kltriton._autograd only): the
functional all-reduce / all-gather (traced by ``torch.compile``), the autograd-aware sums over ranks, the process
group checks, and a sequence split's description and its one exchange. ``kltriton.parallel`` (vocab shards) and the
loss's sequence-level sums (``kernels.loss.weights.Sequences``) build on it.
"""
from typing import NamedTuple, Tuple, Union

import torch
import torch.distributed as dist


def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's ``tensor``, as a functional collective (traced by ``torch.compile``)."""
    import torch.distributed._functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))


def all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    """The elementwise maximum over the ranks, as a functional collective."""
    import torch.distributed._functional_collectives as funcol
    return funcol.wait_tensor(funcol.all_reduce(tensor, "max", group))


def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[K * M, ...]``: every rank's ``[M, ...]`` tensor in rank order, as a functional collective
    (traced by ``torch.compile``). Imported here: builds without ``torch.distributed`` lack it."""
    import torch.distributed._functional_collectives as funcol
    return funcol.all_gather_single(tensor, 0, group)


def same_group(group, other) -> bool:
    """Whether two process groups hold the same ranks (a DeviceMesh's group may be another object)."""
    return group is other or dist.get_process_group_ranks(group) == dist.get_process_group_ranks(other)


class _Replicated(torch.autograd.Function):
    """Forward: the tensor as it is (replicated on every rank). Backward: the gradient summed over the ranks
    (each rank holds the part that flows through its vocab shard)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


def replicated(tensor: torch.Tensor, group) -> torch.Tensor:
    return _Replicated.apply(tensor, group)


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of every rank's tensor. Backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, tensor, group):
        return all_reduce(tensor.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's ``tensor``; its gradient passes as it is (every rank computes the same loss from the
    sum, so its own part's gradient needs no communication)."""
    return _SumOverRanks.apply(tensor, group)


def check_group(group, name: str):
    """``group`` is a ``torch.distributed.ProcessGroup``, else a ``TypeError`` naming the argument."""
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup, got {type(group).__name__}")


class SequenceSplit(NamedTuple):
    """This rank's slice of the sequence dimension (``T`` of ``[B, T]``, or the packed token stream of ``[N]``),
    the ranks' slices contiguous and in rank order."""
    group: object                    # torch.distributed.ProcessGroup
    rank: int                        # this rank's index in the group
    start: Union[int, torch.Tensor]  # this slice's first position (0-dim int64 when learned on the device)
    total: Union[int, torch.Tensor]  # the global length (every rank's slices together)
    sizes: torch.Tensor              # [ranks] int64: every rank's slice length, on the device


def from_next_rank(first: torch.Tensor, split: SequenceSplit) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(values, present)``: the ``[K]`` values ``first`` of the next rank of the group that holds a non-empty
    slice, and whether there is one (0-dim bool; the last slice has none). ONE all-gather of ``K`` int64 per rank
    (every rank calls it, an empty slice with any values of the right size)."""
    gathered = all_gather(first.to(torch.int64).contiguous(), split.group).view(split.sizes.shape[0], -1)
    ranks = torch.arange(split.sizes.shape[0], device=first.device)
    later = (ranks > split.rank) & (split.sizes > 0)
    following = torch.where(later, ranks, torch.full_like(ranks, split.sizes.shape[0])).min()
    present = following < split.sizes.shape[0]
    return gathered[following.clamp(max=split.sizes.shape[0] - 1)], present


class _SumOfParts(torch.autograd.Function):
    """Forward: the sum of every rank's tensor. Backward: the sum of every rank's upstream gradient (each rank's
    upstream gradient is that of its own part of a loss that is summed over the ranks)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return all_reduce(tensor.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


def sum_of_parts(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's ``tensor`` (one all-reduce), for use inside each rank's part of a loss that is summed
    over the ranks (``sum_over_ranks``): its gradient w.r.t. this rank's ``tensor`` is summed over the ranks' parts
    (one all-reduce in the backward)."""
    return _SumOfParts.apply(tensor, group)


def gather_padded(values: torch.Tensor, fill: float, group) -> torch.Tensor:
    """Every rank's ``[n_r]`` ``values`` in one tensor ``[ranks * max n_r]`` (each padded with ``fill``): one
    all-gather of the lengths (read on the host: a sync) and one of the padded values, as accelerate's
    ``pad_across_processes`` + ``gather``."""
    length = torch.tensor([values.shape[0]], dtype=torch.int64, device=values.device)
    widest = int(all_gather(length, group).max().item())
    padded = torch.full((widest,), fill, dtype=values.dtype, device=values.device)
    padded[:values.shape[0]] = values
    return all_gather(padded, group)


def widest_shard(size: int, device, group) -> int:
    """The largest ``V_local`` of the group (one all-reduce of one value; a host sync)."""
    return int(all_reduce_max(torch.tensor([size], dtype=torch.int64, device=device), group).item())
