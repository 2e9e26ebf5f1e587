"""Vocab-parallel ops over ``gloo`` on CPU: 2 and 3 spawned ranks, uneven shards, global labels.

Every rank builds the same full tensors, runs the op on its vocab shard with ``process_group``, and
compares outputs and the gradient of its shard with the unsharded op on the full tensors (same
backend and dtype). Sharded results differ from unsharded ones by fp32 rounding of the merged
per-row statistics: a few ulps of ``|x| / T`` (``value_atol``), scaled by the gradient of whatever
is computed from them (so relative for the KL estimators, relative to the row's gradient size for
gradients), plus the rounding of the stored gradient (``STORE_RTOL``, ``MIXED_GRAD_RTOL``).

Starting ranks costs seconds (each imports torch), so one spawn per world size runs every case and
reports per case; the tests below only read the reports.
"""
import json
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kltriton
from kltriton import dispatch
from helpers import (
    MIXED_GRAD_RTOL, STORE_RTOL, assert_close, awkward_logits, close_rank, exit_rank, leave_world, record,
    spawned_backends, value_atol)

SHARDS = {2: (300, 207), 3: (400, 300, 301)}  # V = 507 and V = 1001, uneven
DTYPES = (torch.float32, torch.bfloat16)


_logits = awkward_logits  # fresh random logits with the awkward entries of real ones


class Shard:
    """This rank's columns of full tensors, and the comparison helpers."""

    def __init__(self, rank, sizes, group):
        self.rank, self.group = rank, group
        self.start = sum(sizes[:rank])
        self.stop = self.start + sizes[rank]
        self.vocab = sum(sizes)

    def cut(self, full, grad=False):
        part = full[..., self.start:self.stop]
        return part.detach().requires_grad_() if grad else part

    def check(self, sharded, unsharded, full_logits, temperature, what, scale=None):
        """Outputs: a few ulps of |x| / T, relative to the size of the value derived from them."""
        tol = 16 * value_atol(full_logits, temperature)
        assert_close(sharded, unsharded, atol=tol * (scale or 1.0), rtol=tol, what=what)

    def check_grad(self, part, full, full_logits, temperature, what, mixed=False):
        expected = full.grad[..., self.start:self.stop]
        finite = expected[torch.isfinite(expected)]
        size = finite.abs().max().item() if finite.numel() else 0.0
        rtol = (MIXED_GRAD_RTOL if mixed else STORE_RTOL)[part.dtype]
        atol = 16 * value_atol(full_logits, temperature) * size + rtol * size / 8
        assert_close(part.grad, expected, atol=atol, rtol=rtol, what=what)


# The Triton interpreter runs one program after another: a few cases, one dtype.
TRITON_CASES = ("logprobs_padded_shifted", "head_outputs", "kl_full_logits", "fused_kl_reward_packed_full",
                "divergence_jsd_logits")


def _run_both(shard, make_full, call, full_logits):
    """``call(logits, ref, **sharding)`` on the full tensors and on this rank's shard, with the same
    random upstream gradient on every differentiable output; returns both outputs, grads in place."""
    full = full_logits.detach().requires_grad_()
    part = shard.cut(full_logits, grad=True)
    ref = make_full()
    ref_part = shard.cut(ref) if ref is not None and ref.shape == full_logits.shape else ref
    expected = call(full, ref, {})
    actual = call(part, ref_part, {"process_group": shard.group})
    gen = torch.Generator().manual_seed(7)
    for out in (expected, actual):
        tensors = [t for t in out if t.requires_grad]
        weights = [torch.randn(t.shape, generator=gen) for t in tensors]
        gen.manual_seed(7)
        sum((t * w).sum() for t, w in zip(tensors, weights)).backward()
    return expected, actual, full, part


