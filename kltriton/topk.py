"""``TopK``: a sparse teacher, its log-probs at ``K`` ids per position, as rollout engines return them.

Accepted by ``kltriton.token_divergence`` as the teacher (``kltriton.route.columns`` gathers the student's
log-probs at the same ids).
"""
import torch

from kltriton._values import check_float


class TopK:
    """A teacher known at ``K`` ids per position: ``ids [*S, K]`` (int64 or int32, ``-1`` for padding) and its
    log-probs there, ``logprobs [*S, K]`` (floating; ``-inf`` allowed: no mass), e.g. vLLM's ``top_logprobs``.

    Args:
        ids: ``[*S, K]`` integer ids in ``[0, V)`` (global ids under vocab parallelism), ``-1`` = padding. A
            repeated id counts once, at its first occurrence (later ones are read as padding), the rule of
            ``Truncation(support=ids)``.
        logprobs: ``[*S, K]`` the teacher's log-probs of those ids (already at the teacher's own temperature: the
            ``temperature`` of ``token_divergence`` applies to the student only). Ignored at padding.
        min_logprob: optional float: log-probs of both sides below it are raised to it before the divergence (verl's
            ``log_prob_min_clamp``); the student gets no gradient where its log-prob is below it.

    No gradient reaches the teacher (``logprobs`` are read detached).
    """

    def __init__(self, ids, logprobs, *, min_logprob=None):
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"TopK ids must be an int64 or int32 tensor [*S, K], got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        if not isinstance(logprobs, torch.Tensor) or not logprobs.dtype.is_floating_point:
            raise TypeError("TopK logprobs must be a floating tensor [*S, K]")
        if ids.dim() < 1 or tuple(ids.shape) != tuple(logprobs.shape):
            raise ValueError(f"TopK ids and logprobs must have the same shape [*S, K], got {tuple(ids.shape)} and "
                             f"{tuple(logprobs.shape)}")
        if ids.shape[-1] == 0:
            raise ValueError("TopK needs K >= 1 ids per position")
        if ids.device != logprobs.device:
            raise ValueError(f"TopK ids are on {ids.device} but logprobs on {logprobs.device}")
        self.ids, self.logprobs = ids.masked_fill(repeats(ids), -1), logprobs
        self.min_logprob = check_float("min_logprob", min_logprob, allow_none=True)

    @property
    def shape(self) -> torch.Size:
        """``[*S, K]``."""
        return self.ids.shape

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def __repr__(self):
        return f"TopK(ids={tuple(self.ids.shape)}, min_logprob={self.min_logprob})"


def repeats(ids: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` bool: True where an id (``>= 0``) already occurs earlier in its row. One stable sort, no host
    sync."""
    key, order = ids.sort(dim=-1, stable=True)
    later = torch.zeros_like(key, dtype=torch.bool)
    later[..., 1:] = (key[..., 1:] == key[..., :-1]) & (key[..., 1:] >= 0)
    return torch.zeros_like(later).scatter_(-1, order, later)
