"""The front door of every public function: the user's inputs as one normalized ``Call`` before any shape is read.

Every public function (``token_logprobs``, ``token_kl``, ``fused_kl_reward``, ``policy_loss``, ``token_divergence``)
starts with ``enter``, which checks each input once and turns

- the policy (``logits``, ``student``): a tensor, a ``LinearLogits``, or either with DTensors
  (``kltriton._dtensor``), into this rank's ``Side``;
- the reference (``ref``, ``teacher``): logits / ``LinearLogits`` (a ``Side``, detached), per-position log-probs
  (``[N]``), or a ``TopK``;
- the label-side arguments into the flat ``Layout`` (``kltriton._inputs``);
- ``temperature`` into the kernels' float64 tensor, ``truncation`` into a ``Truncation`` or None;
- ``process_group`` / ``vocab_start``, or a DTensor's placement, into one ``VocabShard`` (or None);
- ``sequence_group``, or a DTensor's placement on the sequence dimension, into one ``SequenceSplit`` (or None), which
  the layout reads (the shift across the split, global sequences and positions);

and keeps the user's ``backend`` choice for ``kltriton.route``, which resolves it per kernel family. What is left
in each public function is its own arithmetic. A plain ``token_logprobs`` call (``route.plain``) starts with
``enter_plain`` instead: the same checks of its few inputs, without a ``Call``.
"""
from typing import NamedTuple, Optional

import torch

from kltriton import _dtensor, parallel
from kltriton._inputs import LOGIT_DTYPES, Layout, build_layout, check_logits, check_temperature
from kltriton._values import runtime_scalar
from kltriton.kernels.linear import Side
from kltriton.kernels.linear.tiles import default_tile_elements
from kltriton.linear_logits import LinearLogits
from kltriton.topk import TopK
from kltriton.truncation import Truncation, check_truncation
from kltriton import collectives

local_rows = _dtensor.local_rows
check_group = collectives.check_group


class Call(NamedTuple):
    """One public call, normalized. Every tensor is this rank's local one."""
    policy: Side                           # dense logits (weight None) or an LM head: the gradient reaches it
    ref: Optional[Side]                    # reference logits or LM head, detached; None without (or as below)
    ref_logprobs: Optional[torch.Tensor]   # [N] given reference log-probs (as given; unscored rows not zeroed)
    topk: Optional[TopK]                   # a sparse teacher (token_divergence)
    layout: Layout                         # target [N], leading shape S, sequences
    temperature: torch.Tensor              # float64, 0-dim or [N]
    truncation: Optional[Truncation]       # the policy's truncated distribution, or None
    shard: Optional[parallel.VocabShard]   # this rank's vocab shard, or None
    backend: Optional[str]                 # the user's choice; kltriton.route resolves it per family
    tile_elements: int                     # working tile of a projected side (0 without one)
    split: Optional[collectives.SequenceSplit] = None  # this rank's slice of the sequences (a sequence group), or None

    @property
    def sequence_group(self):
        """The group of ranks that hold the other slices of the sequences (None: the sequences are whole here)."""
        return None if self.split is None else self.split.group

    @property
    def device(self) -> torch.device:
        return self.policy.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.x.dtype

    @property
    def vocab(self) -> int:
        """The global vocabulary (every rank's shards together)."""
        return self.shard.vocab if self.shard is not None else _width(self.policy)

    @property
    def projected(self) -> bool:
        """Whether a side is an LM head (``LinearLogits``): the ``linear`` family."""
        return self.policy.weight is not None or (self.ref is not None and self.ref.weight is not None)


def _width(side: Side) -> int:
    return side.x.shape[-1] if side.weight is None else side.weight.shape[0]


def _side(value, name: str, detach: bool = False):
    """``(Side, VocabAxis or None, SequenceAxis or None, full shape, tile_elements or None)`` of logits or a
    ``LinearLogits``."""
    if isinstance(value, LinearLogits):
        hidden, weight, bias, axis, sequence = _dtensor.local_head(value.hidden, value.weight, value.bias)
        scale = None if value.logit_scale == 1.0 else runtime_scalar(value.logit_scale, hidden.device)
        softcap = None if value.softcap is None else runtime_scalar(value.softcap, hidden.device)
        side = Side(hidden, weight, bias, scale, softcap)
        if detach:
            side = Side(*(None if t is None else t.detach() for t in side))
        return side, axis, sequence, value.shape, value.tile_elements
    check_logits(value, name)
    local, axis, sequence = _dtensor.local_logits(value, name)
    return Side(local.detach() if detach else local, None, None, None, None), axis, sequence, value.shape, None