def case_logprobs_padded_shifted(shard, backend, dtype):
    """``[B, T]`` view ``logits[:, :-1]``, shifted input ids, attention mask, entropy, temperature."""
    gen = torch.Generator().manual_seed(1)
    full_logits = _logits((3, 9, shard.vocab), dtype, gen)[:, :-1]
    ids = torch.randint(0, shard.vocab, (3, 8), generator=gen)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, :2] = False

    def call(logits, _ref, sharding):
        return kltriton.token_logprobs(logits, ids, mask=mask, shift_labels=True, return_entropy=True,
                                       temperature=0.7, backend=backend, **sharding)

    expected, actual, full, part = _run_both(shard, lambda: None, call, full_logits)
    for name, e, a in zip(("logp", "entropy"), expected, actual):
        shard.check(a, e, full_logits, 0.7, name)
    shard.check_grad(part, full, full_logits, 0.7, "grad", mixed=True)


def case_logprobs_packed(shard, backend, dtype):
    """Packed ``[N, V]`` with ``cu_seqlens`` (an empty segment), ignore_index, explicit ``vocab_start``."""
    gen = torch.Generator().manual_seed(2)
    full_logits = _logits((13, shard.vocab), dtype, gen)
    labels = torch.randint(0, shard.vocab, (13,), generator=gen)
    labels[[3, 9]] = -100
    labels[4] = shard.vocab - 1          # last id of the last shard
    labels[6] = 0                        # first id of the first shard
    cu = torch.tensor([0, 5, 5, 13])

    def call(logits, _ref, sharding):
        if sharding:
            sharding["vocab_start"] = shard.start
        return (kltriton.token_logprobs(logits, labels, cu_seqlens=cu, temperature=1.0, backend=backend,
                                        **sharding),)

    expected, actual, full, part = _run_both(shard, lambda: None, call, full_logits)
    shard.check(actual[0], expected[0], full_logits, 1.0, "logp")
    shard.check_grad(part, full, full_logits, 1.0, "grad")


def _kl_case(estimator, ref_form):
    def case(shard, backend, dtype):
        gen = torch.Generator().manual_seed(3)
        full_logits = _logits((4, 6, shard.vocab), dtype, gen)
        # A reference near the policy, as in RL (|d| of order 1: the estimators' slopes stay finite).
        ref_logits = (full_logits.float() + torch.randn(full_logits.shape, generator=gen)).to(dtype)
        labels = torch.randint(0, shard.vocab, (4, 6), generator=gen)
        labels[0, 1] = -100
        mask = torch.rand(4, 6, generator=gen) > 0.2
        ref_lp = kltriton.token_logprobs(ref_logits, labels, mask=mask, temperature=1.3)
        make_ref = (lambda: ref_logits) if ref_form == "logits" else (lambda: ref_lp)

        def call(logits, ref, sharding):
            out = kltriton.token_kl(logits, ref, labels, estimator=estimator, mask=mask, temperature=1.3,
                                    backend=backend, **sharding)
            return out.kl, out.logprobs, out.ref_logprobs

        expected, actual, full, part = _run_both(shard, make_ref, call, full_logits)
        # The estimators scale the error of d = logp - ref_logp by their slope (exp(|d|) for k3, |d| for k2).
        slope = 1.0 + expected[0].abs().max().item()
        for name, e, a in zip(("kl", "logprobs", "ref_logprobs"), expected, actual):
            shard.check(a, e, full_logits, 1.3, f"{estimator} {name}", scale=slope if name == "kl" else 1.0)
        shard.check_grad(part, full, full_logits, 1.3, f"{estimator} grad", mixed=estimator == "full")
    return case


def case_fused_kl_reward_packed_full(shard, backend, dtype):
    """Packed and shifted, exact KL, scores and per-token rewards; gradient through reward and kl_per_seq."""
    gen = torch.Generator().manual_seed(4)
    full_logits = _logits((15, shard.vocab), dtype, gen)
    ref_logits = _logits((15, shard.vocab), dtype, gen)
    ids = torch.randint(0, shard.vocab, (15,), generator=gen)
    cu = torch.tensor([0, 6, 15])
    scores, rewards = torch.randn(2, generator=gen), torch.randn(15, generator=gen)

    def call(logits, ref, sharding):
        out = kltriton.fused_kl_reward(logits, ref, ids, coef=0.3, estimator="full", scores=scores,
                                       rewards=rewards, cu_seqlens=cu, shift_labels=True, temperature=0.9,
                                       backend=backend, **sharding)
        return out.reward, out.kl, out.logprobs, out.ref_logprobs, out.kl_per_seq

    expected, actual, full, part = _run_both(shard, lambda: ref_logits, call, full_logits)
    for name, e, a in zip(("reward", "kl", "logprobs", "ref_logprobs", "kl_per_seq"), expected, actual):
        shard.check(a, e, full_logits, 0.9, name)
    shard.check_grad(part, full, full_logits, 0.9, "grad", mixed=True)


