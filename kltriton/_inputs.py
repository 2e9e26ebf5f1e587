"""Input checks and the label layout shared by every public op.

Everything here is ``O(N)`` work on the label side. It turns ``labels`` / ``mask`` /
``ignore_index`` / ``cu_seqlens`` / ``shift_labels`` into one flat ``target`` (see
``kltriton.kernels``) so the kernels only ever see ``[N, V]`` rows and a label per row.
"""
import math

import torch

from kltriton import collectives, dispatch
from kltriton._values import runtime_scalar
from kltriton.kernels import constants
from kltriton.kernels.layout import record
from kltriton.kernels.layout import reference as layout_reference
from kltriton.ops import layout as layout_ops
from kltriton.ops._define import eager
from kltriton.ops.layout import flag_vector, raise_flagged

_VALIDATE = True  # True, False or "sync"
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
VALIDATION_MODES = (True, False, "sync")


def set_validation(enabled) -> object:
    """How the values of the inputs are checked (labels inside ``[0, V)`` or ``ignore_index``, ``cu_seqlens``
    well formed, a per-position temperature ``> 0`` and finite); returns the previous setting.

    - ``True`` (default), never a synchronization: on CPU the values are on the host and a bad one is a
      ``ValueError`` at once; on a device the kernels record it in the device's flag vector, and
      ``kltriton.check_inputs()`` raises it later (the bad positions are NaN meanwhile).
    - ``"sync"``: as ``True``, and on a device every call reads the flags (a synchronization per call: for
      debugging).
    - ``False``: no checks. Either way the kernels never read out of bounds: a bad label gives NaN at its position.
    """
    global _VALIDATE
    if enabled not in VALIDATION_MODES or isinstance(enabled, int) and not isinstance(enabled, bool):
        raise ValueError(f"set_validation takes True, False or 'sync', got {enabled!r}")
    previous, _VALIDATE = _VALIDATE, enabled
    return previous


def validating() -> bool:
    """Whether the value checks run at all (validation on, and not while ``torch.compile`` traces)."""
    return _VALIDATE is not False and not torch.compiler.is_compiling()


def host_checks(device=None) -> bool:
    """Whether to run the checks that read values on the host: on CPU tensors (``device`` None or a CPU device)
    unless validation is off, on a device only with ``set_validation("sync")``; never while ``torch.compile``
    traces (a data-dependent branch would break the graph)."""
    if _VALIDATE is False or torch.compiler.is_compiling():
        return False
    if _VALIDATE == "sync" or device is None:
        return True
    return (device if isinstance(device, torch.device) else torch.device(device)).type == "cpu"


# What ``checked_ids`` records on a device, per kind of ids: the flag bit and the slot of the first bad id.
_ID_FLAGS = {"TopK": (constants.BAD_TOPK_ID, "topk_id"), "support": (constants.BAD_SUPPORT_ID, "support_id")}


def checked_ids(ids, vocab, name: str):
    """``(ids, bad_rows)`` of ``[N, K]`` int64 ``ids`` that must lie in ``[-1, vocab)`` (``name``: ``"TopK"`` or
    ``"support"``): ``bad_rows`` ``[N]`` bool, the rows that held another id (None: none can). With validation on
    such an id raises at once on CPU (or with ``set_validation("sync")``); on a device it is recorded in the device's
    flag vector (``kltriton.check_inputs()`` raises it) and read as padding (``-1``), and the caller scores its row as
    NaN: no host read."""
    if not (validating() and ids.numel()):
        return ids, None
    if host_checks(ids.device):
        low, high = ids.aminmax()
        if low.item() < -1 or high.item() >= vocab:  # one pass over the ids, not four
            found = ids[(ids < -1) | (ids >= vocab)][0].item()
            raise ValueError(f"{name} ids must lie in [0, V={vocab}) or be -1 (padding); found {found}")
        return ids, None
    bad = (ids < -1) | (ids >= vocab)
    first = ids.reshape(-1).take(bad.reshape(-1).to(torch.int8).argmax())  # (indexing by a tensor would read it)
    bit, slot = _ID_FLAGS[name]
    record(flag_vector(ids.device), bit, bad.any(), ((slot, first),))
    return ids.masked_fill(bad, -1), bad.any(1)


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


