"""Family ``invariant``: the ``stream`` family's log-prob, log-sum-exp and entropy with sums that do not depend on
how the vocabulary is cut (``kltriton.set_invariant``).

The ``stream`` family merges per-piece ``(max, sum)`` pairs in floating point (``kltriton.kernels.statistics``), so
its bits depend on where kernel blocks, ``LinearLogits`` tiles and vocab shards cut a row. Here a row's reductions
are a maximum and integer sums, both associative:

1. ``m``, the row's largest logit (of the entries read: ``>= floor``): exact, merged over pieces by a maximum;
2. with ``z = (x - m) / T <= 0`` and ``e = exp(z)`` in ``[0, 1]``: ``mass = sum trunc(e 2^F)`` and, for the entropy,
   ``weighted = sum trunc(e (-z) 2^F)`` (``e (-z)`` in ``[0, 1/e]``), int64 in units of ``2^-F``
   (``F = constants.FIXED_POINT_BITS``; up to ``2^(63 - F)`` entries), merged over pieces by integer addition;
3. ``finalize`` (shared by every backend, float64 on ``[N]``): ``log S = log(mass 2^-F)``, ``lse = m / T + log S``,
   ``logp = (x_label - m) / T - log S``, ``entropy = log S + weighted / mass``.

Each entry's ``e`` is computed by the same code wherever it sits in a row (a vector lane, a padded tail, a block of
another size), so every bit of a row's statistics depends on its own logits only. Every backend computes its own
``e`` (their bits differ from one another's); the truncation of each term costs at most ``V 2^-F`` of ``S >= 1``
(relative ``3e-8`` for ``V = 32000``).

Backends: ``reference.py`` (PyTorch, any float dtype incl. float64), ``cpp.py`` (CPU: ``csrc/invariant.h``),
``triton.py`` (CUDA, or CPU under ``TRITON_INTERPRET=1``). Each provides, for ``logits [..., V]`` addressed as the
``stream`` family's (any strides on the leading dims), ``target [N]`` (rows with ``target >= 0`` are read; the label
itself is not: the caller gathers it) and ``floor`` (None, or ``[N]`` float32: entries below it are read as ``-inf``,
the ``truncation`` family's kept set):

``maxima(logits, target, floor) -> [N]``
    Each read row's largest entry in ``accumulation_dtype(logits.dtype)``; ``+inf`` where a NaN or ``+inf`` is read
    (a bad row: it merges as the maximum), ``-inf`` where every entry is ``-inf`` or the row is not read.
``sums(logits, target, temperature, row_max, floor, request) -> [1 or 2, N] int64``
    ``mass`` (and ``weighted`` when ``request`` has ``ENTROPY``) of each read row given its (global) ``row_max``; 0 on
    rows not read or whose ``row_max`` is not finite.
``forward(logits, target, temperature, floor, request) -> (row_max, sums)``
    Both on rows of a whole vocabulary (the C++ backend reads each row from memory once for both).
"""
import math
import torch

from kltriton.kernels import SKIP, constants
from kltriton.kernels.statistics import StreamStats, empty_stats

FIXED_UNIT = float(2 ** constants.FIXED_POINT_BITS)


def sum_count(request: int) -> int:
    """Rows of ``sums``' output: ``mass``, and ``weighted`` with the entropy."""
    return 2 if request & constants.ENTROPY else 1


def pack(sums: torch.Tensor, held: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``[k + 2, N]`` int64: the sums, whether this piece holds the row's label, and the label's logit (float64
    bits, 0 where not held). Summed over pieces it gives the rows' sums, the number of pieces that hold the label
    and the label's logit bit for bit (the other pieces add 0): one integer all-reduce for all of them."""
    bits = torch.where(held, label.double(), torch.zeros((), dtype=torch.float64, device=label.device))
    return torch.cat([sums, held.long()[None], bits.view(torch.int64)[None]])


def unpack(packed: torch.Tensor):
    """``(sums, held [N] bool, label [N] float64)`` of ``pack``'s (summed) output."""
    return packed[:-2], packed[-2] > 0, packed[-1].contiguous().view(torch.float64)


def finalize(row_max: torch.Tensor, sums: torch.Tensor, label: torch.Tensor, held: torch.Tensor,
             target: torch.Tensor, temperature: torch.Tensor, request: int, dtype: torch.dtype) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``request`` asks; the others empty) in ``dtype`` from a
    row's ``row_max`` and ``sums`` (whole rows) and its label's logit ``label`` (float64, ``-inf`` below the floor;
    read where ``held``).

    ``SKIP`` rows: 0; ``OUT_OF_RANGE`` rows: NaN (``lse`` 0); a scored row whose label no piece holds: NaN but its
    ``lse``; a bad row (``row_max = +inf``): NaN; a row whose entries are all ``-inf``: ``lse = -inf``, NaN
    statistics."""
    t = temperature.double()
    m = row_max.double()
    scored = target >= 0
    live = scored & torch.isfinite(m)
    zero = torch.zeros((), dtype=torch.float64, device=m.device)
    nan, ninf = torch.full_like(zero, math.nan), torch.full_like(zero, -math.inf)
    mass = sums[0].double()
    log_mass = torch.where(live, (mass / FIXED_UNIT).log(), zero)
    frame = torch.where(live, m, zero) / t
    lse = torch.where(live, frame + log_mass, torch.where(m == -math.inf, ninf, nan))
    lse = torch.where(scored, lse, zero)
    logp = (label - torch.where(live, m, zero)) / t - log_mass
    statistic_ok = live & held
    out = {"logp": torch.where(statistic_ok, logp.clamp(max=0), nan),
           "lse": lse}
    if request & constants.ENTROPY:
        entropy = log_mass + sums[1].double() / torch.where(live, mass, torch.ones_like(mass))
        out["entropy"] = torch.where(statistic_ok, entropy, nan)
    for name in ("logp", "entropy"):
        if name in out:
            out[name] = torch.where(target == SKIP, zero, out[name])
    stats = empty_stats(0, 0, lambda size: torch.empty(size, dtype=dtype, device=m.device))
    return stats._replace(**{name: value.to(dtype) for name, value in out.items()})