def _policy_loss_case(loss_type, kl_estimator, aggregation):
    def case(shard, backend, dtype):
        """Global loss on every rank and each shard's gradient, with KL and entropy terms."""
        gen = torch.Generator().manual_seed(8)
        full_logits = _logits((3, 7, shard.vocab), dtype, gen)
        ref_logits = (full_logits.float() + torch.randn(full_logits.shape, generator=gen)).to(dtype)
        labels = torch.randint(0, shard.vocab, (3, 7), generator=gen)
        mask = torch.rand(3, 7, generator=gen) > 0.2
        old = kltriton.token_logprobs(full_logits, labels, mask=mask) + 0.1 * torch.randn(3, 7, generator=gen)
        advantages = torch.randn(3, generator=gen)

        def call(logits, ref, sharding):
            out = kltriton.policy_loss(logits, labels, advantages, old_logprobs=old, ref=ref, loss_type=loss_type,
                                       kl_coef=0.05, kl_estimator=kl_estimator, entropy_coef=0.01,
                                       aggregation=aggregation, mask=mask, temperature=0.8, backend=backend,
                                       **sharding)
            return (out.loss, out.logprobs, out.entropy, out.kl, out.ratio, out.metrics["clipfrac"])

        expected, actual, full, part = _run_both(shard, lambda: ref_logits, call, full_logits)
        for name, e, a in zip(("loss", "logprobs", "entropy", "kl", "ratio", "clipfrac"), expected, actual):
            shard.check(a, e, full_logits, 0.8, f"{loss_type} {name}", scale=1.0 + e.abs().max().item())
        shard.check_grad(part, full, full_logits, 0.8, f"{loss_type} grad", mixed=True)
    return case


def _divergence_case(divergence, teacher_form, reduction="none"):
    def case(shard, backend, dtype):
        """token_divergence with a teacher logits shard or a TopK teacher (global ids): the divergence, the
        student's entropy and the gradient of this rank's shard."""
        gen = torch.Generator().manual_seed(10)
        full_logits = _logits((3, 5, shard.vocab), dtype, gen)
        teacher = (full_logits.float() + torch.randn(full_logits.shape, generator=gen)).to(dtype)
        labels = torch.randint(0, shard.vocab, (3, 5), generator=gen)
        labels[0, 1] = -100
        ids = torch.topk(teacher.float(), 7, -1).indices
        ids[1, 2, -2:] = -1
        topk = kltriton.TopK(ids, torch.log_softmax(teacher.float(), -1).gather(-1, ids.clamp(min=0)))

        def call(logits, ref, sharding):
            out = kltriton.token_divergence(logits, topk if teacher_form == "topk" else ref, labels,
                                            divergence=divergence, beta=0.3, temperature=0.9, reduction=reduction,
                                            return_entropy=True, backend=backend, **sharding)
            return out

        expected, actual, full, part = _run_both(shard, lambda: teacher, call, full_logits)
        for name, e, a in zip(("divergence", "entropy"), expected, actual):
            shard.check(a, e, full_logits, 0.9, f"{divergence} {teacher_form} {name}", scale=1.0 + e.abs().max().item())
        shard.check_grad(part, full, full_logits, 0.9, f"{divergence} {teacher_form} grad", mixed=True)
    return case


