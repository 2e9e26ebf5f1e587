"""Benchmark one training step of a sharded causal LM on 2 CPU processes (gloo): the log-probs of the next tokens
and a policy-gradient loss, forward, backward and an optimizer step, through the wrapper (FSDP2 or DeepSpeed
ZeRO-3), scored three ways:

- ``kltriton``: ``kltriton.heads.score_with_lm_head`` inside the model's forward (``run_in_forward``): the head
  projected in tiles by ``kltriton.token_logprobs(LinearLogits(...))``, never the ``[N, V]`` logits;
- ``trl``: TRL 1.16's fused LM head (``add_fused_lm_head``, ``model(..., fused_lm_head=True)``), as its trainers use
  it (under FSDP2 it reads the head with ``full_tensor()``, under ZeRO-3 with its ``GatheredParameters`` context);
- ``eager``: the model's own forward (``[N, V]`` logits), ``log_softmax`` and a gather.

Per rank: the median time of a step, its peak memory (RSS above the step's start: VmHWM reset through
``/proc/self/clear_refs``, ``harness.CPU_MEM_ENV``), and the bytes each collective call moves (the full size of
the gathered or reduced buffer, counted at ``torch.distributed``), per scored token. Layouts: ``fsdp2`` (each decoder
layer and the LM head in their own units, then the root; ``reshard_after_forward=True``) and ``zero3`` (every
parameter partitioned).

``python -m benchmarks.bench_sharded [--hidden 256 --layers 4 --vocab 32000 --tokens 1024 --steps 4 --out FILE]``
(tokens per rank). Writes one JSON row per layout x method.
"""
import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness

METHODS = ("kltriton", "trl", "eager")
LAYOUTS = ("fsdp2", "zero3")
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
               "all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all_single", "_all_gather_base",
               "_reduce_scatter_base", "all_gather_coalesced", "reduce_scatter_coalesced")


