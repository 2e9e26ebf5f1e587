"""The invariant mode (``kltriton.set_invariant``): results bitwise independent of the batch composition, the
``LinearLogits`` tile size, the kernels' block sizes (``tests/kernels/test_invariant_kernels.py``), the replay
padding and the number of vocab shards, on every backend; within fp32 tolerances of the float64 oracle; clear errors
for what it does not cover.

The vocab-shard cases run on 1, 2 and 3 spawned ``gloo`` ranks over the same vocabulary (uneven shards, one of a
single id): every rank compares its sharded outputs and gradients, bit for bit, with the unsharded call on the full
tensors in the same process. One spawn per world size runs every case; the tests read the reports.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kltriton
from helpers import (
    MIXED_GRAD_RTOL, assert_close, awkward_logits, close_rank, exit_rank, grad_tols, random_labels, record,
    spawned_backends, value_atol)
from kltriton import dispatch
from kltriton.kernels.constants import ENTROPY, INVARIANT
from kltriton.kernels.linear import fixed

SMALL_GEOMETRY = (16, 64)  # GEMMs of 16 rows x 64 ids: windows, an overlapping last one and padding at test sizes


@pytest.fixture
def invariant():
    previous = kltriton.set_invariant(True)
    yield
    kltriton.set_invariant(previous)


@pytest.fixture
def small_gemms(monkeypatch):
    monkeypatch.setattr(fixed, "DEFAULT_GEOMETRY", SMALL_GEOMETRY)
    monkeypatch.setattr(fixed, "GEOMETRY", {})


def _logits(shape, dtype, gen, scale=3.0):
    """Fresh logits with ``-inf``, ``finfo.min``, a large row and ties."""
    return awkward_logits(shape, dtype, gen, scale, ties=True)


def _grads(fn, *tensors, seed=7):
    """``fn(*leaves)``'s outputs (a tuple) and the leaves' gradients of a random weighted sum of them."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    total = sum((torch.where(torch.isfinite(o), o, 0) * torch.randn(o.shape, generator=gen)).sum()
                for o in outs if o.requires_grad)
    total.backward()
    return tuple(o.detach() for o in outs), tuple(leaf.grad for leaf in leaves)


def _same(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what}[{i}]"
        if x is not None:
            assert torch.equal(x, y), f"{what}[{i}]: max difference {(x.double() - y.double()).abs().max().item()}"


# --- the switch ------------------------------------------------------------------------------------------------

def test_set_invariant_returns_the_previous_setting():
    previous = kltriton.set_invariant(True)
    try:
        assert kltriton.set_invariant(False) is True
        assert kltriton.set_invariant(True) is False
    finally:
        kltriton.set_invariant(previous)


