"""DTensor inputs through every public function, over 2 spawned gloo ranks on CPU.

Every rank builds the same full tensors and distributes them (``distribute_tensor``) over a 1-D mesh ``(2,)`` or a
2-D mesh ``(dp, tp)`` of ``(1, 2)`` (the vocabulary split, the batch whole) or ``(2, 1)`` (the batch split, the
vocabulary whole on a one-rank mesh dimension). Each case checks:

- the outputs and gradients equal, bitwise, the same call on the local tensors with ``process_group=`` (the
  DTensor front door adds nothing but the unwrapping), and the unsharded float64 call within the vocab-parallel
  tolerances (``test_vocab_parallel.py``'s: fp32 rounding of the merged per-row statistics);
- the gradient of a DTensor input is a DTensor with the input's placements;
- per-token outputs are plain tensors of this rank's rows.

The vocabulary (V = 1001) splits unevenly over 2 ranks (501 / 500, as ``torch.chunk`` splits it). Spawning ranks costs
seconds, so one spawn runs every case and the tests read its reports.
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
from helpers import (
    MIXED_GRAD_RTOL, assert_close, close_rank, exit_rank, leave_world, raises_with, record, spawned_backends,
    value_atol)

VOCAB = 1001


def _dt():
    import torch.distributed.tensor as dt
    return dt


def _logits(shape, dtype, seed, scale=3.0):
    """Fresh random logits with a ``-inf`` and a ``finfo.min`` entry (on both shards)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * scale
    flat = x.view(-1, shape[-1])
    flat[0, 5] = float("-inf")
    flat[1, -3] = torch.finfo(dtype).min
    return x.to(dtype)


