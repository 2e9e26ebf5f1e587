"""DTensor inputs (``torch.distributed.tensor``): their local tensors and the vocab axis their placements describe.

The front door (``kltriton.front_door``) is the only caller. The rules (``docs/api/dtensor.md``):

- logits sharded on the vocabulary (``Shard(-1)``) on one mesh dimension are vocab-parallel over that dimension's
  group; the shard's first id comes from the placement (``torch.chunk`` semantics, as DTensor shards), so no
  collective is needed. Mesh dimensions that shard a leading (batch) dimension or replicate stay local;
- an LM head whose ``weight`` (and ``bias``) is ``Shard(0)`` with ``hidden`` a ``Replicate`` DTensor on the same
  mesh dimension is a tensor-parallel head: vocab-parallel too. A ``Shard(0)`` weight with plain hidden states is
  refused (an FSDP2 parameter read outside its module's forward looks the same);
- logits ``[B, T, V]`` (or an LM head's hidden states ``[B, T, H]``) sharded on ``T`` (``Shard(1)``) on one mesh
  dimension are split over that dimension's group on the sequence dimension (context parallel, ``sequence_group``),
  ``torch.chunk``'s slices in rank order; ``[N, V]`` logits sharded on ``N`` are a batch split (local);
- ``Partial``, a vocabulary (or a sequence) sharded over two mesh dimensions, and strided shards are refused;
- per-position tensors (labels, masks, advantages, ...) may be DTensors that replicate, or shard a leading
  dimension like the logits: their local tensors are used.

``to_local()`` is differentiable: a DTensor input's gradient comes back as a DTensor with its placements.
Nothing here imports ``torch.distributed.tensor``: a process that never imported it holds no DTensor.
"""
import sys
from typing import NamedTuple, Optional

import torch


def _module():
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(value) -> bool:
    if type(value) is torch.Tensor:  # the common answer, without looking the module up
        return False
    module = _module()
    return module is not None and isinstance(value, module.DTensor)


class VocabAxis(NamedTuple):
    """Where a DTensor's vocabulary dimension is sharded: over mesh dimension ``mesh_dim`` of ``mesh``."""
    mesh: object          # torch.distributed.device_mesh.DeviceMesh
    mesh_dim: int
    group: object         # the ProcessGroup of that mesh dimension
    start: int            # this rank's first vocabulary id
    vocab: int            # the global vocabulary


def _placement_name(placement) -> str:
    return type(placement).__name__


class SequenceAxis(NamedTuple):
    """Where a DTensor's sequence dimension (``T`` of ``[B, T, V]`` logits or ``[B, T, H]`` hidden states) is
    sharded: over mesh dimension ``mesh_dim`` of ``mesh``, ``torch.chunk``'s slices in rank order."""
    mesh: object
    mesh_dim: int
    group: object         # the ProcessGroup of that mesh dimension
    rank: int             # this rank's coordinate on it
    length: int           # the global T


def _check_placements(value, name: str, vocab_dim: Optional[int], sequence_dim: Optional[int] = None):
    """``(vocab mesh dim, sequence mesh dim)``: the mesh dimensions that shard ``vocab_dim`` and ``sequence_dim`` of
    the DTensor ``value`` over more than one rank (None: none); every other placement must replicate or shard another
    dimension. ``Partial``, strided shards and a dimension sharded on two mesh dimensions are refused."""
    module = _module()
    ndim = value.dim()
    vocab_mesh_dims, sequence_mesh_dims = [], []
    for mesh_dim, placement in enumerate(value.placements):
        kind = _placement_name(placement)
        if isinstance(placement, module.Replicate):
            continue
        if type(placement) is not module.Shard:
            what = "a Partial (pending reduction)" if placement.is_partial() else f"a {kind}"
            raise ValueError(f"{name} is a DTensor with {what} placement on mesh dimension {mesh_dim}: kltriton takes "
                             f"DTensors that are Shard or Replicate on every mesh dimension. Redistribute it first, "
                             f"e.g. {name}.redistribute(placements=[...Shard(-1) or Replicate()...]).")
        if vocab_dim is not None and placement.dim % ndim == vocab_dim:
            vocab_mesh_dims.append(mesh_dim)
        if sequence_dim is not None and placement.dim % ndim == sequence_dim:
            sequence_mesh_dims.append(mesh_dim)
    if len(vocab_mesh_dims) > 1:
        raise ValueError(f"{name} is a DTensor whose vocabulary dimension is sharded over mesh dimensions "
                         f"{vocab_mesh_dims}: kltriton shards the vocabulary over one process group. Redistribute it "
                         f"so that one mesh dimension shards the vocabulary and the others replicate it or shard the "
                         f"batch.")
    if len(sequence_mesh_dims) > 1:
        raise ValueError(f"{name} is a DTensor whose sequence dimension is sharded over mesh dimensions "
                         f"{sequence_mesh_dims}: kltriton splits the sequences over one group. Redistribute it so that "
                         f"one mesh dimension shards the sequence dimension.")

    def spread(dims):  # a dimension "split" over one rank is whole here: the local route, no collective
        return dims[0] if dims and value.device_mesh.size(dims[0]) > 1 else None

    return spread(vocab_mesh_dims), spread(sequence_mesh_dims)