def _linear_case(op):
    def case(shard, backend, dtype):
        """``LinearLogits`` with this rank's weight / bias rows ``[V_local, H]`` and replicated hidden
        states: outputs, the hidden gradient (all-reduced), the local weight and bias gradients."""
        gen = torch.Generator().manual_seed(9)
        hidden_size = 24
        hidden = torch.randn(3, 5, hidden_size, generator=gen).to(dtype)
        weight = (torch.randn(shard.vocab, hidden_size, generator=gen) / 2).to(dtype)
        bias = torch.randn(shard.vocab, generator=gen).to(dtype)
        ref_hidden = (hidden.float() + 0.3 * torch.randn(hidden.shape, generator=gen)).to(dtype)
        labels = torch.randint(0, shard.vocab, (3, 5), generator=gen)
        labels[0, 0] = shard.vocab - 1
        mask = torch.rand(3, 5, generator=gen) > 0.2
        advantages = torch.randn(3, generator=gen)
        old = torch.randn(3, 5, generator=gen) * 0.1 - 6.0
        topk_ids = torch.stack([torch.randperm(shard.vocab, generator=gen)[:6] for _ in range(15)]).view(3, 5, 6)
        topk_ids[0, 2, -1] = -1
        topk_logp = torch.log_softmax(torch.randn(3, 5, shard.vocab, generator=gen), -1).gather(
            -1, topk_ids.clamp(min=0))

        def call(h, w, b, sharding):
            rows = slice(shard.start, shard.stop) if sharding else slice(None)
            lin = kltriton.LinearLogits(h, w, b, softcap=20.0, tile_elements=64 * 100)
            ref = kltriton.LinearLogits(ref_hidden, weight[rows], softcap=20.0)
            if op == "logprobs":
                return kltriton.token_logprobs(lin, labels, mask=mask, return_entropy=True, temperature=0.9,
                                               backend=backend, **sharding)
            if op == "kl_full":
                out = kltriton.token_kl(lin, ref, labels, estimator="full", mask=mask, backend=backend, **sharding)
                return out.kl, out.logprobs, out.ref_logprobs
            if op == "divergence_jsd":
                return kltriton.token_divergence(lin, ref, labels, divergence="jsd", beta=0.3, mask=mask,
                                                 temperature=0.9, backend=backend, **sharding)
            if op == "divergence_topk":
                return kltriton.token_divergence(lin, kltriton.TopK(topk_ids, topk_logp), labels, mask=mask,
                                                 temperature=0.9, backend=backend, **sharding)
            out = kltriton.policy_loss(lin, labels, advantages, old_logprobs=old, ref=ref, kl_coef=0.05,
                                       entropy_coef=0.01, mask=mask, backend=backend, **sharding)
            return out.loss, out.logprobs, out.entropy, out.kl

        results = []
        for sharding, rows in (({}, slice(None)), ({"process_group": shard.group}, slice(shard.start, shard.stop))):
            params = [t.detach().requires_grad_() for t in (hidden, weight[rows], bias[rows])]
            outs = call(*params, sharding)
            outs = outs if isinstance(outs, tuple) else (outs,)
            g = torch.Generator().manual_seed(7)
            sum((t * torch.randn(t.shape, generator=g)).sum() for t in outs if t.requires_grad).backward()
            results.append((outs, params))
        (expected, full_params), (actual, part_params) = results
        logits = torch.nn.functional.linear(hidden.double(), weight.double(), bias.double())
        for i, (e, a) in enumerate(zip(expected, actual)):
            shard.check(a, e, logits, 0.9, f"{op} output {i}", scale=1.0 + e.abs().max().item())
        rows = slice(shard.start, shard.stop)
        for name, full, part, cut in (("hidden", *[p.grad for p in (full_params[0], part_params[0])], slice(None)),
                                      ("weight", full_params[1].grad, part_params[1].grad, rows),
                                      ("bias", full_params[2].grad, part_params[2].grad, rows)):
            expected_grad = full[cut]
            size = expected_grad.abs().max().item()
            # Each rank's part of the hidden gradient is rounded to the dtype before the all-reduce.
            rtol = 2 * MIXED_GRAD_RTOL[dtype]
            assert_close(part, expected_grad,
                         atol=rtol * size + 16 * value_atol(logits, 0.9) * size, rtol=rtol,
                         what=f"{op} d_{name}")
    return case