def test_environment_variable():
    code = "import kltriton.invariant as i; print(i.enabled())"
    env = dict(os.environ, KLTRITON_INVARIANT="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    env["KLTRITON_INVARIANT"] = "sometimes"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "KLTRITON_INVARIANT='sometimes' is not a flag" in done.stderr


# --- one process -----------------------------------------------------------------------------------------------

def test_matches_float64(invariant, backend, dtype):
    """Log-probs, entropy and their logits gradient against the float64 oracle (the default mode's reference)."""
    gen = torch.Generator().manual_seed(1)
    logits = _logits((5, 7, 301), dtype, gen)
    labels = random_labels((5, 7), 301)
    temperature = torch.rand(5, 7, generator=gen, dtype=torch.float64) + 0.5

    def call(x, backend=backend):
        return kltriton.token_logprobs(x, labels, temperature=temperature, return_entropy=True, backend=backend)

    (logp, entropy), (grad,) = _grads(call, logits)
    kltriton.set_invariant(False)
    (logp64, entropy64), (grad64,) = _grads(lambda x: call(x, "reference"), logits.double())
    kltriton.set_invariant(True)
    atol = value_atol(logits, 0.5)
    assert_close(logp, logp64, atol=atol, rtol=1e-6, what="logp")
    assert_close(entropy, entropy64, atol=atol, rtol=1e-6, what="entropy")
    upstream = torch.ones(1) * 3  # the weights _grads draws are normal: |w| < 3 here
    g_atol, _ = grad_tols(logits, 0.5, upstream)
    assert_close(grad, grad64, atol=g_atol, rtol=MIXED_GRAD_RTOL[dtype], what="grad")


def test_batch_composition(invariant, backend):
    """A row's outputs and gradient: the same bits in another order, or in a smaller batch."""
    gen = torch.Generator().manual_seed(2)
    logits = _logits((18, 257), torch.float32, gen)
    labels = random_labels((18,), 257)
    w_logp, w_entropy = torch.randn(18, generator=gen), torch.randn(18, generator=gen)

    def run(rows):
        x = logits[rows].detach().requires_grad_()
        logp, entropy = kltriton.token_logprobs(x, labels[rows], temperature=0.8, return_entropy=True,
                                                backend=backend)
        (logp * w_logp[rows] + entropy * w_entropy[rows]).sum().backward()
        return logp.detach(), entropy.detach(), x.grad

    base = run(torch.arange(18))
    for rows in (torch.randperm(18, generator=gen), torch.tensor([11, 4]), torch.tensor([7])):
        _same(run(rows), tuple(t[rows] for t in base), f"rows {rows.tolist()}")


@pytest.mark.parametrize("vocab", [203, 40])
def test_linear_tile_sizes(invariant, backend, small_gemms, vocab):
    """``LinearLogits``: the same bits for every tile budget (whole rows held, or each GEMM window built twice),
    logits and the weight and bias gradients; within tolerance of the float64 oracle."""
    gen = torch.Generator().manual_seed(3)
    n, h = 37, 12
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(vocab, h, generator=gen) * 0.5
    bias = torch.randn(vocab, generator=gen)
    labels = random_labels((n,), vocab)

    def call(tile):
        return lambda x, w, b: kltriton.token_logprobs(kltriton.LinearLogits(x, w, b, softcap=20.0, tile_elements=tile),
                                                       labels, return_entropy=True, backend=backend)

    base, base_grads = _grads(call(None), hidden, weight, bias)
    for tile in (1, 16 * vocab, 10 ** 9):
        outs, grads = _grads(call(tile), hidden, weight, bias)
        _same(outs, base, f"tile {tile}")
        _same(grads[1:], base_grads[1:], f"tile {tile} grads")
    kltriton.set_invariant(False)
    expected = kltriton.token_logprobs(kltriton.LinearLogits(hidden.double(), weight.double(), bias.double(),
                                                             softcap=20.0), labels, return_entropy=True,
                                       backend="reference")
    kltriton.set_invariant(True)
    for got, want in zip(base, expected):
        assert_close(got, want, atol=1e-5, rtol=1e-5, what="linear vs float64")


def test_truncation(invariant, backend):
    """Recompute mode (fixed-point top-p masses, the floor by selection): within tolerance of the float64 oracle with
    the same kept sets, and the same bits for a row in another batch."""
    gen = torch.Generator().manual_seed(4)
    n, vocab = 9, 401
    logits = _logits((n, vocab), torch.float32, gen)
    labels = torch.argmax(logits, -1)
    labels[4], labels[6] = 7, -100
    truncation = kltriton.Truncation(top_k=torch.tensor([0, 5, 50, 0, 3, 0, 10, 0, 200]),
                                     top_p=torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.9, 1.0, 0.7, 0.999],
                                                        dtype=torch.float64), min_p=0.01)

    def call(x, rows=slice(None), backend=backend):
        knobs = kltriton.Truncation(top_k=truncation.top_k[rows], top_p=truncation.top_p[rows], min_p=0.01)
        return kltriton.token_logprobs(x, labels[rows], truncation=knobs, temperature=0.9, return_entropy=True,
                                       backend=backend)

    (logp, entropy), (grad,) = _grads(call, logits)
    kltriton.set_invariant(False)
    (logp64, entropy64), (grad64,) = _grads(lambda x: call(x, backend="reference"), logits.double())
    kltriton.set_invariant(True)
    atol = value_atol(logits, 0.9)
    assert_close(logp, logp64, atol=atol, rtol=1e-6, what="logp")
    assert_close(entropy, entropy64, atol=atol, rtol=1e-6, what="entropy")
    assert_close(grad, grad64, atol=4 * atol, rtol=MIXED_GRAD_RTOL[torch.float32], what="grad")
    rows = torch.tensor([8, 3, 1])
    (r_logp, r_entropy), (r_grad,) = _grads(lambda x: call(x, rows), logits[rows])
    assert torch.equal(r_logp, logp[rows]) and torch.equal(r_entropy, entropy[rows])