def check_temperature(temperature, device, shape=None) -> torch.Tensor:
    """``temperature`` as the kernels take it: a float64 tensor, 0-dim or ``[N]`` (one per position).

    Accepts a python float, a 0-dim floating tensor, or (when ``shape``, the logits' leading shape
    ``S``, is given) a floating tensor of shape ``S`` (e.g. verl's per-sample temperature repeated
    over its tokens). A tensor is data, so a new value never recompiles under ``torch.compile``.
    Positive and finite, else ``ValueError``: checked for a float in eager calls, and for a tensor by
    the layout op with the other input values (``set_validation``).
    """
    if isinstance(temperature, torch.Tensor):
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature must be a float or a floating tensor, got {temperature.dtype}")
        if temperature.dim() != 0 and (shape is None or tuple(temperature.shape) != tuple(shape)):
            expected = "0-dim" if shape is None else f"0-dim or of shape {tuple(shape)} (the logits' leading shape)"
            raise ValueError(f"temperature must be {expected}, got shape {tuple(temperature.shape)}")
        if temperature.device != torch.device(device):
            raise ValueError(f"temperature is on {temperature.device} but logits are on {device}")
        t = temperature.detach().to(torch.float64)  # its values are checked by the layout op
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
    if tensor.shape != shape:
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
    if total is not None and host_checks(device):  # under a split; else the layout op checks the values
        first, last = cu_seqlens[0].item(), cu_seqlens[-1].item()
        if first != 0 or last != int(total):
            raise ValueError(f"cu_seqlens must start at 0 and end at N={int(total)} (every rank's packed tokens: the "
                             f"offsets are global under a sequence_group), got {first} ... {last}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")


def _from_next_slice(labels, mask, split, ignore_index):
    """``(labels, mask)`` after this rank's slice: the first position's of the next rank that holds one (shape
    ``labels.shape[:-1]``), ``ignore_index`` / False after the last slice. One all-gather (``parallel``)."""

    rows = labels.shape[:-1]
    width = labels.shape[-1]
    first = labels[..., 0] if width else torch.zeros(rows, dtype=labels.dtype, device=labels.device)
    parts = [first.reshape(-1).long()]
    if mask is not None:
        parts.append((mask[..., 0] if width else torch.zeros(rows, dtype=torch.bool, device=mask.device))
                     .reshape(-1).long())
    values, present = collectives.from_next_rank(torch.cat(parts), split)
    count = rows.numel()
    next_labels = torch.where(present, values[:count], torch.full_like(values[:count], ignore_index)).view(rows)
    next_mask = None if mask is None else ((values[count:] != 0) & present).view(rows)
    return next_labels, next_mask


def _split_sequence_ends(cu_seqlens, n, split):
    """``[n]`` bool: this rank's positions that end a packed segment, from the global ``cu_seqlens`` (an empty
    segment marks the one before it)."""
    ends = torch.remainder(cu_seqlens[1:].long() - 1, split.total) - split.start
    inside = (ends >= 0) & (ends < n)
    dump = torch.full_like(ends, n)
    return torch.zeros(n + 1, dtype=torch.bool, device=ends.device).scatter_(0, torch.where(inside, ends, dump),
                                                                             True)[:n]


def _rows2d(tensor):
    """A tensor of the logits' leading shape as ``[R, C]`` rows of sequences (its last dim; ``[1, N]`` for flat
    positions, ``[1, 1]`` for a 0-dim one), a view where the strides allow."""
    dim = tensor.dim()
    if dim == 2:
        return tensor
    if dim <= 1:
        return tensor.reshape(1, -1)
    return tensor.reshape(tensor.shape[:-1].numel(), tensor.shape[-1])