def case_head_outputs(shard, backend, dtype):
    """``outputs=`` (is_top1, mean_logits, log_sum_sq_probs) of vocab shards equal the unsharded call's: is_top1
    exactly, with maxima tied across the shards (the earlier id wins) and across the whole row."""
    gen = torch.Generator().manual_seed(9)
    vocab, cut = shard.vocab, SHARDS[dist.get_world_size()][0]
    full_logits = _logits((4, 6, vocab), dtype, gen)
    labels = torch.randint(0, vocab, (4, 6), generator=gen)
    labels[0, 0] = -100
    for col, (a, b, label) in enumerate(((cut - 1, cut + 1, cut + 1), (cut - 1, cut + 1, cut - 1),
                                         (0, vocab - 1, vocab - 1), (0, vocab - 1, 0))):
        full_logits[1, col, [a, b]] = 50.0
        labels[1, col] = label

    def call(logits, _ref, sharding):
        return kltriton.token_logprobs(logits, labels, temperature=0.8, backend=backend, **sharding,
                                       outputs=("entropy", "is_top1", "mean_logits", "log_sum_sq_probs"))

    expected, actual, full, part = _run_both(shard, lambda: None, call, full_logits)
    assert torch.equal(actual.is_top1, expected.is_top1)
    assert actual.is_top1[1, :4].tolist() == [False, True, False, True]
    assert not actual.is_top1[0, 0] and actual.mean_logits[0, 0] == 0 and actual.log_sum_sq_probs[0, 0] == 0
    for name in ("logp", "entropy", "mean_logits", "log_sum_sq_probs"):
        shard.check(getattr(actual, name), getattr(expected, name), full_logits, 0.8, name)
    shard.check_grad(part, full, full_logits, 0.8, "grad", mixed=True)


CASES = {
    "logprobs_padded_shifted": case_logprobs_padded_shifted,
    "head_outputs": case_head_outputs,
    "logprobs_packed": case_logprobs_packed,
    **{f"kl_{e}_{form}": _kl_case(e, form) for e in ("k1", "abs", "k2", "k3", "full")
       for form in ("logits",)},
    "kl_k3_ref_logprobs": _kl_case("k3", "logprobs"),
    "fused_kl_reward_packed_full": case_fused_kl_reward_packed_full,
    "policy_loss_ppo_full": _policy_loss_case("ppo", "full", "token-mean"),
    "policy_loss_gspo_k3": _policy_loss_case("gspo", "k3", "seq-mean-token-mean"),
    **{f"linear_{op}": _linear_case(op) for op in ("logprobs", "kl_full", "policy_loss", "divergence_jsd",
                                                   "divergence_topk")},
    **{f"divergence_{d}_{form}": _divergence_case(d, form)
       for d, form in (("forward_kl", "logits"), ("reverse_kl", "logits"), ("jsd", "logits"), ("jsd", "topk"),
                       ("reverse_kl", "topk"))},
    "divergence_jsd_batchmean": _divergence_case("jsd", "logits", "batchmean"),
}


def _raises(error, match, fn):
    try:
        fn()
    except error as exc:
        assert match in str(exc), f"{error.__name__} without {match!r}: {exc}"
        return
    raise AssertionError(f"no {error.__name__} ({match})")


