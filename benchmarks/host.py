"""What a public call costs besides its kernels: ``python -m benchmarks host [--device cpu|cuda] [--smoke]``.

For every public call of SPEC's "The host floor" at a tiny shape (B 4, T 16, V 128; one thread on CPU) it counts

- the **ops dispatched** below autograd (a ``TorchDispatchMode``): every ATen or kernel op that is not a view or a
  bare allocation; on a GPU each is a launch. The ops run inside kltriton's own registered ops are counted one by
  one (the registered op itself is a wrapper, not a launch). A Triton kernel launch is not an op: on CPU the C++
  backend is counted; on CUDA the profiler's kernel launches are reported beside the ops;
- the **host reads** among them (``_local_scalar_dense``, ``nonzero``, ...: on a device, a synchronization);
- the **host time** per call (median of many calls after a warm-up), against eager PyTorch computing the same
  outputs (``token_logprobs``: ``log_softmax`` + ``gather``; ``policy_loss``: the GRPO loss with the same per-token
  outputs and metrics, written as TRL writes it).

Each row carries its budget (``BUDGETS``, SPEC's targets) and whether it holds. The caller's own ops (its inputs,
the upstream gradient) are made outside the counted region. Results go to ``benchmarks/results/host_<device>.json``.
"""
import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kltriton
from benchmarks import harness

RESULTS = Path(__file__).resolve().parent / "results"
B, T, V, H = 4, 16, 128, 32
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero",
              "repeat_interleave"}
