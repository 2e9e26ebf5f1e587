"""The ``truncation`` family's floor (``kltriton.kernels.truncation``) of rows whose vocabulary is sharded over the
ranks of a process group: min-p from the row max (one all-reduce), top-k and top-p by a bisection on the
order-preserving keys of fp32 values, counting (or summing the mass of) the entries above each candidate threshold on
every shard and all-reducing the counts. The same floor on every rank; then ``parallel.shard_truncated`` merges the
statistics above it as the ``statistics`` pass merges its own.

In the invariant mode (``kltriton.invariant``) the masses are int64 fixed-point (``fixed_masses``: each entry's
``exp`` truncated to units of ``2^-FIXED_POINT_BITS``), so their sums over shards are exact, and whole rows take
``local_floor``: the same floor found by selection (``topk``), bit for bit, so that one rank and any number of
shards agree.
"""
import torch

from kltriton.kernels import constants
from kltriton.kernels.row_views import as_rows3d
from kltriton.collectives import all_reduce, all_reduce_max

THRESHOLDS_PER_ROUND = 15  # thresholds per collective round of the floor search: 16-way, 8 rounds for 32 bits
_KEY_FLIP = 0x7FFFFFFF
_FIXED_UNIT = float(2 ** constants.FIXED_POINT_BITS)
_FIRST_CANDIDATES = 256  # local_floor's top-p: candidates of the first selection (times 8 until the cut is found)


