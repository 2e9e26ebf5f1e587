"""Start the ranks of a sharded test as separate CPU processes (gloo over 127.0.0.1) and collect what they wrote."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
WORLD = Path(__file__).with_name("world.py")


class RankFailed(RuntimeError):
    """A rank exited with an error (its log tail attached)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(rank: int, world_size: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    if world_size > 1:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    else:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
    return env


def start(jobs: list, out: Path, world_size: int):
    """Start ``world_size`` processes running ``jobs`` (``world.py``); returns the processes and their log paths."""
    out.mkdir(parents=True, exist_ok=True)
    scenario = out / "scenario.json"
    scenario.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        log = out / f"rank{rank}.log"
        with open(log, "w") as handle:
            procs.append(subprocess.Popen([sys.executable, str(WORLD), str(scenario)], cwd=str(ROOT),
                                          env=environment(rank, world_size, port), stdout=handle,
                                          stderr=subprocess.STDOUT))
        logs.append(log)
    return procs, logs


def wait(procs, logs, timeout: float):
    """Wait for every rank; ``(return codes, seconds each took)``. Past ``timeout`` the ranks left are killed
    (return code ``None``)."""
    begin = time.monotonic()
    codes, seconds = [None] * len(procs), [None] * len(procs)
    while any(c is None for c in codes) and time.monotonic() - begin < timeout:
        for i, proc in enumerate(procs):
            if codes[i] is None and proc.poll() is not None:
                codes[i], seconds[i] = proc.returncode, time.monotonic() - begin
        time.sleep(0.2)
    for i, proc in enumerate(procs):
        if codes[i] is None:
            proc.kill()
            proc.wait()
    return codes, seconds


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run(jobs: list, out: Path, world_size: int = 2, timeout: float = 900) -> list:
    """Run ``jobs`` on ``world_size`` ranks; each rank's list of job results. A rank that fails (or a run past
    ``timeout``) raises ``RankFailed`` with the logs' tails."""
    procs, logs = start(jobs, out, world_size)
    codes, _ = wait(procs, logs, timeout)
    if any(code != 0 for code in codes):
        report = "\n".join(f"--- rank {r} (exit {code}):\n{tail(log)}" for r, (code, log) in
                           enumerate(zip(codes, logs)))
        raise RankFailed(f"ranks exited {codes}\n{report}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
