"""The one timer of kltriton's measurements: the benchmark harness, the CPU ratio and vocab-parallel scripts
and the demo all time with ``time_ms``."""
import math
import time


def time_ms(fn, device: str, cpu_target_s: float = 0.3, warmup: bool = True, min_repeats: int = 3,
            setup=None) -> list:
    """Per-call wall times of ``fn()`` in ms.

    CUDA: ``triton.testing.do_bench`` (warm-up, L2 flush, CUDA events). CPU: one warm-up call (unless
    ``warmup=False``), then ``min_repeats``..20 calls, as many as fit in about ``cpu_target_s`` seconds.
    ``setup``: called before each timed CPU call, outside the timing (e.g. a ``torch.distributed`` barrier).
    """
    if device == "cuda":
        import triton.testing

        return list(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all"))
    if warmup:
        fn()

    def once():
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    times = [once()]
    for _ in range(min(19, max(min_repeats - 1, math.ceil(cpu_target_s * 1e3 / max(times[0], 1e-6)) - 1))):
        times.append(once())
    return times
