"""``compare OLD.json NEW.json``: flag kltriton rows that got slower beyond noise.

A row regressed when its median grew by more than ``threshold`` AND the timings no longer
overlap (``new.min > old.max``). Baseline rows are printed but never fail the check: they
move with the machine and PyTorch, not with this package.
"""
import json

KEY = ("op", "backend", "mode", "tokens", "vocab", "dtype", "masked_frac")


def _timed(path):
    with open(path) as f:
        rows = json.load(f)
    return {tuple(r[k] for k in KEY): r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None}


def status(old, new, threshold) -> str:
    ratio = new["time_ms_median"] / old["time_ms_median"]
    if ratio <= 1 + threshold:
        return "faster" if ratio < 1 / (1 + threshold) else "ok"
    if new["time_ms_min"] <= old["time_ms_max"]:
        return "noise (spreads overlap)"
    return "REGRESSION" if new["kind"] == "kltriton" else "slower (baseline, not gated)"


def compare(old_path, new_path, threshold=0.10, out=print) -> int:
    """Print the table; return the number of regressions."""
    old, new = _timed(old_path), _timed(new_path)
    common = [k for k in new if k in old]
    out(f"{'op':16s} {'backend':15s} {'mode':8s} {'tokens':>6s} {'vocab':>7s} {'dtype':5s} {'mask':>4s} "
        f"{'old ms':>9s} {'new ms':>9s} {'ratio':>6s}  status")
    regressions = 0
    for key in common:
        o, n = old[key], new[key]
        verdict = status(o, n, threshold)
        regressions += verdict == "REGRESSION"
        out(f"{key[0]:16s} {key[1]:15s} {key[2]:8s} {key[3]:6d} {key[4]:7d} {key[5]:5s} {key[6]:4.2f} "
            f"{o['time_ms_median']:9.3f} {n['time_ms_median']:9.3f} {n['time_ms_median'] / o['time_ms_median']:6.2f}  "
            f"{verdict}")
    out(f"{len(common)} rows compared ({len(old) - len(common)} only in old, {len(new) - len(common)} only in new); "
        f"threshold {threshold:.0%}; {regressions} regression(s)")
    return regressions
