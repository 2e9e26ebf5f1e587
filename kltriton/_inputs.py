"""Input checks and the label layout shared by every public op.

Everything here is ``O(N)`` work on the label side. It turns ``labels`` / ``mask`` /
``ignore_index`` / ``cu_seqlens`` / ``shift_labels`` into one flat ``target`` (see
``kltriton.kernels``) so the kernels only ever see ``[N, V]`` rows and a label per row.
"""
import math
from typing import NamedTuple, Optional

import torch

from kltriton.kernels import OUT_OF_RANGE, SKIP

_VALIDATE = True
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def set_validation(enabled: bool) -> bool:
    """Turn the host-side value checks on (default) or off.

    The checks that need the data on the host (labels inside ``[0, V)``, ``cu_seqlens``
    well formed) synchronize with the device; switch them off in hot loops. Kernels never
    read out of bounds either way: an out-of-range label then gives NaN at its position.

    Returns the previous setting, so a caller can restore it.
    """
    global _VALIDATE
    previous, _VALIDATE = _VALIDATE, bool(enabled)
    return previous


def host_checks() -> bool:
    """Whether to run the checks that read values on the host: on unless switched off, and
    never while ``torch.compile`` traces (a data-dependent branch would break the graph)."""
    return _VALIDATE and not torch.compiler.is_compiling()


class Layout(NamedTuple):
    target: torch.Tensor        # [N] int64: label, SKIP (not scored) or OUT_OF_RANGE
    shape: torch.Size           # S, the leading shape of the logits (shape of every output)
    num_seqs: int               # sequences: rows of [B, T], segments of cu_seqlens, else 1 (over every rank's slice)
    seq_index: Optional[torch.Tensor]  # [N] int64 sequence of each position (when asked for)
    position: Optional[torch.Tensor] = None  # [N] int64 place of each position along its sequence's axis (T of
    #                                          [B, T], or the packed stream), global under a sequence split (when asked)


def check_logits(logits, name="logits"):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16 (float64 on the reference "
                        f"backend), got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError(f"{name} must have shape [..., V], got a 0-dim tensor")
    if logits.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary dimension (V == 0)")


def check_float(name: str, value, *, above=None, at_least=None, allow_none: bool = False):
    """``value`` as a python float: a real number (not a bool or a tensor), finite, ``> above`` and
    ``>= at_least`` when given; ``None`` passes when ``allow_none``. Every float option of every op goes
    through here (a NaN passes every ``<`` / ``>`` check, so each range check alone would let it through).
    While ``torch.compile`` traces, the float is a graph input and is returned unchecked (a comparison
    would specialize the graph on its value)."""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a python float, got None")
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a python float{' or None' if allow_none else ''}, got "
                        f"{type(value).__name__}")
    if torch.compiler.is_compiling():
        return value
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be > {above}, got {value}")
    if at_least is not None and not value >= at_least:
        raise ValueError(f"{name} must be >= {at_least}, got {value}")
    return value


def runtime_scalar(value, device) -> torch.Tensor:
    """A python float as a 0-dim float64 tensor on ``device``, the form the custom ops take.

    A float argument of a custom op is baked into the graph by ``torch.compile`` (a new value
    recompiles); a tensor is data. Written as ``ones * value`` (kernels with the value as an
    argument: no host-to-device copy) because Dynamo turns a traced float into a graph input
    only where it meets tensor arithmetic, and would specialize ``torch.full((), value)``.
    """
    return torch.ones((), dtype=torch.float64, device=device) * value