class Layout:
    """The label side of a call, normalized: the per-row ``target`` (made by the ``layout`` op when first read, or
    with a loss's per-row inputs by ``weighted``), and what the sequence-level code needs, the positions' sequences
    and places, made only when asked for (a few ``[N]`` ops). (Plain attributes, not ``functools.cached_property``,
    whose lock ``torch.compile`` cannot trace.)"""

    def __init__(self, shape, num_seqs, cu_seqlens=None, split=None, source=None, target=None):
        self.shape = shape            # S, the leading shape of the logits (shape of every output)
        self.sizes = tuple(shape)     # S as view's arguments (``shaped``)
        self.num_seqs = num_seqs      # rows of [B, T], segments of cu_seqlens, else 1 (over every rank's slice)
        self.cu_seqlens = cu_seqlens  # the packed offsets (global under a split), or None
        self.split = split            # this rank's collectives.SequenceSplit, or None
        self._source = source         # the layout op's arguments (the last: how to resolve its backend) and the
        #                               checks' context; None: the target is given
        self._target, self._position, self._seq_index = target, None, None

    @property
    def target(self) -> torch.Tensor:
        """``[N]`` int64: label, ``SKIP`` (not scored) or ``OUT_OF_RANGE``."""
        if self._target is None:
            args = self._launch_args()
            self._target = layout_ops.launch_target(*args) if eager(args) else layout_ops.target(*args)
            _raise_now(self._source[1])
        return self._target

    def _launch_args(self) -> tuple:
        """The layout op's arguments, its backend resolved now: only a launch of it needs the name (a kernel that
        makes the target with its statistics, ``kernel_source``, runs its own backend's)."""
        *args, (backend, device_type, float64) = self._source[0]
        return (*args, dispatch.resolve(backend, "layout", device_type, float64))

    def shaped(self, values: torch.Tensor) -> torch.Tensor:
        """``[N]`` ``values`` viewed as the leading shape ``S``. The sizes go to ``view`` one by one: a ``torch.Size``
        argument costs it twice as much (3 us against 1.5 on a tensor with a gradient, on this project's CPU)."""
        return values.view(*self.sizes) if self.sizes else values.view(())

    @property
    def pending(self) -> bool:
        """Whether the target is still to be made from the label side (a kernel may make it with its statistics:
        ``kernel_source``, then ``made``)."""
        return self._target is None

    @property
    def source(self) -> tuple:
        """The label side's tensors and values as the layout op takes them (for ``ops._define.eager``)."""
        return self._source[0]

    def kernel_source(self) -> tuple:
        """The label side as the stream family's ``forward_labels`` takes it (``labels2d``, ``mask2d``,
        ``cu_seqlens``, the temperature to check, ``ignore_index``, ``shift``, the flag vector or None), for a kernel
        that makes the target with its statistics; then ``made``."""
        labels2d, mask2d, cu_seqlens, temperature, ignore_index, _, shift, check, _ = self._source[0]
        return (labels2d, mask2d, cu_seqlens, temperature, ignore_index, shift,
                flag_vector(labels2d.device) if check else None)

    def made(self, target: torch.Tensor) -> None:
        """Take the target a kernel made from ``kernel_source``, and raise what its checks found."""
        self._target = target
        _raise_now(self._source[1])

    def weighted(self, weights) -> torch.Tensor:
        """A loss's per-row inputs (``kltriton.kernels.layout.RowWeights``: ``[5, N]`` fp32 advantages, aggregation
        weights, ``w_pg``, ``w_kl``, ``w_ent``), made with the target in one op: before the target is read."""
        if self._target is not None:
            raise RuntimeError("Layout.weighted: the target is made already; ask for the weights first")
        *given, name = self._launch_args()
        args = (*given, weights, name)
        launch = layout_ops.launch_target_weights if eager(args) else layout_ops.target_weights
        self._target, prepared = launch(*args)
        _raise_now(self._source[1])
        return prepared

    def scored_rows(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` with the rows of ``rows [N, H]`` at the scored positions (the others, and ``out``'s rows past ``N``,
        zero: a one-tile projection's GEMM operand), written with the target in one op (the layout family's
        ``target_rows``), in an eager call before the target is made."""
        if self._target is not None:
            raise RuntimeError("Layout.scored_rows: the target is made already; ask for the rows first")
        *given, name = self._launch_args()
        self._target, out = layout_ops.launch_target_rows(*given, rows, out, name)
        _raise_now(self._source[1])
        return out

    @property
    def position(self) -> torch.Tensor:
        """``[N]`` int64: each position's place along its sequence's axis (``T`` of ``[B, T]``, or the packed
        stream), global under a sequence split."""
        if self._position is None:
            n, device = self.target.numel(), self.target.device
            start = 0 if self.split is None else self.split.start
            flat = torch.arange(n, device=device)
            self._position = start + (flat % max(self.shape[-1], 1) if len(self.shape) >= 2 else flat)
        return self._position

    @property
    def seq_index(self) -> torch.Tensor:
        """``[N]`` int64: each position's sequence."""
        if self._seq_index is None:
            n, device = self.target.numel(), self.target.device
            if len(self.shape) >= 2:
                self._seq_index = torch.arange(n, device=device) // max(self.shape[-1], 1)
            elif self.cu_seqlens is not None:
                self._seq_index = torch.searchsorted(self.cu_seqlens[1:].long().contiguous(), self.position,
                                                     right=True)
            else:
                self._seq_index = torch.zeros(n, dtype=torch.long, device=device)
        return self._seq_index


def _raise_now(context) -> None:
    """After a layout op: raise what its checks found where the values are on the host (``host_checks``)."""
    if context is not None:
        raise_flagged(context["device"], context)


def build_layout(shape, vocab, device, labels, *, ignore_index, mask, cu_seqlens, shift_labels, temperature=None,
                 spans: str = "", split=None, backend=None, float64=False) -> Layout:
    """Check the label-side arguments against the logits' leading ``shape`` (on ``device``) and build the flat
    ``target`` with the ``layout`` op (one kernel; its value checks as ``set_validation`` says). Labels must lie in
    ``[0, vocab)``: the global vocabulary (``spans``: how the ranks' shards cover it, for the error message).
    ``temperature``: the kernels' float64 temperature when the caller gave a tensor (its values are checked with the
    other values), else None.
    ``backend``: the user's choice (``kltriton.dispatch`` resolves it for the ``layout`` family); ``float64``: the
    logits are float64 (the reference backend's oracle mode: a loss's row weights in float64 too).

    ``split``: this rank's ``collectives.SequenceSplit`` (a sequence group): ``shape`` is this rank's slice of the
    sequence dimension (``[B, T_r]``, or ``[N_r]`` of the packed stream with the global ``cu_seqlens``); the shift
    takes the last position's label and mask from the next rank's slice (one all-gather, every rank calls it), and
    sequences and positions are the global ones. That route is the reference backend's, with host checks."""
    shape = shape if type(shape) is torch.Size else torch.Size(shape)
    if (shift_labels and isinstance(labels, torch.Tensor) and labels.dim() == len(shape) >= 1
            and labels.shape[:-1] == shape[:-1] and labels.shape[-1] == shape[-1] + 1):
        raise ValueError(f"labels {tuple(labels.shape)} are one longer than the logits' positions "
                         f"{tuple(shape)}: pass the unsliced logits with shift_labels=True, or sliced "
                         f"logits with labels[:, 1:] and shift_labels=False")
    _check_same_leading("labels", labels, shape, device, integer=True)
    if mask is not None:
        _check_same_leading("mask", mask, shape, device, boolean=True)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, shape, device, None if split is None else split.total)
    if shift_labels and labels.dim() == 0:
        raise ValueError("shift_labels=True needs labels with a time dimension")
    if len(shape) >= 2:
        num_seqs = shape.numel() // shape[-1] if shape[-1] else shape[:-1].numel()
    else:
        num_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    check = validating()
    context = {"device": device, "vocab": vocab, "ignore_index": ignore_index, "spans": spans, "n": shape.numel(),
               "split": split is not None} if check and (_VALIDATE == "sync" or device.type == "cpu") else None
    if split is None and not isinstance(vocab, torch.Tensor):
        args = (_rows2d(labels), None if mask is None else _rows2d(mask), cu_seqlens, temperature, ignore_index, vocab,
                bool(shift_labels), check, (backend, device.type, float64))
        return Layout(shape, num_seqs, cu_seqlens, split, source=(args, context))
    # The reference's ops: under a split (the shift across ranks), or a vocabulary learned on the device (a vocab
    # shard's global size as a tensor, which the layout kernels do not take).
    following, ends = (None, None), None
    if shift_labels and split is not None:
        following = _from_next_slice(labels, mask, split, ignore_index)
        if cu_seqlens is not None and labels.numel():
            ends = _split_sequence_ends(cu_seqlens, labels.numel(), split)
    target = layout_reference.target(labels, mask, cu_seqlens if split is None else None, temperature, ignore_index,
                                     vocab, bool(shift_labels), flag_vector(device) if check else None, following,
                                     ends)
    _raise_now(context)
    return Layout(shape, num_seqs, cu_seqlens, split, target=target)