class Mesh:
    """A mesh and where it splits: ``vocab_dim`` the mesh dimension that shards the vocabulary, ``batch_dim`` the one
    that shards the batch (None: none)."""

    def __init__(self, shape):
        from torch.distributed.device_mesh import init_device_mesh
        self.shape = shape
        names = ("tp",) if len(shape) == 1 else ("dp", "tp")
        self.mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        self.vocab_dim = len(shape) - 1
        self.batch_dim = 0 if len(shape) == 2 else None

    def placements(self, vocab: bool, batch: bool = True):
        """Placements of a tensor whose last dim is the vocabulary (``vocab``) and whose first is the batch."""
        dt = _dt()
        out = [dt.Replicate()] * len(self.shape)
        if self.batch_dim is not None and batch:
            out[self.batch_dim] = dt.Shard(0)
        if vocab:
            out[self.vocab_dim] = dt.Shard(-1)
        return out

    def distribute(self, full, vocab: bool, grad: bool = False, batch: bool = True):
        value = _dt().distribute_tensor(full.detach(), self.mesh, self.placements(vocab, batch))
        return value.requires_grad_() if grad else value

    def rows(self, full):
        """This rank's rows of a full ``[B, ...]`` tensor (the batch split of the ``dp`` dimension)."""
        if self.batch_dim is None:
            return full
        parts = self.mesh.size(self.batch_dim)
        return full.chunk(parts)[self.mesh.get_local_rank(self.batch_dim)]

    def vocab_range(self):
        parts, me = self.mesh.size(self.vocab_dim), self.mesh.get_local_rank(self.vocab_dim)
        chunk = -(-VOCAB // parts)
        return min(me * chunk, VOCAB), min((me + 1) * chunk, VOCAB)

    @property
    def group(self):
        return None if self.mesh.size(self.vocab_dim) == 1 else self.mesh.get_group(self.vocab_dim)


def _backward(outputs, seed=7):
    """The same random upstream gradient on every differentiable output (floating, ``requires_grad``)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    sum((t * torch.randn(t.shape, generator=gen)).sum() for t in tensors).backward()


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def _check_grad_placements(leaf, what):
    assert leaf.grad is not None, f"{what}: no gradient"
    assert type(leaf.grad).__name__ == "DTensor", f"{what}: the gradient is a {type(leaf.grad).__name__}"
    assert tuple(leaf.grad.placements) == tuple(leaf.placements), \
        f"{what}: gradient placements {leaf.grad.placements} != {leaf.placements}"


def _compare(dtensor_out, group_out, float64_out, what, atol, rtol=0.0):
    """Bitwise against the ``process_group=`` call; within tolerance against the float64 call."""
    for i, (a, b, c) in enumerate(zip(dtensor_out, group_out, float64_out)):
        assert type(a) is torch.Tensor, f"{what}[{i}]: a {type(a).__name__}, not a plain tensor"
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num()), \
            f"{what}[{i}]: not bitwise equal to the process_group= call (max diff {(a - b).abs().max()})"
        assert_close(a, c.to(a.dtype), atol=atol, rtol=rtol, what=f"{what}[{i}] vs float64")


def _three_calls(fn, mesh, dtensor_args, local_args, full_args):
    """``fn`` on DTensors, on their local tensors with ``process_group=``, and on the full float64 tensors."""
    return (fn(*dtensor_args, {}), fn(*local_args, {"process_group": mesh.group} if mesh.group else {}),
            fn(*full_args, {"backend": "reference"}))


def _as_tuple(out):
    return tuple(out) if isinstance(out, tuple) else (out,)


def case_logits(mesh, backend, dtype):
    """Every public function with ``Shard(-1)`` logits (and reference logits): values and logits gradients."""
    full = _logits((4, 6, VOCAB), dtype, 1)
    ref_full = _logits((4, 6, VOCAB), torch.float32, 2)
    labels_full = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    labels_full[0, 2] = -100
    adv_full = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    old_full = -torch.rand(4, 6, generator=torch.Generator().manual_seed(5)) * 3
    start, stop = mesh.vocab_range()
    calls = {
        "token_logprobs": lambda x, r, y, a, o, kw: kltriton.token_logprobs(
            x, y, return_entropy=True, temperature=0.8, backend=kw.pop("backend", backend), **kw),
        "token_kl": lambda x, r, y, a, o, kw: tuple(kltriton.token_kl(
            x, r, y, estimator="k3", backend=kw.pop("backend", backend), **kw)),
        "fused_kl_reward": lambda x, r, y, a, o, kw: tuple(kltriton.fused_kl_reward(
            x, r, y, coef=0.1, scores=torch.ones(_local(y).shape[0]), backend=kw.pop("backend", backend),
            **kw))[:4],
        "policy_loss": lambda x, r, y, a, o, kw: (lambda out: (out.loss, out.logprobs, out.ratio))(kltriton.policy_loss(
            x, y, a, old_logprobs=o, ref=r, kl_coef=0.05, entropy_coef=0.01, backend=kw.pop("backend", backend),
            **kw)),
        "token_divergence_jsd": lambda x, r, y, a, o, kw: kltriton.token_divergence(
            x, r, y, divergence="jsd", beta=0.3, backend=kw.pop("backend", backend), **kw),
        "token_divergence_forward": lambda x, r, y, a, o, kw: kltriton.token_divergence(
            x, r, y, divergence="forward_kl", backend=kw.pop("backend", backend), **kw),
    }
    for name, fn in calls.items():
        x_dt = mesh.distribute(full, vocab=True, grad=True)
        r_dt = mesh.distribute(ref_full, vocab=True)
        y_dt, a_dt = mesh.distribute(labels_full, vocab=False), mesh.distribute(adv_full, vocab=False)
        o_dt = mesh.distribute(old_full, vocab=False)
        x_local = x_dt.to_local().detach().requires_grad_()
        rows = mesh.rows
        x64 = rows(full).double().requires_grad_()
        outs = _three_calls(fn, mesh, (x_dt, r_dt, y_dt, a_dt, o_dt),
                            (x_local, r_dt.to_local(), rows(labels_full), rows(adv_full), rows(old_full)),
                            (x64, rows(ref_full).double(), rows(labels_full), rows(adv_full), rows(old_full)))
        for out, leaf in zip(outs, (x_dt, x_local, x64)):
            _backward(_as_tuple(out))
        got, by_group, exact = (_as_tuple(o) for o in outs)
        tol = 32 * value_atol(full, 0.8)
        _compare(got, by_group, exact, f"{name} {mesh.shape} {backend} {dtype}", atol=tol * 50, rtol=tol)
        _check_grad_placements(x_dt, name)
        grad, expected = x_dt.grad.to_local(), x64.grad[..., start:stop]
        assert torch.equal(grad, x_local.grad), f"{name}: gradient not bitwise the process_group= call's"
        size = expected[torch.isfinite(expected)].abs().max().item()
        assert_close(grad, expected.to(grad.dtype), atol=4 * tol * size + MIXED_GRAD_RTOL[dtype] * size / 4,
                     rtol=MIXED_GRAD_RTOL[dtype], what=f"{name} gradient vs float64")


def case_linear(mesh, backend, dtype):
    """A tensor-parallel LM head: ``Shard(0)`` weight and bias, ``Replicate`` hidden states; gradients of all three
    come back as DTensors with their placements."""
    dt = _dt()
    gen = torch.Generator().manual_seed(11)
    hidden_full = (torch.randn(3, 5, 32, generator=gen)).to(dtype)
    weight_full = (torch.randn(VOCAB, 32, generator=gen) / 4).to(dtype)
    bias_full = (torch.randn(VOCAB, generator=gen)).to(dtype)
    labels_full = torch.randint(0, VOCAB, (3, 5), generator=gen)
    start, stop = mesh.vocab_range()
    head_placements = [dt.Replicate()] * len(mesh.shape)
    head_placements[mesh.vocab_dim] = dt.Shard(0)
    hidden_placements = mesh.placements(vocab=False)

    def make(kind):
        if kind == "dtensor":
            h = dt.distribute_tensor(hidden_full, mesh.mesh, hidden_placements).requires_grad_()
            w = dt.distribute_tensor(weight_full, mesh.mesh, head_placements).requires_grad_()
            b = dt.distribute_tensor(bias_full, mesh.mesh, head_placements).requires_grad_()
        elif kind == "local":
            h = mesh.rows(hidden_full).detach().requires_grad_()
            w = weight_full[start:stop].detach().requires_grad_()
            b = bias_full[start:stop].detach().requires_grad_()
        else:
            h, w, b = (t.double().requires_grad_() for t in (mesh.rows(hidden_full), weight_full, bias_full))
        return h, w, b

    for name, fn in {
        "token_logprobs": lambda lin, y, kw: kltriton.token_logprobs(lin, y, return_entropy=True,
                                                                     backend=kw.pop("backend", backend), **kw),
        "policy_loss": lambda lin, y, kw: (lambda out: (out.loss, out.logprobs))(kltriton.policy_loss(
            lin, y, torch.ones(_local(y).shape), entropy_coef=0.02, backend=kw.pop("backend", backend), **kw)),
    }.items():
        leaves = {kind: make(kind) for kind in ("dtensor", "local", "float64")}
        labels = {"dtensor": mesh.distribute(labels_full, vocab=False), "local": mesh.rows(labels_full),
                  "float64": mesh.rows(labels_full)}
        outs = {}
        for kind, (h, w, b) in leaves.items():
            kw = {"backend": "reference"} if kind == "float64" else (
                {"process_group": mesh.group} if kind == "local" and mesh.group else {})
            outs[kind] = _as_tuple(fn(kltriton.LinearLogits(h, w, b), labels[kind], kw))
            _backward(outs[kind])
        exact = outs["float64"]
        scale = hidden_full.double().abs().sum(-1).max().item() * weight_full.double().abs().max().item()
        tol = 64 * 2.0 ** -23 * (1 + scale)
        _compare(outs["dtensor"], outs["local"], exact, f"linear {name} {mesh.shape} {backend} {dtype}",
                 atol=tol * 10, rtol=tol)
        h64, w64, b64 = leaves["float64"]
        for leaf, local, expected, what in zip(leaves["dtensor"], leaves["local"],
                                               (h64.grad, w64.grad[start:stop], b64.grad[start:stop]),
                                               ("hidden", "weight", "bias")):
            _check_grad_placements(leaf, f"linear {name} {what}")
            grad = leaf.grad.to_local()
            assert torch.equal(grad, local.grad), f"linear {name} {what}: not bitwise the process_group= call's"
            size = expected.abs().max().item()
            assert_close(grad, expected.to(grad.dtype), atol=1e-2 * size if dtype == torch.bfloat16 else 1e-4 * size,
                         rtol=3e-2 if dtype == torch.bfloat16 else 1e-3, what=f"linear {name} d_{what} vs float64")


def case_topk_teacher(mesh, backend, dtype):
    """A ``Shard(-1)`` student against a ``TopK`` teacher (plain tensors of global ids)."""
    full = _logits((4, 6, VOCAB), dtype, 21)
    labels_full = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(22))
    ids_full = torch.randint(0, VOCAB, (4, 6, 8), generator=torch.Generator().manual_seed(23))
    ids_full = torch.sort(ids_full, -1).values
    ids_full[..., 1:][ids_full[..., 1:] == ids_full[..., :-1]] = -1  # distinct ids, -1 padding
    logp_full = torch.log_softmax(torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(24)), -1) - 1.0
    x_dt = mesh.distribute(full, vocab=True, grad=True)
    x_local = x_dt.to_local().detach().requires_grad_()
    rows = mesh.rows
    x64 = rows(full).double().requires_grad_()
    outs = []
    for x, y, ids, lp, kw in ((x_dt, mesh.distribute(labels_full, vocab=False), rows(ids_full), rows(logp_full), {}),
                              (x_local, rows(labels_full), rows(ids_full), rows(logp_full),
                               {"process_group": mesh.group} if mesh.group else {}),
                              (x64, rows(labels_full), rows(ids_full), rows(logp_full), {"backend": "reference"})):
        out = kltriton.token_divergence(x, kltriton.TopK(ids, lp), y, divergence="reverse_kl",
                                        **{"backend": backend, **kw})
        _backward((out,))
        outs.append((out,))
    tol = 32 * value_atol(full, 1.0)
    _compare(outs[0], outs[1], outs[2], f"topk {mesh.shape} {backend} {dtype}", atol=tol * 50, rtol=tol)
    _check_grad_placements(x_dt, "topk")
    assert torch.equal(x_dt.grad.to_local(), x_local.grad), "topk: gradient not bitwise the process_group= call's"


def case_errors(mesh, backend, dtype):
    """Every ambiguous or unsupported placement gets its clear error."""
    dt = _dt()
    full = _logits((2, 3, VOCAB), torch.float32, 31)
    labels = torch.randint(0, VOCAB, (2, 3))
    m = mesh.mesh

    partial = dt.DTensor.from_local(full, m, [dt.Partial()] * len(mesh.shape))
    raises_with(lambda: kltriton.token_logprobs(partial, labels, backend=backend), "Partial")
    if len(mesh.shape) == 2:
        both = dt.distribute_tensor(full, m, [dt.Shard(-1), dt.Shard(-1)])
        raises_with(lambda: kltriton.token_logprobs(both, labels, backend=backend), "sharded over mesh dimensions")
    sharded = mesh.distribute(full, vocab=True, batch=False)
    local_labels = labels
    if mesh.group is not None:
        others = [dist.new_group([r]) for r in range(dist.get_world_size())]
        solo = others[dist.get_rank()]  # every rank makes every group, in the same order
        raises_with(lambda: kltriton.token_logprobs(sharded, local_labels, process_group=solo, backend=backend),
               "process_group is not the group")
    weight = dt.distribute_tensor(torch.randn(VOCAB, 16), m,
                                  [dt.Shard(0) if i == mesh.vocab_dim else dt.Replicate()
                                   for i in range(len(mesh.shape))])
    hidden = torch.randn(2, 3, 16)
    if mesh.group is not None:  # a Shard(0) over one rank is the whole weight: no ambiguity
        raises_with(lambda: kltriton.token_logprobs(kltriton.LinearLogits(hidden, weight), labels, backend=backend),
               "FSDP2")
    hidden_split = dt.distribute_tensor(hidden, m, [dt.Shard(-1)] * len(mesh.shape))
    raises_with(lambda: kltriton.token_logprobs(kltriton.LinearLogits(hidden_split, weight), labels, backend=backend),
           "hidden dimension")
    ref_plain = torch.randn(2, 3, VOCAB)
    if mesh.group is not None:
        raises_with(lambda: kltriton.token_kl(sharded, ref_plain, local_labels, backend=backend), "shard the vocabulary")


CASES = {"logits": case_logits, "linear": case_linear, "topk_teacher": case_topk_teacher, "errors": case_errors}
TRITON_CASES = ("logits",)


def _worker(rank, world, init_file, report_dir, backends, meshes):
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report = {}
    try:
        for shape in meshes:
            mesh = Mesh(tuple(shape))
            for name, case in CASES.items():
                for backend in backends:
                    if backend == "triton" and name not in TRITON_CASES:
                        continue
                    for dtype in (torch.float32, torch.bfloat16) if backend != "triton" else (torch.float32,):
                        record(report, f"{name}-{shape}-{backend}-{str(dtype)[6:]}", case, mesh, backend, dtype)
    finally:
        close_rank(report_dir, rank, report)
    exit_rank()  # every case ran


MESHES = ([2], [1, 2], [2, 1])


@pytest.fixture(scope="module")
def reports():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp, spawned_backends(), MESHES), nprocs=2)
        out = []
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                out.append(json.load(f))
        return out


@pytest.mark.parametrize("mesh", [str(m) for m in MESHES])
@pytest.mark.parametrize("name", list(CASES))
def test_dtensor_inputs(reports, name, mesh):
    keys = [k for k in reports[0] if k.startswith(f"{name}-{mesh}-")]
    assert keys, f"case {name} on mesh {mesh} did not run"
    failures = [f"rank {r} {k}:\n{rep[k]}" for r, rep in enumerate(reports) for k in keys if rep.get(k) != "ok"]
    assert not failures, "\n".join(failures)


def test_one_rank_mesh_is_bitwise_plain_tensors():
    """A DTensor on a one-rank mesh (a vocabulary split over one rank) gives every output and gradient bitwise equal
    to the plain tensors' (no collective, the local route)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_one_rank_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=1)
        with open(os.path.join(tmp, "rank0.json")) as f:
            report = json.load(f)
    assert report == {"ok": True}, report.get("error")


def _one_rank_worker(rank, init_file, report_dir):
    report = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
        mesh = Mesh((1,))
        full = _logits((3, 4, VOCAB), torch.float32, 41)
        ref = _logits((3, 4, VOCAB), torch.float32, 42)
        labels = torch.randint(0, VOCAB, (3, 4))
        for fn in (lambda x: kltriton.token_logprobs(x, labels, return_entropy=True),
                   lambda x: tuple(kltriton.token_kl(x, ref if not hasattr(x, "to_local") else
                                                     mesh.distribute(ref, vocab=True), labels, estimator="full")),
                   lambda x: kltriton.policy_loss(x, labels, torch.randn(3, 4, generator=torch.Generator()
                                                                        .manual_seed(1)), entropy_coef=0.1)[:3]):
            x_dt, x = mesh.distribute(full, vocab=True, grad=True), full.clone().requires_grad_()
            a, b = _as_tuple(fn(x_dt)), _as_tuple(fn(x))
            _backward(a)
            _backward(b)
            for u, v in zip(a, b):
                assert torch.equal(u, v), "outputs differ"
            assert torch.equal(x_dt.grad.to_local(), x.grad), "gradients differ"
        report["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the parent
        report["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(report_dir, "rank0.json"), "w") as f:
            json.dump(report, f)
        leave_world()
