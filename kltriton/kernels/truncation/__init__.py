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

``forward(logits, target, temperature, top_k, top_p, min_p, floor, request) -> (floor, StreamStats)``
    ``floor`` None: each row's floor from the knobs, then (the row still in cache) the ``stream`` statistics (``logp``, ``lse``, ``entropy`` when ``request`` has ``ENTROPY``; ``request`` has no
    other bit) of each row with the logits below ``floor`` read as ``-inf``: the log-prob of the renormalized
    truncated distribution, ``-inf`` where the label is below the floor. ``floor = -inf`` gives the ``stream``
    family's results bit for bit. A given ``floor`` (vocab-parallel: found over the shards) is used as it is.

``backward(logits, target, temperature, floor, lse, basis) -> grad``
    The ``stream`` backward (``basis.p_logq`` is None) of those restricted rows: zero below the floor.

Replay (``Truncation(support=ids)``, ``replay.py``): the kept set is given as ``ids [N, K]`` int64. The row's
values and gradients must not depend on ``K`` (the padding), the order or repetitions of its ids, or the other
rows: its reductions are a maximum and fixed-point sums (``constants.FIXED_POINT_BITS``), associative, and the rest
is per entry, each entry by the same code wherever it sits. The Triton backend runs the reference's code (``O(N K)``
work on gathered values, a few launches).

``replay_support(ids) -> ids``
    ``[N, K]`` engine ids (``-1`` padding) in canonical form: each kept id once, increasing, then ``-1``.
``replay_columns(logits, ids) -> values``
    ``[N, K]`` logits at ``ids`` (``-1``: 0) in the accumulation dtype.
``replay_forward(values, ids, target, temperature, request) -> (logp, lse, entropy, row_max, log_mass, label_column)``
    ``values [N, K]`` (accumulation dtype) at the canonical ``ids`` (global ids). With ``m`` the row's largest kept
    value and ``d = (x - m) / T`` in float64: ``mass = sum trunc(exp(d) 2^bits)`` (int64), ``log_mass =
    log(mass 2^-bits)`` (float64), ``logp = d_label - log_mass`` (``-inf`` where the label is not kept), ``lse =
    m / T + log_mass``, ``entropy = log_mass - sum trunc(exp(d) d 2^bits) / mass`` (``request`` has ``ENTROPY``;
    else empty); ``row_max`` (``m``, 0 on rows that are not live) and ``label_column`` (the label's column, ``-1``)
    for the backward. A scored row that keeps nothing: ``logp = lse = -inf``, entropy 0; every kept logit ``-inf``:
    NaN statistics, ``lse = -inf``; a NaN or ``+inf`` kept: NaN; ``SKIP`` 0, ``OUT_OF_RANGE`` NaN (``lse`` 0).
``replay_backward(values, ids, target, temperature, row_max, log_mass, basis) -> grad [N, K]``
    The ``stream`` backward's element math on the kept entries (``p = exp(d - log_mass)``), 0 at padding and on
    rows that are not live; accumulation dtype.
``replay_scatter(columns, ids, vocab, dtype) -> grad [N, vocab]``
    Zero but ``columns`` at ``ids >= 0`` (distinct per row), rounded to ``dtype`` once (C++: into the reused
    gradient buffer of ``csrc/gradient_buffer.cpp``).
"""
from kltriton.kernels.statistics import Basis, StreamStats

__all__ = ["Basis", "StreamStats"]
