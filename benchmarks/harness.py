"""Shared benchmark harness: grids, inputs, timers, peak memory, bandwidth and result rows.

An op script (``bench_<op>.py``) provides ``OP``, ``N_MODELS`` (logits tensors read per token:
1 for the policy only, 2 with the reference) and ``methods(device)``, a dict
``name -> (kind, factory)``. ``factory(inputs)`` returns ``fn(x) -> Tensor [B, T]`` where ``x``
is the policy logits (a leaf that requires grad in the backward modes), or raises
``Unavailable(note)``. ``run_op`` times every method in three modes on every case.

Nothing here touches CUDA until ``run_op`` is called with ``device="cuda"``.
"""
import datetime
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from kltriton.timing import time_ms

MODES = ("forward", "backward", "fwd_bwd")
SEQ_LEN = 512  # positions per sequence; tokens = batch * seq_len
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REPO = Path(__file__).resolve().parent.parent


class Unavailable(Exception):
    """A method that cannot run here (missing library, wrong device); the message is the note."""


@dataclass(frozen=True)
class Case:
    tokens: int
    vocab: int
    dtype: str          # key of DTYPES
    masked_frac: float  # fraction of positions not scored (a prompt-like prefix of each sequence)

    @property
    def batch(self) -> int:
        return max(1, self.tokens // SEQ_LEN)

    @property
    def seq_len(self) -> int:
        return min(self.tokens, SEQ_LEN)


@dataclass(frozen=True)
class Grid:
    cases: tuple
    skip: tuple = ()           # method names not run on this grid
    cpu_target_s: float = 0.3  # CPU: repeat until about this much time is spent (3..20 repeats)
    cpu_rounds: int = 3        # CPU: time every row this many times, round-robin over the case's rows
    only: tuple = ()           # if given, the only method names run (``run --methods``)
    memory: bool = True        # CPU: the peak memory of every timed row, from a fresh process per case


def _full_grid():
    cases = []
    for vocab in (32000, 128256, 151936, 262144):
        for dtype in ("fp32", "bf16"):
            cases += [Case(tokens, vocab, dtype, 0.0) for tokens in (1024, 4096, 16384)]
            cases += [Case(4096, vocab, dtype, frac) for frac in (0.5, 0.75)]
    return tuple(cases)


GRIDS = {
    # One tiny shape, seconds: for CI. torch.compile is skipped (it compiles for ~20 s on CPU).
    "smoke": Grid((Case(64, 1000, "fp32", 0.5),), skip=("compile",), cpu_target_s=0.02),
    # CPU: a few minutes on 2 idle cores (the reference backend is the slow part).
    "small": Grid((
        Case(256, 32000, "fp32", 0.0),
        Case(512, 32000, "fp32", 0.0),
        Case(512, 32000, "fp32", 0.75),
        Case(256, 32000, "bf16", 0.0),
        Case(256, 151936, "fp32", 0.0),
    ), cpu_target_s=0.2),
    # GPU: vocabularies of Llama-2, Llama-3, Qwen-2 and Gemma-3; 1k..16k tokens; packed masks.
    "full": Grid(_full_grid()),
    # GPU, a few minutes (``python -m benchmarks gpu``): the headline target (bf16 8192 x 151936), small N = 256
    # (per-call overhead) and a small vocab. torch.compile and the float64 reference are left out: on the first H100
    # run (2026-11-27) compiling them kept every op's first case past its step's time limit.
    # GPU: the small-N and the large-N ends at Llama-2's and Qwen-2's vocabularies (the host floor shows at N 256).
    "gpu": Grid((
        Case(8192, 151936, "bf16", 0.0),
        Case(256, 151936, "bf16", 0.0),
        Case(8192, 32000, "bf16", 0.0),
        Case(256, 32000, "bf16", 0.0),
    ), skip=("compile", "reference")),
}


class Inputs(NamedTuple):
    logits: torch.Tensor  # [B, T, V] policy logits
    ref: torch.Tensor     # [B, T, V] reference logits
    labels: torch.Tensor  # [B, T] int64, every label in range
    mask: torch.Tensor    # [B, T] bool, False on the first masked_frac * T positions of each row
    scores: torch.Tensor  # [B] fp32 sequence scores
    grad_out: torch.Tensor  # [B, T] fp32 upstream gradient for the backward modes


def make_inputs(case: Case, device: str, n_models: int, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t, v, dtype = case.batch, case.seq_len, case.vocab, DTYPES[case.dtype]
    logits = torch.randn(b, t, v, generator=gen, device=device, dtype=dtype)
    ref = torch.randn(b, t, v, generator=gen, device=device, dtype=dtype) if n_models == 2 else logits
    labels = torch.randint(0, v, (b, t), generator=gen, device=device)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    mask[:, : round(case.masked_frac * t)] = False
    scores = torch.randn(b, generator=gen, device=device)
    grad_out = torch.randn(b, t, generator=gen, device=device)
    return Inputs(logits, ref, labels, mask, scores, grad_out)


def bytes_moved(case: Case, n_models: int, mode: str) -> int:
    """The least traffic the op needs: each model's scored rows read once in the forward; the
    policy's scored rows read and the whole ``[N, V]`` gradient written in the backward; plus
    ``O(N)`` label / mask / output bytes (13 per position)."""
    elt = DTYPES[case.dtype].itemsize
    scored = case.batch * (case.seq_len - round(case.masked_frac * case.seq_len))
    rows = case.tokens * case.vocab * elt
    per_row = scored * case.vocab * elt
    small = case.tokens * 13
    forward = n_models * per_row + small
    backward = per_row + rows + small
    return {"forward": forward, "backward": backward, "fwd_bwd": forward + rows + small}[mode]


# --- timing (kltriton.timing.time_ms) ---------------------------------------------------------------

def _mode_fn(fn, inputs: Inputs, mode: str):
    """The timed callable for ``mode`` (its setup, e.g. building the graph for ``backward``, runs here)."""
    x = inputs.logits
    if mode == "forward":
        def forward():
            with torch.no_grad():
                return fn(x)
        return forward
    x.requires_grad_(True)
    # A loss (0-dim output) gets the implicit unit upstream gradient of ``loss.backward()``.
    upstream = lambda out: inputs.grad_out if out.dim() else None  # noqa: E731
    if mode == "backward":
        out = fn(x)
        return lambda: torch.autograd.grad(out, x, upstream(out), retain_graph=True)
    def fwd_bwd():
        out = fn(x)
        return torch.autograd.grad(out, x, upstream(out))
    return fwd_bwd


# --- peak memory --------------------------------------------------------------------------------

CPU_MEM_METHOD = ("cpu: fresh python process per case (MALLOC_MMAP_THRESHOLD_=131072: blocks >= 128 KiB "
                  "are mmapped and leave RSS when freed; KLTRITON_CPU_GRAD_CACHE=0: the C++ backend keeps "
                  "no freed gradient, which would hide the gradient's own pages); per row: one warm-up call, "
                  "VmHWM reset through /proc/self/clear_refs, peak = VmHWM after one call - VmRSS before it")
# The environment of the CPU memory probes (see CPU_MEM_METHOD).
CPU_MEM_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "KLTRITON_CPU_GRAD_CACHE": "0"}
CUDA_MEM_METHOD = "cuda: max_memory_allocated during one call - memory_allocated before it (inputs, graph)"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_above(call) -> int:
    """Peak resident bytes of a second ``call()`` above the process's size before it (the first one warms up;
    Linux: the high-water mark reset through ``/proc/self/clear_refs``)."""
    call()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    result = call()
    peak = _status_kib("VmHWM")
    del result
    return (peak - before) * 1024


def memory_child(op_module: str, case: Case, names: list) -> dict:
    """Runs in the fresh process: ``"name/mode" -> peak bytes above the inputs`` (None if it failed)."""
    import kltriton

    kltriton.set_validation(False)
    op = importlib.import_module(op_module)
    inputs = make_inputs(case, "cpu", op.N_MODELS)
    peaks = {}
    for name in names:
        for mode in MODES:
            inputs.logits.requires_grad_(False)
            try:
                call = _mode_fn(op.methods("cpu")[name][1](inputs), inputs, mode)
                peaks[f"{name}/{mode}"] = peak_rss_above(call)
            except Exception:  # noqa: BLE001 - reported as a missing number, the timing row has the note
                peaks[f"{name}/{mode}"] = None
            call = None
            gc.collect()
    return peaks


def cpu_peaks(op_module: str, case: Case, names: list) -> dict:
    """``memory_child`` in a fresh interpreter; an empty dict if the child failed (e.g. out of memory)."""
    env = dict(os.environ, **CPU_MEM_ENV,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    code = ("import json, sys; from benchmarks.harness import Case, memory_child; "
            "a = json.loads(sys.argv[1]); print(json.dumps(memory_child(a[0], Case(**a[1]), a[2])))")
    args = json.dumps([op_module, asdict(case), names])
    out = subprocess.run([sys.executable, "-c", code, args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {}
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_in_child(module: str, args: list, **extra_env):
    """Peak bytes of ``benchmarks.<module>.peak_child(args)`` (its call's peak above its inputs) run in a fresh
    interpreter with ``CPU_MEM_ENV``; None if the child failed."""
    env = dict(os.environ, **CPU_MEM_ENV, **extra_env,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    code = f"import json, sys; from benchmarks.{module} import peak_child; print(peak_child(json.loads(sys.argv[1])))"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


def lm_head_arguments(parser):
    """The ``--tokens / --hidden / --vocab / --dtype / --rounds / --out`` of the LM-head benchmarks
    (``LinearLogits``)."""
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows to this JSON file")
    return parser


def save_rows(rows, path) -> None:
    """Write ``rows`` to the JSON file ``path`` (``--out``); nothing when ``path`` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def missing_note(library: str, *names: str):
    """None when every ``"module:attribute"`` of ``names`` imports, else the row note ``"<library> not installed:
    ..."`` (a baseline that cannot run here)."""
    for name in names:
        module, attribute = name.split(":")
        try:
            getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            return f"{library} not installed: {err}"
    return None


def cuda_peak(call) -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


# --- bandwidth ----------------------------------------------------------------------------------

def _bandwidth_probes(logits: torch.Tensor) -> dict:
    """Timed callables on the case's own logits: a read (``x.amax(-1)``) and a device copy
    (``y.copy_(x)`` into a buffer allocated at the first, untimed warm-up call)."""
    copy_out = []

    def copy():
        if not copy_out:
            copy_out.append(torch.empty_like(logits))
        return copy_out[0].copy_(logits)

    return {"read_amax": lambda: logits.amax(-1), "copy": copy}


# --- environment and rows -----------------------------------------------------------------------

def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"{_cpu_name()} ({torch.get_num_threads()} threads)"
    return {
        "device": device, "device_name": name, "torch": torch.__version__, "triton": triton_version,
        "kltriton": importlib.import_module("kltriton").__version__, "commit": _git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


ROW_FIELDS = (
    "op", "kind", "backend", "mode", "tokens", "vocab", "batch", "seq_len", "dtype", "masked_frac",
    "device", "device_name", "torch", "triton", "kltriton", "commit", "timestamp",
    "time_ms_median", "time_ms_min", "time_ms_max", "spread", "repeats",
    "peak_mem_bytes", "mem_method", "bytes_moved", "gbps", "bw_ref_gbps", "roofline_frac", "note", "flags",
)


def make_row(env, op, kind, backend, mode, case, **values) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row["flags"] = []
    row.update(env)
    row.update(op=op, kind=kind, backend=backend, mode=mode, batch=case.batch, seq_len=case.seq_len, **asdict(case))
    row.update(values)
    return row


def timing_values(times: list, nbytes: int, bw_ref: float) -> dict:
    median = statistics.median(times)
    gbps = nbytes / median / 1e6
    return {
        "time_ms_median": median, "time_ms_min": min(times), "time_ms_max": max(times),
        "spread": (max(times) - min(times)) / median, "repeats": len(times),
        "bytes_moved": nbytes, "gbps": gbps, "bw_ref_gbps": bw_ref, "roofline_frac": gbps / bw_ref,
    }


# A row's slowest call may take at most this many times its fastest. ``compare`` calls a slowdown
# noise while the new fastest call is within the old slowest, so this bounds the slowdown that a
# baseline row can hide (one stalled call would otherwise widen it without limit).
MAX_SPREAD = 3.0


def flag_implausible(rows) -> None:
    """Set every row's ``flags``: why its timings cannot be trusted, ``[]`` when they can.

    A timed row is flagged when its slowest call took more than ``MAX_SPREAD`` times its fastest,
    or when it is the ``forward`` or ``backward`` of a method whose ``fwd_bwd`` (which does all
    their work and more) has a median below their fastest call: one of the two was measured
    during a disturbance (the committed CPU run once had a backward of 190 ms against 21 ms for
    fwd+bwd, which nobody could reproduce).
    """
    timed = [r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None]
    fwd_bwd = {_case_key(r): r for r in timed if r["mode"] == "fwd_bwd"}
    for row in rows:
        row["flags"] = []
    for row in timed:
        if row["time_ms_max"] > MAX_SPREAD * row["time_ms_min"]:
            row["flags"].append(f"spread: slowest call {row['time_ms_max'] / row['time_ms_min']:.1f}x the fastest "
                                f"(limit {MAX_SPREAD:g}x)")
        both = fwd_bwd.get(_case_key(row))
        if row["mode"] != "fwd_bwd" and both is not None and row["time_ms_min"] > both["time_ms_median"]:
            row["flags"].append(f"ordering: fastest {row['mode']} call {row['time_ms_min']:.3g} ms > "
                                f"fwd_bwd median {both['time_ms_median']:.3g} ms")


def _case_key(row) -> tuple:
    return tuple(row[k] for k in ("op", "backend", "tokens", "vocab", "dtype", "masked_frac"))


def _measure(row, factory, inputs, mode, device, grid, rounds, first_round) -> list:
    """Times (ms) of one of ``rounds`` rounds for ``row`` (at least 3 samples over all rounds);
    on failure the note is set and ``[]`` returned."""
    inputs.logits.requires_grad_(False)
    try:
        call = _mode_fn(factory(inputs), inputs, mode)
        times = time_ms(call, device, grid.cpu_target_s / rounds, warmup=first_round,
                        min_repeats=max(1, math.ceil(3 / rounds)))
        if device == "cuda" and first_round:
            row["peak_mem_bytes"], row["mem_method"] = cuda_peak(call), CUDA_MEM_METHOD
        return times
    except torch.OutOfMemoryError:
        row["note"] = "out of memory"
    except Exception as err:  # e.g. torch.compile failing: record it and go on
        if mode == "backward" and "a second backward through the same" in str(err):
            row["note"] = ("not applicable: the fused loss writes its gradient in the forward and scales it in place "
                           "in the backward, so it refuses a second backward of one graph")
        else:
            row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    finally:
        call = None
        inputs.logits.grad = None
    return []


def _fill_cpu_memory(op, case, case_rows) -> None:
    """Peak memory of the case's timed CPU rows, from one fresh process (torch.compile left out:
    it would recompile there for seconds per row)."""
    timed = [r for r in case_rows if r["time_ms_median"] is not None]
    names = list(dict.fromkeys(r["backend"] for r in timed if r["backend"] != "compile"))
    peaks = cpu_peaks(op.__name__, case, names) if names else {}
    for row in timed:
        if row["backend"] == "compile":
            row["mem_method"] = "not measured on CPU: a fresh process recompiles for seconds per row"
        else:
            row["peak_mem_bytes"], row["mem_method"] = peaks.get(f"{row['backend']}/{row['mode']}"), CPU_MEM_METHOD


def run_op(op, grid: Grid, device: str, log=print) -> list:
    """Rows for one op module over the grid: bandwidth rows, then every method x mode per case."""
    import kltriton

    previous = kltriton.set_validation(False)  # no host-side label checks, as in a training loop
    try:
        return _run_cases(op, grid, device, log)
    finally:
        kltriton.set_validation(previous)


def _run_cases(op, grid: Grid, device: str, log) -> list:
    env = environment(device)
    rows = []
    for case in grid.cases:
        inputs = make_inputs(case, device, op.N_MODELS)
        bw, case_rows = _time_case(env, op, case, inputs, device, grid)
        for name, gbps in bw.items():
            rows.append(make_row(env, op.OP, "bandwidth", name, "forward", case, gbps=gbps,
                                 note="measured on this case's logits, in the same rounds as the rows"))
        del inputs
        gc.collect()
        if device == "cpu" and grid.memory:
            _fill_cpu_memory(op, case, case_rows)
        flag_implausible(case_rows)
        for row in case_rows:
            log(describe(row))
        rows += case_rows
    return rows


def _time_case(env, op, case, inputs, device, grid):
    """``(bandwidth GB/s by probe, rows of every method x mode)`` for one case.

    On CPU the rows and the bandwidth probes are timed in ``grid.cpu_rounds`` round-robin rounds
    (every row, then every row again, ...) and their samples pooled: a slowdown of the machine
    lasting a few seconds then touches one round of many rows instead of all samples of one row,
    and the bandwidth that ``compare`` corrects drift with was measured in the same rounds.
    """
    rounds = grid.cpu_rounds if device == "cpu" else 1
    case_rows, timed = [], []  # timed: (row, factory, mode, samples)
    for name, (kind, factory) in op.methods(device).items():
        skipped = name in grid.skip or (grid.only and name not in grid.only)
        note = "skipped on this grid" if skipped else None
        if note is None:
            try:
                factory(inputs)  # raises Unavailable when the method cannot run here
            except Unavailable as err:
                note = str(err)
        if note is not None:  # one row says it for every mode
            case_rows.append(make_row(env, op.OP, kind, name, MODES[0], case, note=note))
            continue
        for mode in MODES:
            row = make_row(env, op.OP, kind, name, mode, case)
            case_rows.append(row)
            timed.append((row, factory, mode, []))
    probes = _bandwidth_probes(inputs.logits)
    probe_samples = {name: [] for name in probes}
    for round_index in range(rounds):
        for name, probe in probes.items():
            probe_samples[name] += time_ms(probe, device, grid.cpu_target_s / rounds, warmup=round_index == 0,
                                           min_repeats=max(1, math.ceil(3 / rounds)))
        if round_index == rounds - 1:
            probes = None  # frees the copy's output before the last round's rows (GPU memory)
        for row, factory, mode, samples in timed:
            if row["note"] is None:  # not failed in an earlier round
                samples += _measure(row, factory, inputs, mode, device, grid, rounds, round_index == 0)
    nbytes = inputs.logits.numel() * inputs.logits.element_size()
    bw = {"read_amax": nbytes / statistics.median(probe_samples["read_amax"]) / 1e6,
          "copy": 2 * nbytes / statistics.median(probe_samples["copy"]) / 1e6}
    for row, _, mode, samples in timed:
        if row["note"] is None and samples:
            bw_ref = bw["read_amax"] if mode == "forward" else bw["copy"]
            row.update(timing_values(samples, bytes_moved(case, op.N_MODELS, mode), bw_ref))
    return bw, case_rows


def describe(row) -> str:
    head = (f"{row['op']:16s} {row['backend']:15s} {row['mode']:8s} N={row['tokens']:<6d} V={row['vocab']:<7d} "
            f"{row['dtype']} masked={row['masked_frac']:.2f}")
    if row["time_ms_median"] is None:
        return f"{head}  -- {row['note']}"
    flagged = f"  FLAGGED: {'; '.join(row['flags'])}" if row["flags"] else ""
    return (f"{head}  {row['time_ms_median']:9.3f} ms  {row['gbps']:7.1f} GB/s  "
            f"mem={_mib(row['peak_mem_bytes'])}{flagged}")


def _mib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}MiB"
