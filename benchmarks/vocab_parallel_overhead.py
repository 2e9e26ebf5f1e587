"""Cost of the vocab-parallel exchange against the kernel, on CPU ranks over gloo.

    python -m benchmarks.vocab_parallel_overhead [--rows 2048] [--vocab 32000] [--ranks 2] [--backend cpp]
        [--hidden H]

Each rank holds ``V / ranks`` columns of fp32 logits and times (median of ``--repeat`` runs, ranks
in lockstep behind a barrier): the stream kernel on its shard alone, the all-gather of the per-row
statistics alone, the same op unsharded on the shard alone (what the rank would pay without the
exchange), the whole sharded ``token_kl(estimator="full")`` / ``token_logprobs`` forward,
and their backward; with ``--hidden``, ``LinearLogits`` on this rank's weight rows forward + backward
against the same on the shard alone, and the all-reduce of the hidden gradient. Rank 0 prints one line per measurement and the bytes exchanged per row.
"""
import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kltriton.timing import time_ms


def _median_ms(fn, repeat):
    """Median of ``repeat`` calls, every rank starting each call together (a barrier before it, untimed)."""
    return statistics.median(time_ms(fn, "cpu", cpu_target_s=0.0, min_repeats=repeat, setup=dist.barrier))


def _worker(rank, args, init_file):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks)
    import kltriton
    from kltriton.kernels import statistics
    from kltriton.kernels.linear import Side
    from kltriton.ops.statistics import statistics as statistics_op
    from kltriton.parallel import all_gather

    group = dist.group.WORLD
    size = args.vocab // args.ranks
    gen = torch.Generator().manual_seed(rank)
    logits = torch.randn(args.rows, size, generator=gen) * 3
    ref = logits + torch.randn(args.rows, size, generator=gen)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=torch.Generator().manual_seed(0))
    target = (labels % size).contiguous()
    temperature = torch.ones((), dtype=torch.float64)
    start = rank * size
    rows = []

    def record(name, fn):
        fn()  # warm-up (and the C++ build)
        rows.append((name, _median_ms(fn, args.repeat)))

    for what, width, with_ref, full in (("token_logprobs", 2, False, False), ("token_kl full", 5, True, True)):
        r = ref if with_ref else None
        wanted = statistics.request(ref=with_ref, full_kl=full)
        record(f"{what}: stream kernel on the shard", lambda: statistics_op(
            Side(logits, None, None, None, None), None if r is None else Side(r, None, None, None, None), target,
            temperature, wanted, 0, False, None, args.backend))
        payload = torch.randn(width, args.rows)
        record(f"{what}: all-gather of {width} x fp32 per row", lambda: all_gather(payload, group).sum())

        def forward(x):
            if with_ref:
                return kltriton.token_kl(x, ref, labels, estimator="full", backend=args.backend,
                                         process_group=group, vocab_start=start).kl
            return kltriton.token_logprobs(x, labels, backend=args.backend, process_group=group, vocab_start=start)
        def plain(x):  # the same op on the shard as if it were the whole vocabulary
            if with_ref:
                return kltriton.token_kl(x, ref, target, estimator="full", backend=args.backend).kl
            return kltriton.token_logprobs(x, target, backend=args.backend)
        record(f"{what}: unsharded op on the shard alone", lambda: plain(logits))
        record(f"{what}: sharded op forward", lambda: forward(logits))
        x = logits.detach().requires_grad_()
        record(f"{what}: unsharded op on the shard, forward + backward", lambda: plain(x).sum().backward())
        record(f"{what}: sharded op forward + backward", lambda: forward(x).sum().backward())
    if args.hidden:  # LinearLogits with this rank's weight rows: the hidden gradient is all-reduced
        from kltriton.parallel import all_reduce
        hidden = torch.randn(args.rows, args.hidden, generator=torch.Generator().manual_seed(0))
        weight = torch.randn(size, args.hidden, generator=gen) / args.hidden ** 0.5
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        lin = lambda: kltriton.LinearLogits(h, w)  # noqa: E731
        record(f"LinearLogits H={args.hidden}: all-reduce of the [N, H] hidden gradient",
               lambda: all_reduce(hidden, group).sum())
        record(f"LinearLogits H={args.hidden}: unsharded op on the shard, forward + backward",
               lambda: kltriton.token_logprobs(lin(), target, backend=args.backend).sum().backward())
        record(f"LinearLogits H={args.hidden}: sharded op forward + backward",
               lambda: kltriton.token_logprobs(lin(), labels, backend=args.backend, process_group=group,
                                               vocab_start=start).sum().backward())
    if rank == 0:
        print(f"ranks={args.ranks} rows={args.rows} V={args.vocab} (V_local={size}) fp32 backend={args.backend} "
              f"threads/rank={args.threads}")
        for name, ms in rows:
            print(f"  {name:58s} {ms:9.3f} ms")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="cpp")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=0, help="also time LinearLogits with this hidden size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, os.path.join(tmp, "init")), nprocs=args.ranks)


if __name__ == "__main__":
    main()