def case_bad_input(shard, backend, dtype):
    """Errors are raised on every rank alike (they follow the shared small all-gather), so no rank hangs."""
    group = shard.group
    gen = torch.Generator().manual_seed(5)
    full_logits = _logits((5, shard.vocab), dtype, gen)
    part = shard.cut(full_logits)
    labels = torch.randint(0, shard.vocab, (5,), generator=gen)
    call = lambda **kw: kltriton.token_logprobs(part, kw.pop("labels", labels), backend=backend,  # noqa: E731
                                                **{"process_group": group, **kw})
    _raises(ValueError, "vocab_start", lambda: call(vocab_start=shard.start + (shard.rank == 1)))
    _raises(ValueError, "vocab_start", lambda: call(vocab_start=0))          # every rank claims [0, V_r)
    bad = labels.clone()
    bad[2] = shard.vocab
    _raises(ValueError, f"V={shard.vocab}", lambda: call(labels=bad))
    # The error names the shards the ranks hold: they cover [0, V) together, not the label's vocabulary.
    spans = ", ".join(f"rank {r}: [{a}, {b})" for r, (a, b) in enumerate(
        (sum(SHARDS[2][:r]), sum(SHARDS[2][:r + 1])) for r in range(2)))
    _raises(ValueError, spans, lambda: call(labels=bad))
    _raises(ValueError, "same leading shape", lambda: kltriton.token_logprobs(
        part[: 5 - shard.rank], labels[: 5 - shard.rank], process_group=group))
    _raises(ValueError, "process_group", lambda: kltriton.token_logprobs(part, labels, vocab_start=0))
    _raises(TypeError, "process_group", lambda: call(process_group="tp"))
    _raises(ValueError, "vocab_start", lambda: call(vocab_start=-1))
    # Validation off: a label past the global vocabulary gives NaN there and no gradient, like OUT_OF_RANGE.
    previous = kltriton.set_validation(False)
    try:
        logits = part.detach().requires_grad_()
        logp = kltriton.token_logprobs(logits, bad, backend=backend, process_group=group, vocab_start=shard.start)
        logp.sum().backward()  # upstream 1 at the NaN position too
    finally:
        kltriton.set_validation(previous)
    expected = kltriton.token_logprobs(full_logits, torch.where(bad < shard.vocab, bad, -100), backend=backend)
    assert torch.isnan(logp[2]) and torch.all(logits.grad[2] == 0)
    keep = torch.arange(5) != 2
    shard.check(logp[keep], expected[keep], full_logits, 1.0, "logp beside the bad label")


def case_compile(shard, backend, dtype):
    """``torch.compile(fullgraph=True)``, forward and backward: the all-gather is a functional
    collective, learned ``vocab_start`` included; equal to eager up to Inductor's fusions."""
    gen = torch.Generator().manual_seed(6)
    full_logits = _logits((2, 5, shard.vocab), dtype, gen)
    ref_logits = (full_logits.float() + torch.randn(full_logits.shape, generator=gen)).to(dtype)
    labels = torch.randint(0, shard.vocab, (2, 5), generator=gen)

    def f(logits, ref):
        out = kltriton.fused_kl_reward(logits, ref, labels, estimator="full", backend=backend,
                                       process_group=shard.group)
        return out.reward, out.logprobs

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        logits = shard.cut(full_logits, grad=True)
        reward, logp = fn(logits, shard.cut(ref_logits))
        (reward.sum() + logp.sum()).backward()
        results.append((reward, logp, logits.grad))
    for name, eager, compiled in zip(("reward", "logp", "grad"), *results):  # Inductor may fuse: ulps
        shard.check(compiled, eager, full_logits, 1.0, f"compiled {name}")

    # LinearLogits with a weight shard: the hidden gradient's all-reduce in the compiled backward.
    hidden = torch.randn(2, 5, 16, generator=gen).to(dtype)
    weight = torch.randn(shard.vocab, 16, generator=gen).to(dtype)[shard.start:shard.stop]

    def g(h, w):
        return kltriton.token_logprobs(kltriton.LinearLogits(h, w), labels, backend=backend,
                                       process_group=shard.group)

    results = []
    for fn in (g, torch.compile(g, fullgraph=True)):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logp = fn(h, w)
        logp.sum().backward()
        results.append((logp, h.grad, w.grad))
    scale = hidden.double().abs().sum(-1).max() * weight.double().abs().max()
    for name, eager, compiled in zip(("linear logp", "d_hidden", "d_weight"), *results):
        shard.check(compiled, eager, scale.reshape(1), 1.0, f"compiled {name}", scale=1.0 + eager.abs().max().item())