def _accepted(forms) -> str:
    """The reference's accepted ``forms``, in words (for an error)."""
    words = {"logits": "logits (a tensor or a kltriton.LinearLogits)", "logprobs": "log-probs",
             "topk": "a kltriton.TopK"}
    return " or ".join(words[form] for form in forms)


def _reference(ref, forms, policy, policy_shape, names):
    """The reference as ``(side, axis, logprobs, topk, tile)``: logits or a ``LinearLogits`` of the policy's shape
    (``"logits"`` in ``forms``), log-probs of its leading shape (``"logprobs"``) or a ``TopK`` (``"topk"``). A
    DTensor is held against the policy's global shape, a plain tensor against this rank's local one."""
    name, policy_name = names
    policy_dtype, device = policy.x.dtype, policy.x.device
    if not _dtensor.is_dtensor(ref) and not isinstance(ref, LinearLogits):
        policy_shape = (*policy.x.shape[:-1], policy_shape[-1])
    if isinstance(ref, TopK) and "topk" in forms:
        if tuple(ref.shape[:-1]) != tuple(policy_shape[:-1]):
            raise ValueError(f"{name} TopK ids must have shape {tuple(policy_shape[:-1])} + (K,), got "
                             f"{tuple(ref.shape)}")
        if ref.device != device:
            raise ValueError(f"{name} is on {ref.device} but {policy_name} is on {device}")
        return None, None, None, ref, None
    if not isinstance(ref, (torch.Tensor, LinearLogits)):
        raise TypeError(f"{name} must be {_accepted(forms)}, got {type(ref).__name__}")
    if ref.device != device:
        raise ValueError(f"{name} is on {ref.device} but {policy_name} is on {device}")
    if isinstance(ref, LinearLogits) or tuple(ref.shape) == tuple(policy_shape):
        if "logits" not in forms:
            raise TypeError(f"{name} must be {_accepted(forms)}, got logits of shape {tuple(ref.shape)}")
        if isinstance(ref, LinearLogits) and ref.shape != policy_shape:
            raise ValueError(f"{name} must have {policy_name}'s shape {tuple(policy_shape)}, got {tuple(ref.shape)}")
        # Any logits dtype, also one other than the policy's (a bf16 policy, an fp32 reference); float64 only with
        # float64 logits (the reference backend).
        if not isinstance(ref, LinearLogits) and (
                ref.dtype not in LOGIT_DTYPES or (ref.dtype == torch.float64) != (policy_dtype == torch.float64)):
            raise TypeError(f"{name} logits must be float32, bfloat16 or float16 (float64 only with float64 "
                            f"{policy_name}), got {ref.dtype} with {policy_name} {policy_dtype}")
        side, axis, sequence, _, tile = _side(ref, name, detach=True)
        return side, (axis, sequence), None, None, tile
    if "logprobs" in forms and tuple(ref.shape) == tuple(policy_shape[:-1]):
        if not ref.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {ref.dtype}")
        return None, None, local_rows(ref, name).detach().reshape(-1), None, None
    shapes = [f"logits of shape {tuple(policy_shape)}"] if "logits" in forms else []
    shapes += [f"log-probs of shape {tuple(policy_shape[:-1])}"] if "logprobs" in forms else []
    raise ValueError(f"{name} must be {' or '.join(shapes)}, got {tuple(ref.shape)}")


def _shard(axis, process_group, vocab_start, side: Side, rows: int) -> Optional[parallel.VocabShard]:
    """The call's ``VocabShard``: from a DTensor's vocab axis (no collective), or from ``process_group`` /
    ``vocab_start`` (``parallel.vocab_shard``)."""
    if axis is None:
        return parallel.vocab_shard(_width(side), rows, side.x.device, process_group, vocab_start)
    if process_group is not None and not collectives.same_group(process_group, axis.group):
        raise ValueError("process_group is not the group of the mesh dimension that shards the DTensor's vocabulary "
                         f"(mesh dimension {axis.mesh_dim} of {axis.mesh}): pass process_group=None with DTensors, "
                         "or that dimension's group (mesh.get_group(dim))")
    if vocab_start is not None and vocab_start != axis.start:
        raise ValueError(f"vocab_start={vocab_start} contradicts the DTensor's placement, which puts this rank's "
                         f"shard at {axis.start}: leave vocab_start None with DTensors")
    return parallel.chunked_shard(axis.group, axis.start, _width(side), axis.vocab)


