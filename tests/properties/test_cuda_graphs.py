"""Every public call captured in a CUDA graph replays to the eager result, and an eager call never synchronizes
(SPEC "The host floor": capturable, no host synchronization by default on a device).

CUDA only (``KLTRITON_TEST_DEVICE=cuda``: ``python -m benchmarks gpu``'s check step); skipped elsewhere. Each case
is warmed up on a side stream (as ``torch.cuda.graphs`` asks), captured, then its static inputs are refilled with new
values twice and the graph replayed: every output, gradients included, equals an eager call on the same values,
which runs under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing op raises). Default validation, the
Triton backend, bf16 logits at a vocabulary that is not a multiple of any block.
"""
import os

import pytest
import torch

import kltriton

TEST_DEVICE = os.environ.get("KLTRITON_TEST_DEVICE", "cpu")  # as tests/conftest.py reads it
pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs: KLTRITON_TEST_DEVICE=cuda only")

B, T, V, H = 2, 33, 32_003, 64
LEAVES = ("x", "hidden", "weight")  # the differentiable inputs
TRITON = dict(backend="triton")


def _values(seed):
    """A fresh set of every case's inputs on the device (``-100`` labels at random positions)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[torch.rand(B, T, generator=gen) < 0.1] = -100
    values = dict(x=(2 * torch.randn(B, T, V, generator=gen)).bfloat16(),
                  ref=(2 * torch.randn(B, T, V, generator=gen)).bfloat16(),
                  labels=labels, mask=torch.rand(B, T, generator=gen) > 0.2,
                  adv=torch.randn(B, generator=gen), old=-3 * torch.rand(B, T, generator=gen),
                  scores=torch.randn(B, generator=gen), g=torch.randn(B, T, generator=gen),
                  hidden=torch.randn(B, T, H, generator=gen).bfloat16(),
                  weight=(0.2 * torch.randn(V, H, generator=gen)).bfloat16())
    teacher = values["ref"].float()
    values["top_ids"] = (teacher + torch.rand(teacher.shape, generator=gen)).topk(8, -1).indices
    values["top_logprobs"] = teacher.log_softmax(-1).gather(-1, values["top_ids"])
    return {name: t.to(TEST_DEVICE).requires_grad_(name in LEAVES) for name, t in values.items()}


def token_logprobs(t):
    logp, entropy = kltriton.token_logprobs(t["x"], t["labels"], mask=t["mask"], return_entropy=True,
                                            temperature=0.7, **TRITON)
    return (logp, entropy, *torch.autograd.grad((logp * t["g"]).sum() + entropy.sum(), t["x"]))


def token_kl(t):
    out = kltriton.token_kl(t["x"], t["ref"], t["labels"], estimator="k3", mask=t["mask"], **TRITON)
    return (out.kl, out.logprobs, out.ref_logprobs, *torch.autograd.grad((out.kl * t["g"]).sum(), t["x"]))


def fused_kl_reward(t):
    out = kltriton.fused_kl_reward(t["x"].detach(), t["ref"], t["labels"], coef=0.05, estimator="k3",
                                   scores=t["scores"], mask=t["mask"], **TRITON)
    return out.reward, out.kl, out.kl_per_seq


def policy_loss(t):
    out = kltriton.policy_loss(t["x"], t["labels"], t["adv"], old_logprobs=t["old"], ref=t["ref"], mask=t["mask"],
                               loss_type="grpo", kl_coef=0.04, entropy_coef=0.01, **TRITON)
    return (out.loss, out.logprobs, out.kl, out.entropy, out.ratio, *out.metrics.values(),
            *torch.autograd.grad(out.loss * 1.7, t["x"]))


def token_divergence(t):
    loss = kltriton.token_divergence(t["x"], t["ref"], t["labels"], mask=t["mask"], reduction="batchmean",
                                     divergence="jsd", beta=0.3, **TRITON)
    return (loss, *torch.autograd.grad(loss * 0.6, t["x"]))


def topk_teacher(t):
    teacher = kltriton.TopK(t["top_ids"], t["top_logprobs"])
    loss = kltriton.token_divergence(t["x"], teacher, t["labels"], mask=t["mask"], reduction="batchmean",
                                     divergence="forward_kl", **TRITON)
    return (loss, *torch.autograd.grad(loss * 0.6, t["x"]))


def linear_logits(t):
    logp = kltriton.token_logprobs(kltriton.LinearLogits(t["hidden"], t["weight"]), t["labels"], **TRITON)
    return (logp, *torch.autograd.grad((logp * t["g"]).sum(), (t["hidden"], t["weight"])))


CASES = (token_logprobs, token_kl, fused_kl_reward, policy_loss, token_divergence, topk_teacher, linear_logits)


def _eager(case, values):
    """The case on ``values``, raising at any synchronizing op."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return case(values)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_captured_call_replays_to_the_eager_result(case):
    static = _values(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            case(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = case(static)
    for seed in (1, 2):
        values = _values(seed)
        with torch.no_grad():
            for name, tensor in static.items():
                tensor.copy_(values[name])
        graph.replay()
        want = _eager(case, values)
        assert len(captured) == len(want)
        for i, (got, expected) in enumerate(zip(captured, want)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True,
                                       msg=lambda m: f"{case.__name__} output {i}, inputs {seed}: {m}")