def _worker(rank, world, init_file, report_dir, backends, names):
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report = {}
    shard = Shard(rank, SHARDS[world], dist.group.WORLD)
    known = dict(CASES, bad_input=case_bad_input, compile=case_compile)
    cases = {name: known[name] for name in names}
    try:
        for name, case in cases.items():
            for backend in backends:
                if backend == "triton" and name not in TRITON_CASES:
                    continue
                for dtype in DTYPES if backend != "triton" else (torch.float32,):
                    record(report, f"{name}-{backend}-{str(dtype)[6:]}", case, shard, backend, dtype)
    finally:
        close_rank(report_dir, rank, report)
    exit_rank()  # every case ran


def _spawn(world, names, backends):
    """Run the cases ``names`` on ``world`` gloo ranks; returns each rank's ``{case key: "ok" | traceback}``."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, backends, names), nprocs=world)
        reports = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                reports.append(json.load(f))
        return reports


@pytest.fixture(scope="module")
def reports():
    """``{world: [rank report]}``, spawning each world size once, on first use."""
    done = {}

    def get(world):
        if world not in done:
            names = list(CASES) + (["bad_input"] if world == 2 else [])
            done[world] = _spawn(world, names, spawned_backends())
        return done[world]
    return get


def _assert_case(ranks, name):
    keys = [k for k in ranks[0] if k.startswith(name + "-")]
    assert keys, f"case {name} did not run"
    failures = [f"rank {r} {k}:\n{rep[k]}" for r, rep in enumerate(ranks) for k in keys if rep.get(k) != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_matches_unsharded(reports, world, name):
    _assert_case(reports(world), name)


def test_bad_input(reports):
    _assert_case(reports(2), "bad_input")


@pytest.mark.slow
def test_torch_compile_fullgraph():
    _assert_case(_spawn(2, ["compile"], ["cpp" if dispatch.availability("cpp", "stream")[0] else "reference"]),
                 "compile")


def _nccl_worker(rank, init_file, report_dir):
    """One rank on one GPU: the NCCL group of size 1 against the ungrouped ops (CUDA, Triton)."""
    report = {}
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
        group = dist.group.WORLD
        gen = torch.Generator().manual_seed(11)
        logits = _logits((4, 6, 1001), torch.bfloat16, gen).cuda()
        ref = (logits.float() + torch.randn(logits.shape, generator=gen).cuda()).to(torch.bfloat16)
        labels = torch.randint(0, 1001, (4, 6), generator=gen).cuda()
        hidden = torch.randn(4, 6, 32, generator=gen).cuda()
        weight = torch.randn(1001, 32, generator=gen).cuda()
        for name, call in (
            ("token_kl_full", lambda x, **kw: kltriton.token_kl(x, ref, labels, estimator="full", **kw).kl),
            ("linear_logprobs", lambda w, **kw: kltriton.token_logprobs(kltriton.LinearLogits(hidden, w), labels,
                                                                        **kw)),
        ):
            base = logits if name == "token_kl_full" else weight
            results = []
            for sharding in ({}, {"process_group": group}):
                x = base.detach().requires_grad_()
                out = call(x, **sharding)
                out.sum().backward()
                results.append((out, x.grad))
            (e_out, e_grad), (a_out, a_grad) = results
            tol = 1e-4 * (1 + e_out.abs().max().item())
            assert_close(a_out, e_out, atol=tol, rtol=1e-4, what=f"nccl {name}")
            assert_close(a_grad, e_grad, atol=1e-3 * e_grad.abs().max().item(), rtol=2e-2, what=f"nccl {name} grad")
            report[name] = "ok"
    except Exception:  # noqa: BLE001 - reported to the parent
        report["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(report_dir, "rank0.json"), "w") as f:
            json.dump(report, f)
        leave_world()


@pytest.mark.skipif(os.environ.get("KLTRITON_TEST_DEVICE", "cpu") != "cuda",
                    reason="NCCL needs a GPU (KLTRITON_TEST_DEVICE=cuda)")
def test_nccl_group_of_one():
    """The NCCL path with one rank (one GPU: multi-GPU NCCL stays untested): equal to the ungrouped ops."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=1)
        with open(os.path.join(tmp, "rank0.json")) as f:
            report = json.load(f)
    assert report == {"token_kl_full": "ok", "linear_logprobs": "ok"}, report.get("error", report)
