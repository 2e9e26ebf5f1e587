"""``compare OLD.json NEW.json``: flag kltriton rows that got slower beyond noise.

A row regressed when its median grew by more than ``threshold`` AND the timings no longer
overlap (``new.min > old.max``). Only the fast backends are gated (``triton``, ``cpp``): the
``reference`` backend (the fallback and test oracle, chunked PyTorch with host syncs) and the
baselines are printed but never fail the check: they move with the machine and PyTorch.

Machine drift: on a shared machine the memory bandwidth itself moves between runs (seen here:
the same ``x.amax(-1)`` read 1.5x slower an hour later), and the kernels are bandwidth-bound.
Every row carries the bandwidth measured on its case in the same run (``bw_ref_gbps``), so
unless ``absolute`` is set a gated row's new times are first divided by how much that bandwidth
dropped (if it did): a slower machine does not count, a slower kernel does. Gate on the
``small`` or ``full`` grid: the ``smoke`` grid's microsecond timings are noise.
"""
import json

KEY = ("op", "backend", "mode", "tokens", "vocab", "dtype", "masked_frac")
GATED = ("triton", "cpp")


def _timed(path):
    with open(path) as f:
        rows = json.load(f)
    return {tuple(r[k] for k in KEY): r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None}


def _drift(old_row, new_row) -> float:
    """How much slower the machine moved bytes for this row in ``new``: the drop of the
    bandwidth measured on the same case in each run, never below 1."""
    if old_row.get("bw_ref_gbps") and new_row.get("bw_ref_gbps"):
        return max(1.0, old_row["bw_ref_gbps"] / new_row["bw_ref_gbps"])
    return 1.0


def status(old, new, threshold, drift=1.0) -> str:
    ratio = new["time_ms_median"] / old["time_ms_median"] / drift
    if ratio <= 1 + threshold:
        return "faster" if ratio < 1 / (1 + threshold) else "ok"
    if new["time_ms_min"] / drift <= old["time_ms_max"]:
        return "noise (spreads overlap)"
    if new["kind"] == "kltriton" and new["backend"] in GATED:
        return "REGRESSION"
    return f"slower ({'fallback' if new['kind'] == 'kltriton' else 'baseline'}, not gated)"


def compare(old_path, new_path, threshold=0.10, absolute=False, out=print) -> int:
    """Print the table; return the number of regressions."""
    old, new = _timed(old_path), _timed(new_path)
    common = [k for k in new if k in old]
    out(f"{'op':16s} {'backend':15s} {'mode':8s} {'tokens':>6s} {'vocab':>7s} {'dtype':5s} {'mask':>4s} "
        f"{'old ms':>9s} {'new ms':>9s} {'ratio':>6s} {'drift':>6s}  status")
    regressions = 0
    for key in common:
        o, n = old[key], new[key]
        drift = 1.0 if absolute or n["backend"] not in GATED else _drift(o, n)
        verdict = status(o, n, threshold, drift)
        regressions += verdict == "REGRESSION"
        out(f"{key[0]:16s} {key[1]:15s} {key[2]:8s} {key[3]:6d} {key[4]:7d} {key[5]:5s} {key[6]:4.2f} "
            f"{o['time_ms_median']:9.3f} {n['time_ms_median']:9.3f} {n['time_ms_median'] / o['time_ms_median']:6.2f} "
            f"{drift:6.2f}  {verdict}")
    out(f"{len(common)} rows compared ({len(old) - len(common)} only in old, {len(new) - len(common)} only in new); "
        f"threshold {threshold:.0%}; {'absolute times' if absolute else 'gated rows corrected for bandwidth drift'}; "
        f"{regressions} regression(s)")
    return regressions
