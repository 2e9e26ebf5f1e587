"""The ``truncation`` family's floor (``kltriton.kernels.truncation``) of rows whose vocabulary is sharded over the
ranks of a process group: min-p from the row max (one all-reduce), top-k and top-p by a bisection on the
order-preserving keys of fp32 values, counting (or summing the mass of) the entries above each candidate threshold on
every shard and all-reducing the counts. The same floor on every rank; then ``parallel.shard_truncated`` merges the
statistics above it as the ``statistics`` pass merges its own."""
import torch

from kltriton.kernels.rows import as_rows3d
from kltriton.parallel import all_reduce, all_reduce_max

THRESHOLDS_PER_ROUND = 15  # thresholds per collective round of the floor search: 16-way, 8 rounds for 32 bits
_KEY_FLIP = 0x7FFFFFFF


def _key(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 key of float32 values (``a >= b`` iff ``key(a) >= key(b)`` for non-NaN)."""
    bits = x.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ _KEY_FLIP, bits)


def _from_key(key: torch.Tensor) -> torch.Tensor:
    bits = torch.where(key < 0, key ^ _KEY_FLIP, key).to(torch.int32)
    return bits.view(torch.float32)


def _largest_reaching(weight_of, lower, goal, group):
    """Per row, the largest fp32 value ``v >= lower`` whose summed weight over the ranks of ``{x >= v}`` reaches
    ``goal`` (``weight_of(thresholds [N, G]) -> [N, G]`` float64 local sums over ``x >= threshold``), by a
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
        reached = all_reduce(weight_of(_from_key(keys)), group) >= goal[:, None]
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
    m = all_reduce_max(x.amax(-1) if x.shape[-1] else x.new_full((n,), float("-inf")), group).double()
    top_k, top_p, min_p = knobs
    log_min_p = torch.where(min_p > 0, min_p.clamp(min=1e-300).log(), torch.full_like(min_p, float("-inf")))
    exact = torch.where(min_p > 0, m + t * log_min_p, torch.full_like(m, float("-inf")))
    lower = exact.float()
    lower = torch.where(lower.double() < exact, torch.nextafter(lower, torch.full_like(lower, float("inf"))), lower)

    def counts(thresholds):  # one [N, V_local] compare per threshold
        return torch.stack([(x >= th[:, None]).sum(-1) for th in thresholds.unbind(1)], 1).double()

    def masses(thresholds):
        e = torch.where(x >= lower[:, None], ((x.double() - m[:, None]) / t[:, None]).exp(), torch.zeros_like(x,
                        dtype=torch.float64))
        return torch.stack([torch.where(x >= th[:, None], e, 0).sum(-1) for th in thresholds.unbind(1)], 1)

    if bool((top_k > 0).any()):
        kept = all_reduce(counts(lower[:, None]).squeeze(1), group)
        active = (top_k > 0) & (kept > top_k)
        kth = _largest_reaching(counts, lower, top_k.double(), group)
        lower = torch.where(active, torch.maximum(lower, kth), lower)
    if bool((top_p < 1).any()):
        total = all_reduce(masses(lower[:, None]).squeeze(1), group)
        cut = _largest_reaching(masses, lower, top_p * total, group)
        lower = torch.where(top_p < 1, torch.maximum(lower, cut), lower)
    bad = torch.isnan(m) | (m == float("inf"))
    lower = torch.where(bad, torch.full_like(lower, float("nan")), lower)
    return torch.where(target >= 0, lower, torch.full_like(lower, float("-inf")))