def test_replay_padding_width(invariant, backend):
    gen = torch.Generator().manual_seed(5)
    logits = _logits((6, 301), torch.float32, gen)
    support = logits.topk(12, dim=-1).indices
    labels = support[:, 3].clone()
    results = []
    for pad in (0, 5, 40):
        ids = torch.cat([support, torch.full((6, pad), -1)], 1)[:, torch.randperm(12 + pad, generator=gen)]
        results.append(_grads(lambda x: kltriton.token_logprobs(x, labels, truncation=kltriton.Truncation(support=ids),
                                                                return_entropy=True, backend=backend), logits))
    for other in results[1:]:
        _same(other[0] + other[1], results[0][0] + results[0][1], "replay")


def test_every_function_scores_the_same(invariant, backend):
    """``token_kl`` (per-token estimators), ``fused_kl_reward`` and ``policy_loss`` (its two-pass route) read the
    invariant log-probs of the policy and the reference."""
    gen = torch.Generator().manual_seed(6)
    logits = _logits((4, 5, 211), torch.float32, gen)
    ref = _logits((4, 5, 211), torch.bfloat16, gen)
    labels = random_labels((4, 5), 211)
    logp = kltriton.token_logprobs(logits, labels, backend=backend)
    ref_logp = kltriton.token_logprobs(ref, labels, backend=backend)
    out = kltriton.token_kl(logits, ref, labels, estimator="k3", backend=backend)
    assert torch.equal(out.logprobs, logp) and torch.equal(out.ref_logprobs, ref_logp)
    reward = kltriton.fused_kl_reward(logits, ref, labels, estimator="k1", backend=backend)
    assert torch.equal(reward.kl, logp - ref_logp)
    x = logits.detach().requires_grad_()
    # k1: a bounded gradient (k3's exp(ref_logp - logp) overflows fp32 where a large row's label is far below its
    # maximum, in either mode)
    loss = kltriton.policy_loss(x, labels, torch.randn(4, generator=gen), ref=ref, kl_coef=0.1, kl_estimator="k1",
                                backend=backend)
    loss.loss.backward()
    assert torch.equal(loss.logprobs, logp) and torch.equal(loss.ref_logprobs, ref_logp)
    assert torch.isfinite(x.grad).all()


