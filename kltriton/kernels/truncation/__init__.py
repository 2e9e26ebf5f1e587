"""Family ``truncation``: statistics of the truncated sampling distribution (top-k / top-p / min-p) of each row.

A threshold found over the whole row (the k-th largest logit, the top-p cut) does not merge from vocab pieces
(``kltriton.kernels.statistics``), so this is a family of its own with its own passes. Per row it finds a
**floor**: the kept set is ``{v : x_v >= floor}`` (every step of vLLM v1 keeps an upper set of the row, so
their composition does too); the statistics are then those of the row restricted to the kept set, which do
merge over pieces once the floor is known (vocab-parallel: ``kltriton.parallel``).

Backends: ``reference.py`` (PyTorch, any float dtype; sorts the row: the oracle), ``cpp.py`` (CPU) and
``triton.py`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), which find the floor by selection without
sorting the row. Each provides:

The floor of a row (returned by ``forward``, ``[N]`` float32):
    logits, target, temperature: as the ``stream`` family (``kltriton.kernels.stream``).
    top_k: ``[N]`` int64, ``0`` off (else ``1 <= k < V``); top_p: ``[N]`` float64 in ``(0, 1]``, ``1`` off;
    min_p: ``[N]`` float64 in ``[0, 1]``, ``0`` off. With ``z = x / T`` and ``p = softmax(z)``, in vLLM v1's
    order: min-p keeps ``p_v >= min_p * max p``; top-k then keeps the values ``>=`` the k-th largest of
    those kept (ties kept; fewer than k kept: all); top-p then keeps, of those kept, each ``v`` whose kept
    probability mass strictly above ``x_v`` is ``< top_p`` times the kept mass (the largest value always;
    a tie at the cut is kept whole). Returns the smallest kept value, as fp32 in the logits' units (min-p
    alone: the smallest fp32 ``>=`` its exact threshold), ``-inf`` where nothing is cut or the row is not
    read (``target < 0``), NaN where the row has a NaN or ``+inf`` logit.

``forward(logits, target, temperature, top_k, top_p, min_p, floor, wanted) -> (floor, StreamStats)``
    ``floor`` None: each row's floor from the knobs, then (the row still in cache) the ``stream`` statistics (``logp``, ``lse``, ``entropy`` when ``wanted`` has ``ENTROPY``; ``wanted`` has no
    other bit) of each row with the logits below ``floor`` read as ``-inf``: the log-prob of the renormalized
    truncated distribution, ``-inf`` where the label is below the floor. ``floor = -inf`` gives the ``stream``
    family's results bit for bit. A given ``floor`` (vocab-parallel: found over the shards) is used as it is.

``backward(logits, target, temperature, floor, lse, basis) -> grad``
    The ``stream`` backward (``basis.p_logq`` is None) of those restricted rows: zero below the floor.
"""
from kltriton.kernels.statistics import Basis, StreamStats

__all__ = ["Basis", "StreamStats"]