class Traffic:
    """Bytes through ``torch.distributed``'s collectives while counting: the largest tensor argument of each call
    (the gathered output, the reduced input), summed."""

    def __init__(self):
        self.bytes, self.on = 0, False
        dist = torch.distributed
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counted(original))

    def _counted(self, original):
        def call(*args, **kwargs):
            if self.on:
                self.bytes += max((_nbytes(a) for a in (*args, *kwargs.values())), default=0)
            return original(*args, **kwargs)
        return call


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _model(args, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def _wrap(model, layout, batch):
    """``(the model to call, backward(loss), step())`` for ``layout``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model.lm_head)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

        def step():
            optimizer.step()
            optimizer.zero_grad()

        return model, lambda loss: loss.backward(), step
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": batch, "zero_allow_untested_optimizer": True})
    return engine, engine.backward, engine.step


def _loss(method, wrapped, model, ids, advantages):
    """``-(log p(next token) * advantage).mean()`` of the batch, scored by ``method``."""
    import kltriton
    from kltriton import heads

    labels = ids[:, 1:]
    if method == "kltriton":
        def forward(input_ids):
            hidden = model.base_model(input_ids=input_ids).last_hidden_state[:, :-1]
            return heads.score_with_lm_head(model, hidden, lambda logits: -(kltriton.token_logprobs(
                logits, labels) * advantages).mean())
        return heads.run_in_forward(wrapped, forward, ids)
    if method == "trl":
        full = torch.cat([ids[:, :1], labels], dim=1)
        logp = wrapped(input_ids=ids, labels=full, fused_lm_head=True).log_probs
        return -(logp * advantages).mean()
    logits = wrapped(input_ids=ids).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    return -(logp * advantages).mean()


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def rank_main(args):
    """One rank: every method on ``args.layout``; rank 0 prints the rows as JSON."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if args.layout == "zero3":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's CPU op
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})  # noqa
    traffic = Traffic()
    seq = 256
    batch = max(1, args.tokens // seq)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (batch, seq + 1), generator=gen)
    advantages = torch.randn(batch, seq, generator=gen)
    rows = []
    for method in args.methods:
        model = _model(args)
        if method == "trl":
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(model)
        wrapped, backward, step = _wrap(model, args.layout, batch)
        times, peaks, moved = [], [], []
        for i in range(args.steps + 1):
            gc.collect()
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status_kib("VmRSS")
            traffic.bytes, traffic.on = 0, True
            start = time.perf_counter()
            loss = _loss(method, wrapped, model, ids, advantages)
            backward(loss)
            step()
            elapsed = time.perf_counter() - start
            traffic.on = False
            if i:  # the first step warms up (lazy initialization, allocator)
                times.append(elapsed * 1e3)
                peaks.append((_status_kib("VmHWM") - before) * 1024)
                moved.append(traffic.bytes)
            del loss
        stats = torch.tensor([statistics.median(times), max(peaks), statistics.median(moved)], dtype=torch.float64)
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        if rank == 0:
            rows.append(dict(method=method, time_ms_median_per_rank=[float(g[0]) for g in gathered],
                             time_ms_all=times, peak_mem_bytes_per_rank=[int(g[1]) for g in gathered],
                             collective_bytes_per_step=int(gathered[0][2]),
                             collective_bytes_per_token=float(gathered[0][2]) / (batch * seq)))
        del model, wrapped
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def run_layout(args, layout) -> list:
    """Start 2 ranks for ``layout``; their rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, **harness.CPU_MEM_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(harness.REPO), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "benchmarks.bench_sharded", "--rank-of", layout, "--hidden", str(args.hidden),
            "--layers", str(args.layers), "--vocab", str(args.vocab), "--tokens", str(args.tokens),
            "--steps", str(args.steps), "--methods", ",".join(args.methods)]
    with tempfile.TemporaryDirectory() as logs:
        procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=harness.REPO,
                                  stdout=open(Path(logs) / f"{r}.log", "w"), stderr=subprocess.STDOUT)
                 for r in range(2)]
        codes = [p.wait() for p in procs]
        text = (Path(logs) / "0.log").read_text()
        if any(codes):
            other = (Path(logs) / "1.log").read_text()
            raise RuntimeError(f"{layout}: ranks exited {codes}\n{text[-3000:]}\n{other[-2000:]}")
    return json.loads(next(line for line in text.splitlines() if line.startswith("ROWS "))[5:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=1024, help="scored tokens per rank and step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--rank-of", dest="layout", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    if args.layout is not None:
        return rank_main(args)
    env = harness.environment("cpu")
    env["device_name"] = env["device_name"].replace(f"({torch.get_num_threads()} threads)", "(2 ranks x 1 thread)")
    rows = []
    for layout in args.layouts.split(","):
        for row in run_layout(args, layout):
            row.update(env, op="sharded_step", layout=layout, ranks=2, hidden=args.hidden, layers=args.layers,
                       vocab=args.vocab, tokens_per_rank=args.tokens, dtype="fp32", steps=args.steps,
                       mem_method="cpu: per rank, VmHWM after the step - VmRSS at its start (clear_refs 5 "
                                  "before), MALLOC_MMAP_THRESHOLD_=131072, KLTRITON_CPU_GRAD_CACHE=0; the max over "
                                  "the timed steps",
                       traffic_method="sum over torch.distributed collective calls of the largest tensor argument "
                                      "(the full gathered / reduced buffer), rank 0, median over the timed steps")
            rows.append(row)
            print(f"{layout:6s} {row['method']:9s} {statistics.median(row['time_ms_median_per_rank']):8.1f} ms/step  "
                  f"peak {max(row['peak_mem_bytes_per_rank']) / 2**20:7.1f} MiB/rank  "
                  f"{row['collective_bytes_per_token']:9.0f} B/token", flush=True)
    layouts = "-".join(args.layouts.split(","))
    out = args.out or str(harness.REPO / "benchmarks" / "results" /
                          f"cpu-2-ranks_sharded_{layouts}_{args.tokens}x{args.hidden}x{args.vocab}.json")
    Path(out).write_text(json.dumps(rows, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