def test_compiled_equals_eager(invariant, backend):
    """``torch.compile`` (inductor, fullgraph) gives eager's log-probs, entropies and logits gradient bit for bit: the
    float64 finalization of the sums is an op of its own, so the compiled graph cannot fuse or reorder it."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)
    logits, ref = _logits((3, 5, 211), torch.float32, gen), _logits((3, 5, 211), torch.float32, gen)
    labels = random_labels((3, 5), 211)

    def call(x):
        logp, entropy = kltriton.token_logprobs(x, labels, temperature=0.7, return_entropy=True, backend=backend)
        kl = kltriton.token_kl(x, ref, labels, estimator="k3", temperature=0.7, backend=backend)
        return logp, entropy, kl.logprobs, kl.ref_logprobs  # (the estimator's float32 arithmetic inductor may fuse)

    compiled_outs, compiled_grads = _grads(torch.compile(call, backend="inductor", fullgraph=True), logits)
    eager_outs, eager_grads = _grads(call, logits)
    _same(compiled_outs + compiled_grads, eager_outs + eager_grads, "compiled")


def test_opcheck(backend):
    """The invariant ops, and the truncation op in this mode, as ``torch.library`` custom ops (schema, fake tensors,
    no aliasing, autograd registration): ``opcheck``. (The statistics op's are in ``test_torch_library`` and
    ``test_linear_logits``.)"""
    from kltriton.ops import invariant as ops
    from kltriton.ops import truncation as truncation_ops

    gen = torch.Generator().manual_seed(9)
    logits = _logits((6, 67), torch.float32, gen)
    target = random_labels((6,), 67).clamp(min=-1)
    temperature = torch.tensor(0.8, dtype=torch.float64)
    floor = torch.full((6,), -1.0)
    row_max, sums = ops.forward(logits, target, temperature, None, ENTROPY, backend)
    label = logits.gather(1, target.clamp(min=0)[:, None]).squeeze(1).double()
    knobs = (torch.zeros(6, dtype=torch.int64), torch.ones(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64))
    cases = [(ops._maxima, (logits, target, floor, backend)),
             (ops._sums, (logits, target, temperature, row_max, None, ENTROPY, backend)),
             (ops._forward, (logits, target, temperature, floor, 0, backend)),
             (ops._finalize, (row_max, sums, label, target >= 0, target, temperature, ENTROPY, torch.float32)),
             # the truncation op in this mode: the invariant sums above the floor it is given
             (truncation_ops._forward_op, (logits.requires_grad_(), target, temperature, *knobs, floor,
                                           ENTROPY | INVARIANT, backend))]
    for op, args in cases:
        torch.library.opcheck(op.overload, op.flatten(*args))


def test_what_it_does_not_cover(invariant):
    gen = torch.Generator().manual_seed(7)
    logits = _logits((4, 50), torch.float32, gen)
    labels = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="estimator='full'.*invariant mode"):
        kltriton.token_kl(logits, logits + 1, labels, estimator="full")
    with pytest.raises(ValueError, match="estimator='full'.*invariant mode"):
        kltriton.policy_loss(logits, labels, torch.ones(4), ref=logits + 1, kl_coef=0.1, kl_estimator="full")
    with pytest.raises(ValueError, match="token_divergence is not available in the invariant mode"):
        kltriton.token_divergence(logits, logits + 1, labels)
    topk = kltriton.TopK(logits.topk(4).indices, logits.log_softmax(-1).topk(4).values)
    with pytest.raises(ValueError, match="token_divergence is not available in the invariant mode"):
        kltriton.token_divergence(logits, topk, labels)


def test_a_backend_without_the_family(invariant, monkeypatch):
    implements = dispatch._implements
    monkeypatch.setattr(dispatch, "_implements", lambda family, backend: family != "invariant" and
                        implements(family, backend))
    dispatch.availability.cache_clear()  # found once per process
    try:
        with pytest.raises(RuntimeError, match="backend='reference' cannot run the 'invariant' family"):
            kltriton.token_logprobs(torch.randn(2, 9), torch.tensor([1, 2]), backend="reference")
    finally:
        dispatch.availability.cache_clear()


# --- vocab shards: 1, 2 and 3 gloo ranks -----------------------------------------------------------------------

VOCAB = 1001
SHARDS = {1: (1001,), 2: (600, 401), 3: (333, 1, 667)}


class Shard:
    def __init__(self, rank, world, group):
        sizes = SHARDS[world]
        self.rank, self.world, self.group = rank, world, group
        self.start = sum(sizes[:rank])
        self.stop = self.start + sizes[rank]

    def cut(self, full):
        return full[..., self.start:self.stop]


def _compare(shard, call, full_tensors, cut, what):
    """``call(*tensors, sharding)`` on the full tensors and on this rank's (``cut``: which tensors to cut along the
    vocab); outputs and the gradients of the cut tensors (of their shard), bit for bit."""
    expected, e_grads = _grads(lambda *t: call(*t, {}), *full_tensors)
    parts = [shard.cut(t) if c else t for t, c in zip(full_tensors, cut)]
    actual, a_grads = _grads(lambda *t: call(*t, {"process_group": shard.group}), *parts)
    _same(actual, expected, what)
    for i, c in enumerate(cut):
        if c and a_grads[i] is not None:
            _same((a_grads[i],), (shard.cut(e_grads[i]),), f"{what} grad {i}")


def case_logprobs(shard, backend, dtype):
    gen = torch.Generator().manual_seed(11)
    logits = _logits((3, 9, VOCAB), dtype, gen)[:, :-1]
    ids = torch.randint(0, VOCAB, (3, 8), generator=gen)
    ids[0, 3], ids[1, 4] = VOCAB - SHARDS[shard.world][-1], VOCAB - 1  # the last shard's first and last ids
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5:] = False
    temperature = torch.rand(3, 8, generator=gen, dtype=torch.float64) + 0.5

    def call(x, sharding):
        return kltriton.token_logprobs(x, ids, mask=mask, shift_labels=True, return_entropy=True,
                                       temperature=temperature, backend=backend, **sharding)

    _compare(shard, call, (logits,), (True,), "logprobs")


def case_kl(shard, backend, dtype):
    gen = torch.Generator().manual_seed(12)
    logits = _logits((13, VOCAB), dtype, gen)
    ref = _logits((13, VOCAB), torch.float32, gen)
    labels = torch.randint(0, VOCAB, (13,), generator=gen)
    labels[[3, 9]] = -100

    def call(x, sharding):
        r = shard.cut(ref) if sharding else ref
        return tuple(kltriton.token_kl(x, r, labels, estimator="k3", temperature=0.7, backend=backend, **sharding))

    _compare(shard, call, (logits,), (True,), "kl")


def case_policy_loss(shard, backend, dtype):
    gen = torch.Generator().manual_seed(13)
    logits = _logits((4, 6, VOCAB), dtype, gen)
    labels = torch.randint(0, VOCAB, (4, 6), generator=gen)
    adv, old = torch.randn(4, generator=gen), -torch.rand(4, 6, generator=gen) * 3

    def call(x, sharding):
        out = kltriton.policy_loss(x, labels, adv, old_logprobs=old, entropy_coef=0.01, backend=backend, **sharding)
        return out.loss, out.logprobs, out.entropy

    _compare(shard, call, (logits,), (True,), "policy_loss")


def case_linear(shard, backend, dtype):
    gen = torch.Generator().manual_seed(14)
    hidden = torch.randn(2, 19, 12, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, 12, generator=gen) * 0.5).to(dtype)
    bias = torch.randn(VOCAB, generator=gen).to(dtype)
    labels = torch.randint(0, VOCAB, (2, 19), generator=gen)
    labels[0, :3] = -100

    def call(h, w, b, sharding):
        return kltriton.token_logprobs(kltriton.LinearLogits(h, w, b, logit_scale=0.7, tile_elements=16 * 400),
                                       labels, return_entropy=True, backend=backend, **sharding)

    # the hidden gradient is a sum over the vocabulary (GEMM blocks, ranks): not compared bit for bit
    expected, e_grads = _grads(lambda w, b: call(hidden, w, b, {}), weight, bias)
    actual, a_grads = _grads(lambda w, b: call(hidden, w, b, {"process_group": shard.group}),
                             weight[shard.start:shard.stop], bias[shard.start:shard.stop])
    _same(actual, expected, "linear")
    _same(a_grads, tuple(g[shard.start:shard.stop] for g in e_grads), "linear weight and bias grads")


def case_truncation(shard, backend, dtype):
    gen = torch.Generator().manual_seed(15)
    n = 10
    logits = _logits((n, VOCAB), dtype, gen)
    logits[4, 100:400] = logits[4].max()  # a tie across shards at the top
    labels = torch.argmax(logits, -1)
    labels[5], labels[7] = 3, -100
    truncation = kltriton.Truncation(top_k=torch.tensor([0, 5, 50, 0, 3, 0, 10, 0, 200, 600]),
                                     top_p=torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.9, 1.0, 0.7, 0.999, 0.8],
                                                        dtype=torch.float64), min_p=0.02)

    def call(x, sharding):
        return kltriton.token_logprobs(x, labels, truncation=truncation, temperature=0.9, return_entropy=True,
                                       backend=backend, **sharding)

    _compare(shard, call, (logits,), (True,), "truncation")


def case_truncation_linear(shard, backend, dtype):
    gen = torch.Generator().manual_seed(16)
    hidden = torch.randn(21, 8, generator=gen)
    weight = torch.randn(VOCAB, 8, generator=gen)
    labels = torch.randint(0, VOCAB, (21,), generator=gen)

    def call(w, sharding):
        return kltriton.token_logprobs(kltriton.LinearLogits(hidden, w), labels, return_entropy=True, backend=backend,
                                       truncation=kltriton.Truncation(top_k=40, top_p=0.9), **sharding)

    expected, e_grads = _grads(lambda w: call(w, {}), weight)
    actual, a_grads = _grads(lambda w: call(w, {"process_group": shard.group}), weight[shard.start:shard.stop])
    _same(actual, expected, "truncation linear")
    _same(a_grads, (e_grads[0][shard.start:shard.stop],), "truncation linear grad")


def case_replay(shard, backend, dtype):
    gen = torch.Generator().manual_seed(17)
    logits = _logits((7, VOCAB), dtype, gen)
    support = torch.cat([logits.float().topk(20, dim=-1).indices, torch.full((7, 3), -1)], 1)
    labels = support[:, 2].clone()

    def call(x, sharding):
        return kltriton.token_logprobs(x, labels, truncation=kltriton.Truncation(support=support),
                                       return_entropy=True, backend=backend, **sharding)

    _compare(shard, call, (logits,), (True,), "replay")


def case_dtensor(shard, backend, dtype):
    """Logits as a DTensor sharded on the vocabulary of a 1-D mesh (``torch.chunk`` shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as Placement, distribute_tensor

    mesh = init_device_mesh("cpu", (shard.world,))
    gen = torch.Generator().manual_seed(18)
    logits = _logits((2, 7, VOCAB), dtype, gen)
    labels = torch.randint(0, VOCAB, (2, 7), generator=gen)

    def call(x):
        return kltriton.token_logprobs(x, labels, return_entropy=True, temperature=1.3, backend=backend)

    expected, (e_grad,) = _grads(call, logits)
    actual, (a_grad,) = _grads(call, distribute_tensor(logits, mesh, [Placement(-1)]))
    _same(actual, expected, "dtensor")
    _same((a_grad.full_tensor(),), (e_grad,), "dtensor grad")


CASES = {"logprobs": case_logprobs, "kl": case_kl, "policy_loss": case_policy_loss, "linear": case_linear,
         "truncation": case_truncation, "truncation_linear": case_truncation_linear, "replay": case_replay,
         "dtensor": case_dtensor}
TRITON_CASES = ("logprobs", "truncation")
DTYPES = {"logprobs": (torch.float32, torch.bfloat16), "truncation": (torch.float32, torch.bfloat16)}


def _worker(rank, world, init_file, report_dir, backends):
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    kltriton.set_invariant(True)
    fixed.DEFAULT_GEOMETRY, fixed.GEOMETRY = SMALL_GEOMETRY, {}
    shard, report = Shard(rank, world, dist.group.WORLD), {}
    try:
        for name, case in CASES.items():
            for backend in backends:
                if backend == "triton" and name not in TRITON_CASES:
                    continue
                for dtype in DTYPES.get(name, (torch.float32,)):
                    record(report, f"{name}-{backend}-{str(dtype)[6:]}", case, shard, backend, dtype)
    finally:
        close_rank(report_dir, rank, report)
    exit_rank()  # every case ran


@pytest.fixture(scope="module")
def reports():
    done = {}

    def get(world):
        if world not in done:
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, spawned_backends("invariant")), nprocs=world)
                done[world] = []
                for rank in range(world):
                    with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                        done[world].append(json.load(f))
        return done[world]
    return get


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_vocab_shards(reports, world, name):
    ranks = reports(world)
    keys = [k for k in ranks[0] if k.startswith(name + "-")]
    assert keys, f"case {name} did not run"
    failures = [f"rank {r} {k}:\n{rep[k]}" for r, rep in enumerate(ranks) for k in keys if rep.get(k) != "ok"]
    assert not failures, "\n".join(failures)