def _sequence_axis(value, mesh_dim: Optional[int]) -> Optional[SequenceAxis]:
    if mesh_dim is None:
        return None
    mesh = value.device_mesh
    return SequenceAxis(mesh, mesh_dim, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), value.shape[1])


def _vocab_axis(value, mesh_dim: int, vocab: int, local_size: int, name: str) -> VocabAxis:
    """The ``VocabAxis`` of a vocabulary of ``vocab`` ids sharded over ``mesh_dim`` (``torch.chunk`` semantics:
    shards of ``ceil(V / n)`` ids, the last ones shorter or empty), checked against the local shard's size."""
    mesh = value.device_mesh
    parts, coordinate = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    chunk = -(-vocab // parts)
    start = min(coordinate * chunk, vocab)
    expected = max(0, min(vocab, start + chunk) - start)
    if expected != local_size:
        raise ValueError(f"{name} is a DTensor whose local vocabulary shard has {local_size} ids where its placement "
                         f"gives {expected} (torch.chunk of {vocab} ids over {parts} ranks): a DTensor built with "
                         f"from_local(..., shape=...) and other shard sizes. Pass the local tensor with "
                         f"process_group= and vocab_start= instead.")
    return VocabAxis(mesh, mesh_dim, mesh.get_group(mesh_dim), start, vocab)


def _sequence_dim(value) -> Optional[int]:
    """The sequence dimension of ``[B, T, V]`` logits or ``[B, T, H]`` hidden states (``[N, V]``: none; a
    ``Shard(0)`` of it is a batch split)."""
    return 1 if value.dim() == 3 else None


def local_logits(value, name: str):
    """``(local tensor, VocabAxis or None, SequenceAxis or None)`` of logits ``[..., V]``, a tensor or a DTensor."""
    if not is_dtensor(value):
        return value, None, None
    mesh_dim, sequence_mesh_dim = _check_placements(value, name, value.dim() - 1, _sequence_dim(value))
    local = value.to_local()
    sequence = _sequence_axis(value, sequence_mesh_dim)
    if mesh_dim is None:
        return local, None, sequence
    return local, _vocab_axis(value, mesh_dim, value.shape[-1], local.shape[-1], name), sequence


def _fsdp_or_tensor_parallel() -> str:
    return ("A weight that is a DTensor sharded on its first dimension (Shard(0)) is either (a) a tensor-parallel LM "
            "head (ColwiseParallel: each rank holds a vocabulary shard): then pass the hidden states as a Replicate "
            "DTensor on the same mesh (DTensor.from_local(hidden, mesh, [Replicate()]), or use_local_output=False on "
            "the layer before), and kltriton runs vocab-parallel; or (b) an FSDP2 (fully_shard) parameter read "
            "outside its module's forward: its Shard(0) rows are a piece of the flat parameter, not a vocabulary "
            "shard, and reading them as one gives silently wrong numbers: call kltriton inside the module's forward, "
            "or unshard the module first (module.unshard(), then module.reshard()) and pass its full weight "
            "(kltriton.integrations do this for you inside the trainers).")


def local_head(hidden, weight, bias):
    """``(hidden, weight, bias, VocabAxis or None, SequenceAxis or None)``: the local tensors of an LM head's inputs,
    the vocab axis of a tensor-parallel head (a ``Shard(0)`` weight with ``Replicate`` DTensor hidden states on that
    mesh dimension), and the sequence axis of hidden states ``[B, T, H]`` sharded on ``T``."""
    weight_mesh_dim = _check_placements(weight, "LinearLogits weight", 0)[0] if is_dtensor(weight) else None
    sequence = None
    if is_dtensor(hidden):
        sequence = _sequence_axis(hidden, _check_placements(hidden, "LinearLogits hidden", None,
                                                            _sequence_dim(hidden))[1])
        if hidden.placements and any(not p.is_replicate() and p.dim % hidden.dim() == hidden.dim() - 1
                                     for p in hidden.placements):
            raise ValueError("LinearLogits hidden is a DTensor sharded on its hidden dimension: kltriton takes hidden "
                             "states that replicate the hidden dimension (Replicate, or Shard of a leading dimension).")
    if bias is not None and is_dtensor(bias) != is_dtensor(weight):
        raise ValueError("LinearLogits bias must be a DTensor exactly when weight is one (with the same placements)")
    if bias is not None and is_dtensor(bias) and tuple(bias.placements) != tuple(
            p if p.is_replicate() else type(p)(0) for p in weight.placements):
        raise ValueError(f"LinearLogits bias placements {tuple(bias.placements)} must shard the vocabulary like the "
                         f"weight's {tuple(weight.placements)}")
    if weight_mesh_dim is None:
        local_bias = bias.to_local() if is_dtensor(bias) else bias
        return (hidden.to_local() if is_dtensor(hidden) else hidden,
                weight.to_local() if is_dtensor(weight) else weight, local_bias, None, sequence)
    if not is_dtensor(hidden):
        raise ValueError(f"LinearLogits got plain hidden states with a weight sharded as {tuple(weight.placements)}. "
                         + _fsdp_or_tensor_parallel())
    if hidden.device_mesh != weight.device_mesh or not hidden.placements[weight_mesh_dim].is_replicate():
        raise ValueError(f"LinearLogits hidden states must be a Replicate DTensor on the weight's mesh dimension "
                         f"{weight_mesh_dim} (a tensor-parallel head), got placements {tuple(hidden.placements)} with "
                         f"weight placements {tuple(weight.placements)}. " + _fsdp_or_tensor_parallel())
    local_weight = weight.to_local()
    axis = _vocab_axis(weight, weight_mesh_dim, weight.shape[0], local_weight.shape[0], "LinearLogits weight")
    return hidden.to_local(), local_weight, None if bias is None else bias.to_local(), axis, sequence


def local_rows(value, name: str):
    """The local tensor of a per-position tensor (labels, mask, advantages, ...): a tensor as it is; a DTensor that
    replicates it or shards a leading dimension (as the logits' batch) by its local tensor."""
    if not is_dtensor(value):
        return value
    _check_placements(value, name, None)
    return value.to_local()


def check_same_sequence_axis(axis: Optional[SequenceAxis], other: Optional[SequenceAxis], name: str,
                             other_name: str):
    """A DTensor reference split on the sequence dimension is split like the policy (a plain one is its local
    slice)."""
    if other is not None and (axis is None or axis.mesh != other.mesh or axis.mesh_dim != other.mesh_dim):
        where = "not sequence-split" if axis is None else f"sequence-split over mesh dimension {axis.mesh_dim}"
        raise ValueError(f"{other_name} is a DTensor split on the sequence dimension over mesh dimension "
                         f"{other.mesh_dim} but {name} is {where}: both sides must split the sequences alike")


def check_same_axis(axis: Optional[VocabAxis], other: Optional[VocabAxis], name: str, other_name: str):
    """Two inputs of one call shard the vocabulary alike (both local, or both over the same group)."""
    if (axis is None) != (other is None) or (axis is not None and (axis.mesh != other.mesh
                                                                   or axis.mesh_dim != other.mesh_dim)):
        def describe(a):
            return "not vocab-sharded" if a is None else f"vocab-sharded over mesh dimension {a.mesh_dim} of {a.mesh}"
        raise ValueError(f"{name} is {describe(axis)} but {other_name} is {describe(other)}: both sides of a call "
                         f"must shard the vocabulary alike")


def zero3_placeholder(tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter outside ``GatheredParameters``: 0 elements, its real shape in ``ds_shape``."""
    return isinstance(tensor, torch.Tensor) and tensor.numel() == 0 and hasattr(tensor, "ds_shape")