def _split(axis, sequence_group, leading, device) -> Optional[collectives.SequenceSplit]:
    """The call's ``SequenceSplit``: from a DTensor's sequence axis (no collective), or from ``sequence_group``
    (``parallel.sequence_split``: one small all-gather)."""
    if axis is None and sequence_group is None:
        return None
    if len(leading) == 0:
        raise ValueError("sequence_group needs logits with a sequence dimension: [B, T, V] or packed [N, V]")
    if axis is None:
        return parallel.sequence_split(leading[-1], leading[:-1].numel(), len(leading), device, sequence_group)
    if sequence_group is not None and not collectives.same_group(sequence_group, axis.group):
        raise ValueError("sequence_group is not the group of the mesh dimension that shards the DTensor's sequence "
                         f"dimension (mesh dimension {axis.mesh_dim} of {axis.mesh}): pass sequence_group=None with "
                         "DTensors, or that dimension's group (mesh.get_group(dim))")
    return parallel.chunked_split(axis.group, axis.rank, axis.length, device)


def enter_plain(logits, labels, *, temperature, ignore_index, mask, cu_seqlens, shift_labels, backend):
    """``(Layout, temperature)`` of a plain call (``route.plain``: dense logits and the label side as plain tensors,
    nothing sharded, split or truncated), checked as ``enter`` checks them, without the ``Call`` the rest needs."""
    check_logits(logits, "logits")
    parallel.check_no_group()
    leading, device = logits.shape[:-1], logits.device
    kernel_temperature = check_temperature(temperature, device, leading)
    layout = build_layout(leading, logits.shape[-1], device, labels, ignore_index=ignore_index, mask=mask,
                          cu_seqlens=cu_seqlens, shift_labels=shift_labels,
                          temperature=kernel_temperature if isinstance(temperature, torch.Tensor) else None,
                          backend=backend, float64=logits.dtype == torch.float64)
    return layout, kernel_temperature


def enter(logits, labels, *, ref=None, ref_forms=("logits", "logprobs"), names=("logits", "ref"), temperature=1.0,
          ignore_index=-100, mask=None, cu_seqlens=None, shift_labels=False, backend=None, process_group=None,
          vocab_start=None, truncation=None, sequence_group=None) -> Call:
    """The ``Call`` of a public function's inputs (see the module docstring). ``names``: how the call names its
    policy and reference in error messages; ``ref_forms``: the reference's accepted forms (``"logits"``,
    ``"logprobs"``, ``"topk"``)."""
    policy_name, ref_name = names
    policy, axis, sequence_axis, shape, tile = _side(logits, policy_name)
    device = policy.x.device
    ref_side = ref_logprobs = topk = None
    if ref is not None:
        ref_side, ref_axes, ref_logprobs, topk, ref_tile = _reference(ref, ref_forms, policy, shape,
                                                                      (ref_name, policy_name))
        if ref_side is not None:
            _dtensor.check_same_axis(axis, ref_axes[0], policy_name, ref_name)
            _dtensor.check_same_sequence_axis(sequence_axis, ref_axes[1], policy_name, ref_name)
            tile = tile or ref_tile
    leading = policy.x.shape[:-1]
    shard = _shard(axis, process_group, vocab_start, policy, leading.numel())
    split = _split(sequence_axis, sequence_group, leading, device)
    given = local_rows(temperature, "temperature")
    temperature = check_temperature(given, device, leading)
    truncation = check_truncation(truncation)
    vocab = shard.vocab if shard is not None else shape[-1]
    layout = build_layout(leading, vocab, device, local_rows(labels, "labels"), ignore_index=ignore_index,
                          mask=None if mask is None else local_rows(mask, "mask"),
                          cu_seqlens=None if cu_seqlens is None else local_rows(cu_seqlens, "cu_seqlens"),
                          shift_labels=shift_labels, temperature=temperature if isinstance(given, torch.Tensor) else None,
                          spans=shard.spans if shard is not None else "", split=split, backend=backend,
                          float64=policy.x.dtype == torch.float64)
    projected = policy.weight is not None or (ref_side is not None and ref_side.weight is not None)
    tile = tile or (default_tile_elements(device.type) if projected or truncation is not None else 0)
    return Call(policy, ref_side, ref_logprobs, topk, layout, temperature, truncation, shard, backend, tile, split)
