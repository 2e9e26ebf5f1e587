"""``Truncation``: the truncated sampling distribution a rollout engine sampled from, and its checks.

The one place that defines the type and validates it. Two modes:

- recompute (``Truncation(top_k=, top_p=, min_p=)``): the kept set is decided from the logits themselves
  with vLLM v1's semantics and order (temperature, then min-p, then top-k, then top-p);
- replay (``Truncation(support=ids)``): the kept set is the engine's own ``ids [*S, K]`` (``-1`` padding).
"""
import math
from typing import NamedTuple, Optional

import torch

from kltriton._inputs import checked_ids, host_checks


class RowKnobs(NamedTuple):
    """The recompute knobs as the kernels take them, one value per row (``[N]``): ``top_k`` int64 (0: off),
    ``top_p`` float64 (1: off), ``min_p`` float64 (0: off)."""
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor


def _check_number(name, value, integer: bool, low, high, low_open: bool, high_open: bool):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an int" if integer else "a python float"
        raise TypeError(f"{name} must be {kind}, a tensor or None, got {type(value).__name__}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return int(value) if integer else float(value)


def _check_knob_tensor(name, value, integer: bool, low, high, low_open: bool):
    if integer and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if not integer and not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {value.dtype}")
    if value.dim() > 2:
        raise ValueError(f"{name} must have one value per sequence or per position, got shape {tuple(value.shape)}")
    if host_checks() and value.numel():
        v = value.detach()
        bad = ~torch.isfinite(v) if not integer else torch.zeros_like(v, dtype=torch.bool)
        if low is not None:
            bad = bad | ((v <= low) if low_open else (v < low))
        if high is not None:
            bad = bad | (v > high)
        if bool(bad.any()):
            raise ValueError(f"{name} must lie in {'(' if low_open else '['}{low}, {high}] everywhere, found "
                             f"{v[bad].reshape(-1)[0].item()}")
    return value.detach()


class Truncation:
    """The kept set of the distribution a rollout engine sampled from (see the module docstring).

    Args:
        top_k: keep the logits ``>=`` the k-th largest (ties kept); ``None`` or ``<= 0``: off.
        top_p: keep the smallest set of largest probabilities whose mass reaches ``top_p`` (the largest token is
            always kept), in ``(0, 1]``; ``None`` or ``1``: off.
        min_p: keep ``p >= min_p * max p``, in ``[0, 1]``; ``None`` or ``0``: off.
            Each is a python number, or a tensor with one value per sequence (``[num_seqs]``: rows of ``[B, T]``,
            segments of ``cu_seqlens``) or per position (the logits' leading shape ``S``).
        support: replay: ``ids [*S, K]`` integer, the kept token ids of each position, ``-1`` for padding
            (as an engine reports them). Excludes the three knobs.

    The probabilities are those of ``softmax(logits / T)`` with the op's ``temperature`` (vLLM applies the
    temperature first).
    """

    def __init__(self, top_k=None, top_p=None, min_p=None, *, support=None):
        if support is not None:
            if top_k is not None or top_p is not None or min_p is not None:
                raise ValueError("Truncation: support= (replay) excludes top_k, top_p and min_p (recompute)")
            if not isinstance(support, torch.Tensor):
                raise TypeError(f"support must be a torch.Tensor of token ids, got {type(support).__name__}")
            if support.dtype.is_floating_point or support.dtype.is_complex or support.dtype == torch.bool:
                raise TypeError(f"support must be an integer tensor of token ids, got {support.dtype}")
            if support.dim() < 2:
                raise ValueError(f"support must have shape [*S, K], got {tuple(support.shape)}")
        knobs = {}
        for name, value, integer, low, high, low_open in (("top_k", top_k, True, None, None, False),
                                                           ("top_p", top_p, False, 0.0, 1.0, True),
                                                           ("min_p", min_p, False, 0.0, 1.0, False)):
            if value is None:
                knobs[name] = None
            elif isinstance(value, torch.Tensor):
                knobs[name] = _check_knob_tensor(name, value, integer, low, high, low_open)
            else:
                knobs[name] = _check_number(name, value, integer, low, high, low_open, False)
        self.top_k, self.top_p, self.min_p = knobs["top_k"], knobs["top_p"], knobs["min_p"]
        self.support = None if support is None else support.detach()

    @property
    def replay(self) -> bool:
        return self.support is not None

    @property
    def disabled(self) -> bool:
        """Whether every knob is a python number that turns its step off (the plain, untruncated route)."""
        if self.replay:
            return False
        return ((self.top_k is None or (isinstance(self.top_k, int) and self.top_k <= 0))
                and (self.top_p is None or (isinstance(self.top_p, float) and self.top_p >= 1.0))
                and (self.min_p is None or (isinstance(self.min_p, float) and self.min_p <= 0.0)))

    def __repr__(self):
        if self.replay:
            return f"Truncation(support={tuple(self.support.shape)})"
        show = lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return f"Truncation(top_k={show(self.top_k)}, top_p={show(self.top_p)}, min_p={show(self.min_p)})"

    def row_knobs(self, shape, num_seqs: int, seq_index: Optional[torch.Tensor], device, vocab: int) -> RowKnobs:
        """The knobs as ``[N]`` tensors of the rows of leading shape ``shape`` (``seq_index``: ``[N]`` sequence of
        each position, needed for per-sequence tensors)."""
        n = math.prod(shape)

        def expand(name, value, off, dtype):
            if value is None:
                return torch.full((n,), off, dtype=dtype, device=device)
            if not isinstance(value, torch.Tensor):
                return torch.full((n,), value, dtype=dtype, device=device)
            if value.device != torch.device(device):
                raise ValueError(f"{name} is on {value.device} but logits are on {device}")
            if tuple(value.shape) == tuple(shape):
                return value.reshape(-1).to(dtype)
            if value.dim() == 1 and value.shape[0] == num_seqs and seq_index is not None:
                return value.to(dtype)[seq_index]
            raise ValueError(f"{name} must be a number, or a tensor of shape [num_seqs] = [{num_seqs}] (one per "
                             f"sequence) or {tuple(shape)} (one per position), got {tuple(value.shape)}")

        top_k = expand("top_k", self.top_k, 0, torch.int64)
        top_k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.zeros_like(top_k))
        top_p = expand("top_p", self.top_p, 1.0, torch.float64).clamp(max=1.0)
        min_p = expand("min_p", self.min_p, 0.0, torch.float64).clamp(min=0.0)
        return RowKnobs(top_k.contiguous(), top_p.contiguous(), min_p.contiguous())

    def support_rows(self, shape, device, vocab):
        """``(ids, bad_rows)``: ``support`` as ``[N, K]`` int64 ids (``-1`` padding), checked against the logits'
        leading shape and the vocabulary ``[0, vocab)`` (``_inputs.checked_ids``: on a device without a host read,
        ``bad_rows`` the rows the caller scores as NaN)."""
        ids = self.support
        if tuple(ids.shape[:-1]) != tuple(shape):
            raise ValueError(f"support must have shape [*S, K] with S = {tuple(shape)} (the logits' leading shape), "
                             f"got {tuple(ids.shape)}")
        if ids.device != torch.device(device):
            raise ValueError(f"support is on {ids.device} but logits are on {device}")
        if ids.shape[-1] == 0:
            raise ValueError("support must hold at least one id per position (K >= 1)")
        ids, bad_rows = checked_ids(ids.reshape(-1, ids.shape[-1]).long(), vocab, "support")
        return ids.contiguous(), bad_rows


def check_truncation(truncation) -> Optional[Truncation]:
    """``truncation`` if it is a ``Truncation`` that changes anything, ``None`` for ``None`` or a disabled one."""
    if truncation is None:
        return None
    if not isinstance(truncation, Truncation):
        raise TypeError(f"truncation must be a kltriton.Truncation or None, got {type(truncation).__name__}")
    return None if truncation.disabled else truncation
