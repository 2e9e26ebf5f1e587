"""Every kernel family's main variants on the test device against the float64 reference: one public call per family
(its forward, and its backward with upstream gradients that are not 1), awkward logits (``-inf``, ``finfo.min``, a
row 40x larger), a vocabulary that is not a multiple of any block.

This is the correctness step of ``python -m benchmarks gpu`` (``KLTRITON_TEST_DEVICE=cuda``: the Triton backend on
a vocabulary of 151,936, a few minutes with its compiles); on CPU it runs the C++ backend at a small vocabulary (the
Triton kernels on CPU tensors, through the interpreter, are what the other tests check, variant by variant).
"""
import os

import pytest
import torch

import kltriton
from helpers import MIXED_GRAD_RTOL, assert_close, awkward_logits, grad_tols, value_atol

TEST_DEVICE = os.environ.get("KLTRITON_TEST_DEVICE", "cpu")  # as tests/conftest.py reads it

DEVICE_BACKENDS = ("triton",) if TEST_DEVICE == "cuda" else ("cpp",)
B, T = 3, 67
VOCAB = 151_936 if TEST_DEVICE == "cuda" else 1_031
HIDDEN = 64
TEMPERATURE = 0.7


@pytest.fixture(params=DEVICE_BACKENDS)
def device_backend(request):
    usable, why = kltriton.dispatch.availability(request.param)
    if not usable:
        pytest.skip(f"{request.param} backend unavailable: {why}")
    return request.param