def _key(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 key of float32 values (``a >= b`` iff ``key(a) >= key(b)`` for non-NaN)."""
    bits = x.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ _KEY_FLIP, bits)


def _from_key(key: torch.Tensor) -> torch.Tensor:
    bits = torch.where(key < 0, key ^ _KEY_FLIP, key).to(torch.int32)
    return bits.view(torch.float32)


def _reaches(weight: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """``weight >= goal`` in float64 (int64 fixed-point weights are rounded the same way everywhere)."""
    return weight.double() >= goal


def _largest_reaching(weight_of, lower, goal, group):
    """Per row, the largest fp32 value ``v >= lower`` whose summed weight over the ranks of ``{x >= v}`` reaches
    ``goal`` (``weight_of(thresholds [N, G]) -> [N, G]`` local sums over ``x >= threshold``: float64, or int64
    fixed-point), by a ``G + 1``-way bisection on the order-preserving keys: one all-reduce of ``[N, G]`` values per
    round, 8 rounds for the 32 bits, exact (the answer is the key where the step function crosses ``goal``)."""
    lo = _key(lower)                                          # weight(lo) >= goal
    hi = torch.full_like(lo, _KEY_FLIP + 1)                   # above +inf: weight 0 < goal
    steps = torch.arange(1, THRESHOLDS_PER_ROUND + 1, device=lo.device)
    while True:
        width = hi - lo
        if not bool((width > 1).any()):  # the rounds are the same on every rank: the data decides when all stop
            return _from_key(lo)
        keys = lo[:, None] + (width[:, None] * steps) // (THRESHOLDS_PER_ROUND + 1)
        keys = torch.maximum(keys, lo[:, None] + 1).clamp(max=_KEY_FLIP)
        reached = _reaches(all_reduce(weight_of(_from_key(keys)), group), goal[:, None])
        reached &= keys < hi[:, None]
        best = torch.where(reached, keys, lo[:, None]).amax(1)
        above = torch.where(~reached & (keys > best[:, None]), keys, hi[:, None]).amin(1)
        lo, hi = best, torch.minimum(above, hi)


def fixed_masses(x: torch.Tensor, m: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` int64 ``trunc(exp((x - m) / T) 2^F)`` of fp32 entries ``x`` under the float64 row max ``m`` and
    temperature ``t`` (``[N]`` each): PyTorch's float64 ``exp``, the same bits for an entry wherever it sits."""
    return (((x.double() - m[:, None]) / t[:, None]).exp() * _FIXED_UNIT).long()


def _rows(logits, temperature):
    """``(x [N, V] fp32, t [N] float64)`` of the rows."""
    x = as_rows3d(logits.detach()).reshape(-1, logits.shape[-1]).float()
    n = x.shape[0]
    return x, (temperature.reshape(1).expand(n) if temperature.dim() == 0 else temperature).double()


def _min_p_lower(m, t, min_p):
    """The smallest fp32 value ``>= m + T log(min_p)`` (``-inf`` where min-p is off)."""
    log_min_p = torch.where(min_p > 0, min_p.clamp(min=1e-300).log(), torch.full_like(min_p, float("-inf")))
    exact = torch.where(min_p > 0, m + t * log_min_p, torch.full_like(m, float("-inf")))
    lower = exact.float()
    return torch.where(lower.double() < exact, torch.nextafter(lower, torch.full_like(lower, float("inf"))), lower)


def _settled(lower, m, target):
    """NaN where the row has a NaN or ``+inf`` logit, ``-inf`` on rows not scored."""
    bad = torch.isnan(m) | (m == float("inf"))
    lower = torch.where(bad, torch.full_like(lower, float("nan")), lower)
    return torch.where(target >= 0, lower, torch.full_like(lower, float("-inf")))


def shard_floor(logits: torch.Tensor, target, temperature, knobs, group, fixed_point: bool = False) -> torch.Tensor:
    """The ``truncation`` family's floor (``kltriton.kernels.truncation``) of the full rows from this rank's shard
    ``logits [..., V_local]``: the row max by one all-reduce, min-p from it, top-k and top-p by
    ``_largest_reaching`` (counts, then masses above candidate thresholds, summed over the ranks). The same on
    every rank; the local work is PyTorch on the shard (``[N, G]`` compares per round). ``fixed_point``: the masses
    are ``fixed_masses`` (the invariant mode), summed exactly."""
    x, t = _rows(logits, temperature)
    n = x.shape[0]
    m = all_reduce_max(x.amax(-1) if x.shape[-1] else x.new_full((n,), float("-inf")), group).double()
    top_k, top_p, min_p = knobs
    lower = _min_p_lower(m, t, min_p)

    def counts(thresholds):  # one [N, V_local] compare per threshold
        return torch.stack([(x >= th[:, None]).sum(-1) for th in thresholds.unbind(1)], 1).double()

    def masses(thresholds):
        kept = x >= lower[:, None]
        if fixed_point:
            e = torch.where(kept, fixed_masses(x, m, t), 0)
        else:
            e = torch.where(kept, ((x.double() - m[:, None]) / t[:, None]).exp(), torch.zeros_like(x, dtype=torch.float64))
        return torch.stack([torch.where(x >= th[:, None], e, 0).sum(-1) for th in thresholds.unbind(1)], 1)

    if bool((top_k > 0).any()):
        kept = all_reduce(counts(lower[:, None]).squeeze(1), group)
        active = (top_k > 0) & (kept > top_k)
        kth = _largest_reaching(counts, lower, top_k.double(), group)
        lower = torch.where(active, torch.maximum(lower, kth), lower)
    if bool((top_p < 1).any()):
        total = all_reduce(masses(lower[:, None]).squeeze(1), group)
        cut = _largest_reaching(masses, lower, top_p * total.double(), group)
        lower = torch.where(top_p < 1, torch.maximum(lower, cut), lower)
    return _settled(lower, m, target)


def local_floor(logits: torch.Tensor, target, temperature, knobs) -> torch.Tensor:
    """``shard_floor(..., fixed_point=True)`` of whole rows, bit for bit, by selection: the ``k``-th largest value by
    ``topk``; the top-p cut (the largest value ``v`` whose fixed-point mass of ``{x >= v}`` reaches the goal) from
    the running mass of the largest values in descending order, ``256 * 8^i`` of them until every row's cut is
    among them (ties in any order give the same value: the first position where the running mass reaches the goal
    holds it)."""
    x, t = _rows(logits, temperature)
    n, vocab = x.shape
    m = x.amax(-1).double() if vocab else x.new_full((n,), float("-inf")).double()
    top_k, top_p, min_p = knobs
    lower = _min_p_lower(m, t, min_p)
    scored = target >= 0
    ninf = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    if bool(((top_k > 0) & scored).any()):
        active = (top_k > 0) & ((x >= lower[:, None]).sum(-1) > top_k)
        k_max = int(torch.where(active, top_k, 0).max())
        if k_max:
            values = x.topk(k_max, dim=-1).values
            kth = values.gather(1, (top_k.clamp(min=1, max=k_max) - 1)[:, None]).squeeze(1)
            lower = torch.where(active, torch.maximum(lower, kth), lower)
    rows = torch.nonzero((top_p < 1) & scored).squeeze(1)
    if rows.numel():
        xr, mr, tr, low = x[rows], m[rows], t[rows], lower[rows]
        kept = xr >= low[:, None]
        e = torch.where(kept, fixed_masses(xr, mr, tr), 0)
        goal = top_p[rows] * e.sum(-1).double()
        candidates = min(vocab, _FIRST_CANDIDATES)
        while True:
            values, where = torch.where(kept, xr, ninf).topk(candidates, dim=-1)
            reached = _reaches(e.gather(1, where).cumsum(-1), goal[:, None])
            if candidates == vocab or bool(reached[:, -1].all()):
                break
            candidates = min(vocab, candidates * 8)
        cut = values.gather(1, reached.to(torch.int8).argmax(-1, keepdim=True)).squeeze(1)
        lower[rows] = torch.maximum(low, cut)
    return _settled(lower, m, target)
