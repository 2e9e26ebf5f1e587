"""Test helpers: fresh random inputs and the one tolerance policy against the float64 oracle.

- Values (log-probs, entropy, KL): fp32 accumulation on numbers of size ``|x| / T``, so a few ulps
  of that magnitude (``value_atol``), as PyTorch's own fp32 ``log_softmax`` achieves.
- Gradients: the same absolute error times the upstream gradient, plus the rounding of the stored
  gradient to the logits dtype (``STORE_RTOL``) (``grad_tols``).
- Gradients with the entropy or full-KL terms (``MIXED_GRAD_RTOL``): ``p * (log p + H)`` and
  ``p * (log p - log q - KL)`` cancel terms of size ``log V + |x| / T`` in fp32, relative to the
  gradient's own size, plus the rounding to the dtype.
"""
import contextlib

import torch

EPS32 = 2.0 ** -23
# Rounding of a gradient stored in the logits dtype, relative: one ulp for bf16 because
# Triton's CPU interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest,
# half an ulp); half an ulp for fp16 and fp32.
STORE_RTOL = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -11}
MIXED_GRAD_RTOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def temp(value) -> torch.Tensor:
    """A temperature in the form every backend takes: a 0-dim float64 tensor."""
    return torch.tensor(value, dtype=torch.float64)


def random_logits(shape, dtype, scale=3.0, generator=None):
    """Fresh normal logits (never zeros), rounded to ``dtype``."""
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def random_labels(shape, vocab, ignore_frac=0.2, ignore_index=-100):
    labels = torch.randint(0, vocab, shape)
    labels[torch.rand(shape) < ignore_frac] = ignore_index
    return labels


def value_atol(logits, temperature):
    """fp32 accumulation on values of size |x| / T: a few ulps of that magnitude.

    The kernels subtract the row max before scaling, so the error grows with the logits'
    magnitude over T (as in PyTorch's own fp32 log_softmax), not with V.
    """
    finite = logits.float()[torch.isfinite(logits.float())]
    scale = 1.0 + (finite.abs().max().item() if finite.numel() else 0.0) / temperature
    return 16 * EPS32 * scale


def grad_tols(logits, temperature, upstream):
    """(atol, rtol) for gradients: fp32 math through the saved log-sum-exp (error ~ eps * |lse|),
    then rounding to the logits dtype."""
    g = upstream.abs().max().item() if upstream.numel() else 1.0
    return value_atol(logits, temperature) * max(g, 1.0) * 4, STORE_RTOL[logits.dtype]


def assert_close(actual, expected, atol, rtol=0.0, what=""):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), f"{what}: NaN positions differ"
    both = ~torch.isnan(actual)
    a, e = actual[both], expected[both]
    assert torch.equal(torch.isinf(a), torch.isinf(e)) and torch.equal(a[torch.isinf(a)], e[torch.isinf(e)]), \
        f"{what}: infinities differ"
    fin = torch.isfinite(a)
    err = (a[fin] - e[fin]).abs()
    bound = atol + rtol * e[fin].abs()
    if err.numel():
        worst = (err - bound).argmax()
        assert bool((err <= bound).all()), (
            f"{what}: max excess at {worst.item()}: |{a[fin][worst].item()} - {e[fin][worst].item()}| "
            f"= {err[worst].item():.3e} > {bound[worst].item():.3e}")


class CallCounter:
    """Counts the calls of a public kltriton function, replaced for the test with ``monkeypatch`` in
    ``kltriton`` and in every kltriton module that imported it by name (the drop-ins call it so)."""

    def __init__(self, monkeypatch, name: str):
        import sys

        import kltriton

        self.calls = 0
        original = getattr(kltriton, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        for module_name, module in list(sys.modules.items()):
            if module_name.split(".")[0] == "kltriton" and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)