# SPEC "The host floor": ops dispatched per call at most (None: no budget); host time against eager at most.
BUDGETS = {
    "token_logprobs forward": 2,
    "token_logprobs forward+backward": 3,
    "token_kl forward": 4,
    "fused_kl_reward forward": 4,
    "policy_loss forward+backward": 6,
    "LinearLogits token_logprobs forward+backward": 6,
    "token_divergence forward+backward": 4,
}
TIME_BUDGETS = {"token_logprobs forward": 3.0, "policy_loss forward+backward": 0.5}


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched below autograd that are neither views nor bare allocations; kltriton's registered
    ops are entered, so their inner ops count one by one."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kltriton":
            with self:
                return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ALLOCATIONS:
            self.ops[f"{func.namespace}.{name}"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return sum(count for name, count in self.ops.items() if name.split(".", 1)[1] in HOST_READS)


class Case(NamedTuple):
    name: str
    run: Callable          # () -> None: the call (and its backward), the caller's own tensors made already
    eager: Optional[Callable] = None  # () -> None: eager PyTorch computing the same, for the host-time ratio


def _inputs(device, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, V, generator=gen, dtype=dtype).to(device)
    ref = torch.randn(B, T, V, generator=gen, dtype=dtype).to(device)
    labels = torch.randint(0, V, (B, T), generator=gen).to(device)
    mask = (torch.rand(B, T, generator=gen) > 0.25).to(device)
    old = (torch.log_softmax(x.float(), -1).gather(-1, labels[..., None])[..., 0] + 0.1
           * torch.randn(B, T, generator=gen).to(device))
    adv = torch.randn(B, generator=gen).to(device)
    return x, ref, labels, mask, old, adv


def eager_logprobs(x, labels):
    return torch.log_softmax(x.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


def eager_grpo(x, ref, labels, mask, old, adv, beta=0.04, entropy_coef=0.01, eps=0.2):
    """TRL's GRPO loss (``seq-mean-token-mean``, k3 KL, an entropy bonus) with the outputs and metrics of
    ``kltriton.policy_loss``: per-token log-probs, reference log-probs, KL, entropy and ratio, and ``clipfrac``,
    ``clipfrac_lower``, ``ppo_kl``, ``kl_mean``, ``entropy_mean``, ``ratio_max``, ``ratio_min``."""
    logp_all = torch.log_softmax(x.float(), -1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    with torch.no_grad():
        ref_logp = torch.log_softmax(ref.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.float()
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    pg1, pg2 = ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a
    pg = -torch.min(pg1, pg2)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    per_token = pg + beta * kl - entropy_coef * entropy
    loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    count = m.sum().clamp(min=1)
    with torch.no_grad():
        low = (ratio < 1 - eps) & (a < 0)
        high = (ratio > 1 + eps) & (a > 0)
        metrics = {"clipfrac": ((low | high).float() * m).sum() / count,
                   "clipfrac_lower": (low.float() * m).sum() / count,
                   "ppo_kl": ((old - logp) * m).sum() / count, "kl_mean": (kl * m).sum() / count,
                   "entropy_mean": (entropy * m).sum() / count,
                   "ratio_max": torch.where(mask, ratio, -torch.inf).max(),
                   "ratio_min": torch.where(mask, ratio, torch.inf).min()}
    return loss, (logp.detach() * m, ref_logp * m, kl.detach() * m, entropy.detach() * m, ratio.detach() * m), metrics


def cases(backend: str, device: str):
    """The measured calls of ``BUDGETS`` on ``backend``, and the eager baselines."""
    x, ref, labels, mask, old, adv = _inputs(device)
    leaf = x.clone().requires_grad_(True)
    upstream = torch.randn(B, T, device=device)
    one = torch.ones((), device=device)

    def backward(out, grad):
        torch.autograd.backward(out, grad)
        leaf.grad = None

    def logprobs_forward():
        kltriton.token_logprobs(leaf, labels, mask=mask, backend=backend)

    def logprobs_forward_backward():
        backward(kltriton.token_logprobs(leaf, labels, mask=mask, backend=backend), upstream)

    def kl_forward():
        kltriton.token_kl(leaf, ref, labels, estimator="k3", mask=mask, backend=backend)

    scores = torch.randn(B, device=device)

    def reward_forward():
        kltriton.fused_kl_reward(leaf, ref, labels, coef=0.05, scores=scores, mask=mask, backend=backend)

    def loss_forward_backward():
        out = kltriton.policy_loss(leaf, labels, adv, old_logprobs=old, ref=ref, loss_type="grpo", kl_coef=0.04,
                                   entropy_coef=0.01, mask=mask, backend=backend)
        backward(out.loss, one)

    hidden = torch.randn(B, T, H, device=device, requires_grad=True)
    weight = (0.1 * torch.randn(V, H, device=device)).requires_grad_(True)

    def linear_forward_backward():
        out = kltriton.token_logprobs(kltriton.LinearLogits(hidden, weight), labels, mask=mask, backend=backend)
        torch.autograd.backward(out, upstream)
        hidden.grad = weight.grad = None

    def divergence_forward_backward():
        out = kltriton.token_divergence(leaf, ref, labels, mask=mask, reduction="batchmean", backend=backend)
        backward(out, one)

    eager_leaf = x.clone().requires_grad_(True)

    def eager_forward():
        eager_logprobs(eager_leaf, labels)

    def eager_loss():
        loss, _, _ = eager_grpo(eager_leaf, ref, labels, mask, old, adv)
        loss.backward(one)
        eager_leaf.grad = None

    return [
        Case("token_logprobs forward", logprobs_forward, eager_forward),
        Case("token_logprobs forward+backward", logprobs_forward_backward),
        Case("token_kl forward", kl_forward),
        Case("fused_kl_reward forward", reward_forward),
        Case("policy_loss forward+backward", loss_forward_backward, eager_loss),
        Case("LinearLogits token_logprobs forward+backward", linear_forward_backward),
        Case("token_divergence forward+backward", divergence_forward_backward),
    ]


def count(run) -> OpCounter:
    run()  # warm-up: builds, compiles and caches stay out of the count
    with OpCounter() as counter:
        run()
    return counter


def host_us(run, device: str, seconds: float) -> float:
    """Median wall time of one call in microseconds (CUDA: synchronized around each call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        run()
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < 20 or (time.perf_counter() < deadline and len(times) < 5000):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def cuda_launches(run) -> int:
    """Kernel launches of one call, from the profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def measure(backend: str, device: str, seconds: float) -> list:
    rows = []
    for case in cases(backend, device):
        counter = count(case.run)
        row = {"call": case.name, "backend": backend, "ops": counter.total, "host_reads": counter.host_reads,
               "op_names": dict(sorted(counter.ops.items())), "budget_ops": BUDGETS[case.name],
               "host_us": host_us(case.run, device, seconds)}
        row["ops_ok"] = row["ops"] <= row["budget_ops"]
        if device == "cuda":
            row["cuda_launches"] = cuda_launches(case.run)
        if case.eager is not None:
            eager_counter = count(case.eager)
            row.update(eager_ops=eager_counter.total, eager_us=host_us(case.eager, device, seconds))
            row["ratio_to_eager"] = row["host_us"] / row["eager_us"]
            row["budget_ratio"] = TIME_BUDGETS[case.name]
            row["time_ok"] = row["ratio_to_eager"] <= row["budget_ratio"]
        rows.append(row)
    return rows


def table(rows) -> str:
    lines = [f"{'call':46s} {'backend':9s} {'ops':>4s} {'budget':>6s} {'reads':>5s} {'host us':>8s} {'eager us':>8s} "
             f"{'ratio':>6s}"]
    for r in rows:
        eager = f"{r['eager_us']:8.1f} {r['ratio_to_eager']:6.2f}" if "eager_us" in r else f"{'':8s} {'':6s}"
        flag = "" if r["ops_ok"] and r.get("time_ok", True) else "  over budget"
        lines.append(f"{r['call']:46s} {r['backend']:9s} {r['ops']:4d} {r['budget_ops']:6d} {r['host_reads']:5d} "
                     f"{r['host_us']:8.1f} {eager}{flag}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backends", nargs="+", default=None, help="default: cpp on CPU, triton on CUDA")
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent timing each call")
    parser.add_argument("--smoke", action="store_true", help="a few calls each, nothing written (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available")
        return 2
    previous_threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)
    validation = kltriton.set_validation(False)
    try:
        backends = args.backends or (["cpp"] if args.device == "cpu" else ["triton"])
        rows = [row for backend in backends for row in measure(backend, args.device, 0.05 if args.smoke else
                                                                                   args.seconds)]
    finally:
        kltriton.set_validation(validation)
        torch.set_num_threads(previous_threads)
    print(table(rows))
    if args.smoke:
        return 0
    env = harness.environment(args.device)
    env["shape"] = {"B": B, "T": T, "V": V, "H": H}
    env["threads"] = 1 if args.device == "cpu" else None
    path = args.out / f"host_{args.device}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