def check_temperature(temperature, device, shape=None) -> torch.Tensor:
    """``temperature`` as the kernels take it: a float64 tensor, 0-dim or ``[N]`` (one per position).

    Accepts a python float, a 0-dim floating tensor, or (when ``shape``, the logits' leading shape
    ``S``, is given) a floating tensor of shape ``S`` (e.g. verl's per-sample temperature repeated
    over its tokens). A tensor is data, so a new value never recompiles under ``torch.compile``.
    Positive and finite, else ``ValueError``: checked for a float in eager calls, and for a tensor
    only with the host checks on (it reads the values: a sync).
    """
    if isinstance(temperature, torch.Tensor):
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature must be a float or a floating tensor, got {temperature.dtype}")
        if temperature.dim() != 0 and (shape is None or tuple(temperature.shape) != tuple(shape)):
            expected = "0-dim" if shape is None else f"0-dim or of shape {tuple(shape)} (the logits' leading shape)"
            raise ValueError(f"temperature must be {expected}, got shape {tuple(temperature.shape)}")
        if temperature.device != torch.device(device):
            raise ValueError(f"temperature is on {temperature.device} but logits are on {device}")
        if host_checks() and temperature.numel() and not bool(
                ((temperature > 0) & torch.isfinite(temperature)).all()):
            raise ValueError("temperature must be > 0 and finite everywhere")
        t = temperature.detach().to(torch.float64)
        return t if t.dim() == 0 else t.reshape(-1).contiguous()
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a python float or a floating tensor, got {type(temperature).__name__}")
    # While torch.compile traces, the float is a symbolic graph input: comparing it would
    # specialize the graph on its value, so the range check runs in eager calls only.
    if not torch.compiler.is_compiling() and not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    return runtime_scalar(temperature, device)