class HostSyncError(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads(device):
    """Fail on any read of a tensor's value by the host: the Python conversions that sync (``item``,
    ``bool``, ``float``, ``int``, ``tolist``) raise, and on CUDA so does any synchronizing op."""
    def refuse(*args, **kwargs):
        raise HostSyncError("a tensor value was read on the host")

    names = ("item", "__bool__", "__float__", "__int__", "tolist")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    for name in names:
        setattr(torch.Tensor, name, refuse)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def kernel_forward(impl, x, y, t, temperature, entropy=False, full_kl=False):
    """A ``stream`` backend module's forward with the statistics named by flags (the reference pair with ``y``)."""
    from kltriton.kernels import statistics

    return impl.forward(x, y, t, temperature, statistics.request(entropy=entropy, ref=y is not None, full_kl=full_kl))


def kernel_backward(impl, x, y, t, temperature, stats, g_logp, g_entropy=None, g_full_kl=None):
    """A ``stream`` backend module's backward for upstream gradients of ``logp`` / ``entropy`` / ``full_kl`` on
    the statistics ``stats`` of its forward (their gradient basis, ``statistics.gradient_basis``)."""
    from kltriton.kernels import statistics

    basis = statistics.gradient_basis({"logp": g_logp, "entropy": g_entropy, "full_kl": g_full_kl}, stats, temperature)
    logq = basis.reads_ref()
    return impl.backward(x, y if logq else None, t, temperature, stats.lse, stats.ref_lse if logq else None, basis)


def leave_world():
    """End a spawned gloo rank: wait (at most a minute) until every rank is done, then destroy the group.
    Without the barrier a rank that finishes first tears its connections down while another still uses
    them, and gloo's threads abort that process at exit ("terminate called without an active exception")."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if dist.get_world_size() > 1:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    finally:
        dist.destroy_process_group()


def spawned_backends(family="stream"):
    """The backends a spawned gloo world runs ``family`` on: reference and C++ where usable, Triton through its
    interpreter only (gloo takes CPU tensors)."""
    from kltriton import dispatch

    usable = [b for b in ("reference", "cpp") if dispatch.availability(b, family)[0]]
    if dispatch.availability("triton", family)[0] and dispatch.triton_interpreted():
        usable.append("triton")
    return usable


def record(report, key, case, *args):
    """Run ``case(*args)`` in a spawned rank: ``report[key]`` is ``"ok"`` or the traceback, for the parent to assert."""
    import traceback

    try:
        case(*args)
        report[key] = "ok"
    except Exception:  # noqa: BLE001 - reported per case to the parent
        report[key] = traceback.format_exc()


def close_rank(report_dir, rank, report):
    """Write a spawned rank's report (``rank<r>.json``) and leave the world (``leave_world``)."""
    import json
    import os

    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    leave_world()


def exit_rank():
    """End a spawned rank whose cases all ran (after ``close_rank``) at once, without the interpreter's teardown: that
    teardown can still meet a thread of the destroyed gloo group and abort the process ("terminate called without an
    active exception", seen once in CI after ``leave_world``'s barrier), failing a world whose every case passed."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def awkward_logits(shape, dtype, gen, scale=3.0, ties=False):
    """Fresh random logits with the awkward entries of real ones: ``-inf``, ``finfo.min``, a row 40x larger (and,
    with ``ties``, a run of 30 equal entries in row 3)."""
    x = torch.randn(shape, generator=gen) * scale
    flat = x.view(-1, shape[-1])
    flat[0, 5] = float("-inf")
    flat[1, -3] = torch.finfo(dtype).min
    flat[2] *= 40.0
    if ties:
        flat[3, :30] = flat[3, 0]
    return x.to(dtype)


def raises_with(fn, fragment):
    """``fn()`` raises a ValueError or TypeError whose message holds ``fragment`` (an AssertionError otherwise)."""
    try:
        fn()
    except (ValueError, TypeError) as error:
        assert fragment in str(error), f"expected {fragment!r} in: {error}"
        return
    raise AssertionError(f"no error (expected {fragment!r})")