@pytest.fixture(params=(torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
def dtype(request):
    return request.param


def _inputs(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = awkward_logits((B, T, VOCAB), dtype, gen)
    ref = awkward_logits((B, T, VOCAB), dtype, gen)
    labels = torch.randint(0, VOCAB, (B, T), generator=gen)
    labels[0, :5] = -100
    mask = torch.rand(B, T, generator=gen) > 0.2
    return logits, ref, labels, mask, gen


def _on_device(*tensors):
    return tuple(None if t is None else t.to(TEST_DEVICE) for t in tensors)


def _oracle(*tensors):
    """Leaf float64 CPU copies: the reference backend's float64 mode."""
    return tuple(t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                 for t in tensors)


def _leaf(tensor):
    return tensor.detach().clone().requires_grad_(True)


def test_stream_and_layout(device_backend, dtype):
    """``token_logprobs`` with the entropy, a temperature, a mask and shifted labels: the layout and stream families,
    forward and backward."""
    logits, _, labels, mask, gen = _inputs(dtype, 1)
    g_logp, g_entropy = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    x = _leaf(logits.to(TEST_DEVICE))
    labels_d, mask_d, g_logp_d, g_entropy_d = _on_device(labels, mask, g_logp, g_entropy)
    logp, entropy = kltriton.token_logprobs(x, labels_d, mask=mask_d, shift_labels=True, return_entropy=True,
                                            temperature=TEMPERATURE, backend=device_backend)
    torch.autograd.backward((logp, entropy), (g_logp_d, g_entropy_d))
    (x64,) = _oracle(_leaf(logits))
    logp64, entropy64 = kltriton.token_logprobs(x64, labels, mask=mask, shift_labels=True, return_entropy=True,
                                                temperature=TEMPERATURE, backend="reference")
    torch.autograd.backward((logp64, entropy64), (g_logp.double(), g_entropy.double()))
    atol = value_atol(logits, TEMPERATURE)
    assert_close(logp.cpu(), logp64, atol, what="logp")
    assert_close(entropy.cpu(), entropy64, atol * 4, what="entropy")
    grad_atol, _ = grad_tols(logits, TEMPERATURE, torch.stack([g_logp, g_entropy]))
    assert_close(x.grad.cpu(), x64.grad, grad_atol, MIXED_GRAD_RTOL[dtype], what="grad")


@pytest.mark.parametrize("estimator", ["k1", "k3", "full"])
def test_epilogue_kl_and_reward(device_backend, dtype, estimator):
    """``token_kl`` (each estimator kind) and ``fused_kl_reward`` (reward shaping with scores): the epilogue family
    after the stream statistics, and the KL's gradient."""
    logits, ref, labels, mask, gen = _inputs(dtype, 2)
    scores, g_kl = torch.randn(B, generator=gen), torch.randn(B, T, generator=gen)
    x = _leaf(logits.to(TEST_DEVICE))
    ref_d, labels_d, mask_d, scores_d = _on_device(ref, labels, mask, scores)
    out = kltriton.token_kl(x, ref_d, labels_d, estimator=estimator, mask=mask_d, temperature=TEMPERATURE,
                            backend=device_backend)
    out.kl.backward(g_kl.to(TEST_DEVICE))
    reward = kltriton.fused_kl_reward(x.detach(), ref_d, labels_d, coef=0.05, estimator=estimator, scores=scores_d,
                                      mask=mask_d, temperature=TEMPERATURE, backend=device_backend)
    x64, ref64 = _oracle(_leaf(logits), ref)
    want = kltriton.token_kl(x64, ref64, labels, estimator=estimator, mask=mask, temperature=TEMPERATURE,
                             backend="reference")
    want.kl.backward(g_kl.double())
    want_reward = kltriton.fused_kl_reward(x64.detach(), ref64, labels, coef=0.05, estimator=estimator,
                                           scores=scores.double(), mask=mask, temperature=TEMPERATURE,
                                           backend="reference")
    atol = value_atol(logits, TEMPERATURE) * 8  # a difference of two log-probs (or the full KL's sum)
    for name in ("kl", "logprobs", "ref_logprobs"):
        assert_close(getattr(out, name).cpu(), getattr(want, name), atol, what=name)
    for name in ("reward", "kl", "kl_per_seq"):
        assert_close(getattr(reward, name).cpu(), getattr(want_reward, name), atol * T, what=f"reward {name}")
    grad_atol, _ = grad_tols(logits, TEMPERATURE, g_kl)
    assert_close(x.grad.cpu(), x64.grad, grad_atol * 2, MIXED_GRAD_RTOL[dtype], what="grad")


def test_fused_policy_loss(device_backend, dtype):
    """``policy_loss`` on the fused route (GRPO, reference logits, a k3 KL, an entropy bonus, a mask): the loss family
    with its gradient written in the forward, its per-token terms and metrics; an upstream gradient not 1."""
    logits, ref, labels, mask, gen = _inputs(dtype, 3)
    adv, old = torch.randn(B, generator=gen), -torch.rand(B, T, generator=gen) * 3
    kw = dict(loss_type="grpo", kl_coef=0.04, entropy_coef=0.01, temperature=TEMPERATURE)
    x = _leaf(logits.to(TEST_DEVICE))
    ref_d, labels_d, mask_d, adv_d, old_d = _on_device(ref, labels, mask, adv, old)
    got = kltriton.policy_loss(x, labels_d, adv_d, old_logprobs=old_d, ref=ref_d, mask=mask_d, backend=device_backend,
                               **kw)
    (got.loss * 1.7).backward()
    x64, ref64 = _oracle(_leaf(logits), ref)
    want = kltriton.policy_loss(x64, labels, adv.double(), old_logprobs=old.double(), ref=ref64, mask=mask,
                                backend="reference", **kw)
    (want.loss * 1.7).backward()
    atol = value_atol(logits, TEMPERATURE) * 8
    assert_close(got.loss.cpu(), want.loss, atol, 1e-5, what="loss")
    for name in ("logprobs", "ref_logprobs", "kl", "entropy", "ratio"):
        assert_close(getattr(got, name).cpu(), getattr(want, name), atol * 4, 1e-5, what=name)
    assert set(got.metrics) == set(want.metrics)
    for name, value in want.metrics.items():
        assert_close(got.metrics[name].cpu(), value, atol * 4, 1e-5, what=f"metric {name}")
    grad_atol, _ = grad_tols(logits, TEMPERATURE, torch.tensor([1.7]))
    assert_close(x.grad.cpu(), x64.grad, grad_atol, MIXED_GRAD_RTOL[dtype], what="grad")


def test_linear(device_backend, dtype):
    """``token_logprobs`` of a ``LinearLogits`` (hidden states and an LM head, the logits never built): the linear
    family's GEMM tiles and the gradients of the hidden states and the weight."""
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(B, T, HIDDEN, generator=gen)).to(dtype)
    weight = (0.2 * torch.randn(VOCAB, HIDDEN, generator=gen)).to(dtype)
    labels = torch.randint(0, VOCAB, (B, T), generator=gen)
    g_logp = torch.randn(B, T, generator=gen)
    h, w = _leaf(hidden.to(TEST_DEVICE)), _leaf(weight.to(TEST_DEVICE))
    logp = kltriton.token_logprobs(kltriton.LinearLogits(h, w), labels.to(TEST_DEVICE), temperature=TEMPERATURE,
                                   backend=device_backend)
    logp.backward(g_logp.to(TEST_DEVICE))
    h64, w64 = _oracle(_leaf(hidden), _leaf(weight))
    want = kltriton.token_logprobs(kltriton.LinearLogits(h64, w64), labels, temperature=TEMPERATURE,
                                   backend="reference")
    want.backward(g_logp.double())
    logits = (hidden.double() @ weight.double().T).to(dtype)
    # the logits of a GEMM in the input dtype (fp32 accumulation), then the stream kernel
    atol = value_atol(logits, TEMPERATURE) + HIDDEN * 2.0 ** -8 * logits.double().abs().max().item() / TEMPERATURE \
        * (dtype == torch.bfloat16)
    assert_close(logp.cpu(), want, atol * 8, 1e-4, what="logp")
    rtol = 4e-2 if dtype == torch.bfloat16 else 1e-3
    assert_close(h.grad.cpu(), h64.grad, 1e-3, rtol, what="hidden grad")
    assert_close(w.grad.cpu(), w64.grad, 1e-3, rtol, what="weight grad")


def test_truncation(device_backend, dtype):
    """``token_logprobs`` of the top-k / top-p truncated distribution (recomputed from the logits): the truncation
    family, forward and backward."""
    logits, _, labels, _, gen = _inputs(dtype, 5)
    labels = torch.where(torch.rand(B, T, generator=gen) < 0.5, logits.float().argmax(-1), labels)  # kept, mostly
    g_logp = torch.randn(B, T, generator=gen)
    truncation = kltriton.Truncation(top_k=50, top_p=0.9)
    x = _leaf(logits.to(TEST_DEVICE))
    logp = kltriton.token_logprobs(x, labels.to(TEST_DEVICE), truncation=truncation, temperature=TEMPERATURE,
                                   backend=device_backend)
    logp.backward(torch.where(torch.isfinite(logp), g_logp.to(TEST_DEVICE), 0.0))
    (x64,) = _oracle(_leaf(logits))
    want = kltriton.token_logprobs(x64, labels, truncation=truncation, temperature=TEMPERATURE, backend="reference")
    want.backward(torch.where(torch.isfinite(want), g_logp.double(), 0.0))
    assert torch.equal(torch.isfinite(logp.cpu()), torch.isfinite(want)), "the kept sets differ"
    atol = value_atol(logits, TEMPERATURE)
    assert_close(logp.cpu(), want, atol * 4, what="logp")
    grad_atol, _ = grad_tols(logits, TEMPERATURE, g_logp)
    assert_close(x.grad.cpu(), x64.grad, grad_atol, MIXED_GRAD_RTOL[dtype], what="grad")


@pytest.mark.parametrize("divergence", ["jsd", "forward_kl"])
def test_divergence(device_backend, dtype, divergence):
    """``token_divergence`` reduced over the tokens (the fused divergence loss) and per token (the JSD's second pass):
    the divergence family and the student's gradient."""
    logits, teacher, labels, mask, gen = _inputs(dtype, 6)
    x = _leaf(logits.to(TEST_DEVICE))
    teacher_d, labels_d, mask_d = _on_device(teacher, labels, mask)
    kw = dict(divergence=divergence, beta=0.3, temperature=TEMPERATURE)
    loss = kltriton.token_divergence(x, teacher_d, labels_d, mask=mask_d, reduction="batchmean",
                                     backend=device_backend, **kw)
    per_token = kltriton.token_divergence(x.detach(), teacher_d, labels_d, mask=mask_d, backend=device_backend, **kw)
    (loss * 0.6).backward()
    x64, teacher64 = _oracle(_leaf(logits), teacher)
    want = kltriton.token_divergence(x64, teacher64, labels, mask=mask, reduction="batchmean", backend="reference",
                                     **kw)
    want_per_token = kltriton.token_divergence(x64.detach(), teacher64, labels, mask=mask, backend="reference", **kw)
    (want * 0.6).backward()
    atol = value_atol(logits, TEMPERATURE) * 8
    assert_close(loss.cpu(), want, atol, 1e-5, what="loss")
    assert_close(per_token.cpu(), want_per_token, atol, 1e-5, what="per token")
    grad_atol, _ = grad_tols(logits, TEMPERATURE, torch.tensor([0.6]))
    assert_close(x.grad.cpu(), x64.grad, grad_atol, MIXED_GRAD_RTOL[dtype], what="grad")


def test_invariant_mode(device_backend, dtype):
    """``token_logprobs`` in the invariant mode (row maxima and fixed-point sums): the invariant family, forward and
    backward, against the float64 reference."""
    logits, _, labels, mask, gen = _inputs(dtype, 7)
    g_logp = torch.randn(B, T, generator=gen)
    x = _leaf(logits.to(TEST_DEVICE))
    previous = kltriton.set_invariant(True)
    try:
        logp = kltriton.token_logprobs(x, labels.to(TEST_DEVICE), mask=mask.to(TEST_DEVICE), temperature=TEMPERATURE,
                                       backend=device_backend)
        logp.backward(g_logp.to(TEST_DEVICE))
    finally:
        kltriton.set_invariant(previous)
    (x64,) = _oracle(_leaf(logits))
    want = kltriton.token_logprobs(x64, labels, mask=mask, temperature=TEMPERATURE, backend="reference")
    want.backward(g_logp.double())
    atol = value_atol(logits, TEMPERATURE)
    assert_close(logp.cpu(), want, atol * 4, what="logp")
    grad_atol, _ = grad_tols(logits, TEMPERATURE, g_logp)
    assert_close(x.grad.cpu(), x64.grad, grad_atol, MIXED_GRAD_RTOL[dtype], what="grad")


def test_packed_layout(device_backend):
    """Packed sequences (``cu_seqlens``, an empty one among them) with shifted labels: the layout family's segments,
    through the stream kernels."""
    gen = torch.Generator().manual_seed(8)
    cu_seqlens = torch.tensor([0, 40, 40, 113, 201])
    n = int(cu_seqlens[-1])
    logits = awkward_logits((n, VOCAB), torch.float32, gen)
    labels = torch.randint(0, VOCAB, (n,), generator=gen)
    x = logits.to(TEST_DEVICE)
    got = kltriton.token_logprobs(x, labels.to(TEST_DEVICE), cu_seqlens=cu_seqlens.to(TEST_DEVICE), shift_labels=True,
                                  backend=device_backend)
    want = kltriton.token_logprobs(logits.double(), labels, cu_seqlens=cu_seqlens, shift_labels=True,
                                   backend="reference")
    assert_close(got.cpu(), want, value_atol(logits, 1.0), what="logp")
    ends = cu_seqlens[1:] - 1
    assert (got.cpu()[ends[ends >= 0]] == 0).all(), "the last position of each sequence is not scored"
