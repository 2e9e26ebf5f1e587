"""``compare OLD.json NEW.json``: flag kltriton rows that got slower beyond noise.

A row regressed when its median grew by more than ``threshold`` AND the timings no longer
overlap (``new.min > old.max``). Only the fast backends are gated (``triton``, ``cpp``): the
``reference`` backend (the fallback and test oracle, chunked PyTorch with host syncs) and the
baselines are printed but never fail the check: they move with the machine and PyTorch.

Machine drift: on a shared machine the memory bandwidth itself moves between runs (seen here:
the same ``x.amax(-1)`` read 1.5x slower an hour later), and the kernels are bandwidth-bound.
Every row carries the bandwidth measured on its case in the same run (``bw_ref_gbps``), so
unless ``absolute`` is set a gated row's new times are first divided by how much that bandwidth
dropped (if it did): a slower machine does not count, a slower kernel does. The table's ``drift``
is that old / new bandwidth (1.00 for rows that are not corrected).

Unreliable rows: the correction is trusted only while the bandwidth of the case moved by at most
``max_drift`` (2x) either way between the runs. Contention for memory on a shared machine moved
it by 1.5x here; a larger change means a probe ran during a stall (a descheduled VM, swapping:
one probe once read 0.036 GB/s), which does not slow the probe and the rows, timed at other
moments, alike, so dividing by it would turn any slowdown into "faster". Rows that ``run`` flags
(``harness.flag_implausible``, re-derived here so files written before flags existed are checked
too) are not used either. Such a row is reported ``UNRELIABLE`` and, when gated, makes the exit
code ``EXIT_UNRELIABLE``: re-run rather than trust it. Gate on the ``small`` or ``full`` grid:
the ``smoke`` grid's microsecond timings are noise.
"""
import json

from benchmarks.harness import flag_implausible

KEY = ("op", "backend", "mode", "tokens", "vocab", "dtype", "masked_frac")
GATED = ("triton", "cpp")
THRESHOLD = 0.10
MAX_DRIFT = 2.0
EXIT_OK, EXIT_REGRESSION, EXIT_UNRELIABLE = 0, 1, 3  # 2 is argparse's usage error


def _timed(path):
    with open(path) as f:
        rows = json.load(f)
    flag_implausible(rows)
    return {tuple(r[k] for k in KEY): r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None}


def _drift(old_row, new_row) -> float:
    """How much slower the machine moved bytes for this row in ``new`` (old / new bandwidth measured
    on the same case; below 1 when it got faster); 1 when a file has no bandwidth."""
    if old_row.get("bw_ref_gbps") and new_row.get("bw_ref_gbps"):
        return old_row["bw_ref_gbps"] / new_row["bw_ref_gbps"]
    return 1.0


def _unreliable(old, new, drift, max_drift) -> str:
    """Why the pair cannot be judged ("" when it can)."""
    reasons = [f"{which}: {'; '.join(row['flags'])}" for which, row in (("old", old), ("new", new)) if row["flags"]]
    if not 1 / max_drift <= drift <= max_drift:
        lower = f"{drift:.3g}x lower in new" if drift > 1 else f"{1 / drift:.3g}x lower in old"
        reasons.append(f"bandwidth of the case {lower}, beyond {max_drift:g}x: a probe ran during a stall")
    return "; ".join(reasons)


def status(old, new, threshold, drift=1.0) -> str:
    ratio = new["time_ms_median"] / old["time_ms_median"] / drift
    if ratio <= 1 + threshold:
        return "faster" if ratio < 1 / (1 + threshold) else "ok"
    if new["time_ms_min"] / drift <= old["time_ms_max"]:
        return "noise (spreads overlap)"
    if new["kind"] == "kltriton" and new["backend"] in GATED:
        return "REGRESSION"
    return f"slower ({'fallback' if new['kind'] == 'kltriton' else 'baseline'}, not gated)"


def compare(old_path, new_path, threshold=THRESHOLD, absolute=False, max_drift=MAX_DRIFT, out=print) -> int:
    """Print the table; return ``EXIT_REGRESSION`` if a gated row regressed, else ``EXIT_UNRELIABLE``
    if a gated row could not be judged, else ``EXIT_OK``."""
    old, new = _timed(old_path), _timed(new_path)
    common = [k for k in new if k in old]
    out(f"{'op':16s} {'backend':15s} {'mode':8s} {'tokens':>6s} {'vocab':>7s} {'dtype':5s} {'mask':>4s} "
        f"{'old ms':>9s} {'new ms':>9s} {'ratio':>6s} {'drift':>6s}  status")
    regressions = unreliable = 0
    for key in common:
        o, n = old[key], new[key]
        gated = n["kind"] == "kltriton" and n["backend"] in GATED
        drift = 1.0 if absolute or not gated else _drift(o, n)
        why = _unreliable(o, n, drift, max_drift)
        if why:
            verdict = f"UNRELIABLE: {why}" if gated else f"unreliable (not gated): {why}"
            unreliable += gated
        else:
            verdict = status(o, n, threshold, max(1.0, drift))  # a faster machine is not held against the kernel
            regressions += verdict == "REGRESSION"
        out(f"{key[0]:16s} {key[1]:15s} {key[2]:8s} {key[3]:6d} {key[4]:7d} {key[5]:5s} {key[6]:4.2f} "
            f"{o['time_ms_median']:9.3f} {n['time_ms_median']:9.3f} {n['time_ms_median'] / o['time_ms_median']:6.2f} "
            f"{drift:6.2f}  {verdict}")
    out(f"{len(common)} rows compared ({len(old) - len(common)} only in old, {len(new) - len(common)} only in new); "
        f"threshold {threshold:.0%}; {'absolute times' if absolute else 'gated rows corrected for bandwidth drift'}; "
        f"{regressions} regression(s), {unreliable} unreliable gated row(s)")
    if regressions:
        return EXIT_REGRESSION
    return EXIT_UNRELIABLE if unreliable else EXIT_OK