def _check_same_leading(name, tensor, shape, device, integer=False, boolean=False):
    """``tensor`` of the logits' leading ``shape`` on ``device``. ``integer``: an integer tensor; ``boolean``: bool
    or integer (a Hugging Face attention_mask)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if integer and (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor (any integer dtype: int64, int32, uint8, ...), got "
                        f"{tensor.dtype}")
    if boolean and (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        raise TypeError(f"{name} must be a bool or integer tensor (0 = not scored), got {tensor.dtype}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (the logits' leading "
                         f"shape), got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but logits are on {device}")


def _check_cu_seqlens(cu_seqlens, shape, device, total=None):
    """``cu_seqlens`` of flat ``shape [N]``; under a sequence split its offsets are global: they end at ``total``
    (every rank's packed tokens)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if len(shape) != 1:
        raise ValueError(f"cu_seqlens needs flat packed logits [N, V], got leading shape {tuple(shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but logits are on {device}")
    if host_checks():
        n = shape[0] if total is None else int(total)
        first, last = cu_seqlens[0].item(), cu_seqlens[-1].item()
        if first != 0 or last != n:
            where = "" if total is None else " (every rank's packed tokens: the offsets are global under a sequence_group)"
            raise ValueError(f"cu_seqlens must start at 0 and end at N={n}{where}, got {first} ... {last}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")


def _shift_left(tensor, fill, sequence_ends, following=None):
    """``tensor[t + 1]`` at position ``t`` along the last dim; ``fill`` where no next token exists. ``following``:
    the values after the last position (the next rank's first ones, ``tensor.shape[:-1]``), else ``fill``.
    ``sequence_ends``: the positions that end a sequence (an index or a bool mask), ``fill`` there."""
    shifted = torch.full_like(tensor, fill)
    shifted[..., :-1] = tensor[..., 1:]
    if following is not None:
        shifted[..., -1] = following
    if sequence_ends is not None:
        shifted[sequence_ends] = fill
    return shifted


def _from_next_slice(labels, mask, split, ignore_index):
    """``(labels, mask)`` after this rank's slice: the first position's of the next rank that holds one (shape
    ``labels.shape[:-1]``), ``ignore_index`` / False after the last slice. One all-gather (``parallel``)."""
    from kltriton import parallel

    rows = labels.shape[:-1]
    width = labels.shape[-1]
    first = labels[..., 0] if width else torch.zeros(rows, dtype=labels.dtype, device=labels.device)
    parts = [first.reshape(-1)]
    if mask is not None:
        parts.append((mask[..., 0] if width else torch.zeros(rows, dtype=torch.bool, device=mask.device))
                     .reshape(-1).long())
    values, present = parallel.from_next_rank(torch.cat(parts), split)
    count = rows.numel()
    next_labels = torch.where(present, values[:count], torch.full_like(values[:count], ignore_index)).view(rows)
    next_mask = None if mask is None else ((values[count:] != 0) & present).view(rows)
    return next_labels, next_mask


def _split_sequence_ends(cu_seqlens, n, split):
    """``[n]`` bool: this rank's positions that end a packed segment, from the global ``cu_seqlens`` (an empty
    segment marks the one before it, as ``_last_positions``)."""
    ends = torch.remainder(cu_seqlens[1:].long() - 1, split.total) - split.start
    inside = (ends >= 0) & (ends < n)
    dump = torch.full_like(ends, n)
    return torch.zeros(n + 1, dtype=torch.bool, device=ends.device).scatter_(0, torch.where(inside, ends, dump),
                                                                             True)[:n]


def _last_positions(cu_seqlens, n):
    """Flat index of the last position of every packed segment.

    An empty segment starting at ``k`` yields ``k - 1``, which is always the last position of
    the segment before it (``-1`` wraps to ``N - 1``, the last position of all), so the result
    is right without filtering empty segments (which would need a host sync).
    """
    return torch.remainder(cu_seqlens[1:].long() - 1, n)


def build_layout(shape, vocab, device, labels, *, ignore_index, mask, cu_seqlens, shift_labels,
                 with_seq_index=False, spans: str = "", split=None) -> Layout:
    """Validate the label-side arguments against the logits' leading ``shape`` (on ``device``) and build the flat
    ``target``. Labels must lie in ``[0, vocab)``: the global vocabulary (``spans``: how the ranks' shards cover
    it, for the error message).

    ``split``: this rank's ``parallel.SequenceSplit`` (a sequence group): ``shape`` is this rank's slice of the
    sequence dimension (``[B, T_r]``, or ``[N_r]`` of the packed stream with the global ``cu_seqlens``); the shift
    takes the last position's label and mask from the next rank's slice (one all-gather, every rank calls it), and
    sequences and positions are the global ones."""
    shape = torch.Size(shape)
    if (shift_labels and isinstance(labels, torch.Tensor) and labels.dim() == len(shape) >= 1
            and labels.shape[:-1] == shape[:-1] and labels.shape[-1] == shape[-1] + 1):
        raise ValueError(f"labels {tuple(labels.shape)} are one longer than the logits' positions "
                         f"{tuple(shape)}: pass the unsliced logits with shift_labels=True, or sliced "
                         f"logits with labels[:, 1:] and shift_labels=False")
    _check_same_leading("labels", labels, shape, device, integer=True)
    if mask is not None:
        _check_same_leading("mask", mask, shape, device, boolean=True)
        mask = mask if mask.dtype == torch.bool else mask != 0
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, shape, device, None if split is None else split.total)
    n = labels.numel()
    if shift_labels and labels.dim() == 0:
        raise ValueError("shift_labels=True needs labels with a time dimension")

    labels = labels.long()
    if shift_labels:
        following = (None, None) if split is None else _from_next_slice(labels, mask, split, ignore_index)
        if n:
            if cu_seqlens is None:
                ends = None
            else:
                ends = _last_positions(cu_seqlens, n) if split is None else _split_sequence_ends(cu_seqlens, n, split)
            labels = _shift_left(labels, ignore_index, ends, following[0])
            if mask is not None:
                mask = _shift_left(mask, False, ends, following[1])
    scored = labels != ignore_index
    if mask is not None:
        scored = scored & mask
    in_range = (labels >= 0) & (labels < vocab)
    if host_checks() and n and bool((scored & ~in_range).any()):
        bad = labels[scored & ~in_range][0].item()
        where = f", the vocabulary the ranks' shards cover ({spans})" if spans else ""
        raise ValueError(f"labels must lie in [0, V={vocab}){where} or equal ignore_index={ignore_index}; found {bad}")
    target = torch.where(scored, torch.where(in_range, labels, OUT_OF_RANGE), SKIP).reshape(-1)

    seq_index = position = None
    start = 0 if split is None else split.start
    if with_seq_index:  # the place of each position along the sequence axis: T of [B, T], or the flat stream
        flat = torch.arange(n, device=device)
        position = start + (flat % max(shape[-1], 1) if labels.dim() >= 2 else flat)
    if labels.dim() >= 2:
        num_seqs = n // shape[-1] if shape[-1] else shape[:-1].numel()
        if with_seq_index:
            seq_index = torch.arange(n, device=device) // max(shape[-1], 1)
    elif cu_seqlens is not None:
        num_seqs = cu_seqlens.numel() - 1
        if with_seq_index:
            seq_index = torch.searchsorted(cu_seqlens[1:].long().contiguous(), position, right=True)
    else:
        num_seqs = 1
        if with_seq_index:
            seq_index = torch.zeros(n, dtype=torch.long, device=device)
    return Layout(target.contiguous(), shape, num_seqs, seq_index, position)
