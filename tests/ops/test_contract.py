"""Contract additions: integer masks, a reference dtype other than the policy's, a
per-position temperature, non-finite temperatures refused everywhere, verl's straight-through estimators."""
import pytest
import torch

import kltriton
from helpers import MIXED_GRAD_RTOL, assert_close, no_host_reads, random_labels, random_logits


VOCAB = 301


def batch(dtype=torch.float32, shape=(3, 5), seed=0):
    torch.manual_seed(seed)
    logits = random_logits(shape + (VOCAB,), dtype)
    labels = random_labels(shape, VOCAB)
    return logits, labels


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_masks_equal_bool(backend, mask_dtype):
    """A Hugging Face attention_mask (int64) passes as it is: 0 = not scored, any other value = scored."""
    logits, labels = batch()
    keep = torch.rand(labels.shape) < 0.7
    int_mask = keep.to(mask_dtype) * 3 if mask_dtype != torch.uint8 else keep.to(mask_dtype)
    a = kltriton.token_logprobs(logits, labels, mask=keep, backend=backend)
    b = kltriton.token_logprobs(logits, labels, mask=int_mask, backend=backend)
    assert torch.equal(a, b)
    c = kltriton.fused_kl_reward(logits, logits.flip(-1), labels, mask=int_mask, shift_labels=True, backend=backend)
    d = kltriton.fused_kl_reward(logits, logits.flip(-1), labels, mask=keep, shift_labels=True, backend=backend)
    assert torch.equal(c.reward, d.reward) and torch.equal(c.kl_per_seq, d.kl_per_seq)


def test_floating_mask_is_a_type_error():
    logits, labels = batch()
    with pytest.raises(TypeError, match="mask"):
        kltriton.token_logprobs(logits, labels, mask=torch.ones(labels.shape))


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float32)], ids=["bf16-fp32", "fp32-bf16", "fp16-fp32"])
def test_reference_in_another_dtype(backend, dtypes):
    """A bf16 policy with an fp32 reference: each read in its own dtype, the result as with both upcast."""
    policy_dtype, ref_dtype = dtypes
    logits, labels = batch(policy_dtype)
    ref = (logits.double() + torch.randn(logits.shape)).to(ref_dtype)
    upstream = torch.randn(labels.shape)
    for estimator in ("k3", "full"):
        x = logits.clone().requires_grad_()
        out = kltriton.token_kl(x, ref, labels, estimator=estimator, temperature=0.9, backend=backend)
        grad, = torch.autograd.grad((out.kl * upstream).sum(), x)
        x64 = logits.double().requires_grad_()
        exp = kltriton.token_kl(x64, ref.double(), labels, estimator=estimator, temperature=0.9, backend="reference")
        e_grad, = torch.autograd.grad((exp.kl * upstream.double()).sum(), x64)
        for name in ("kl", "logprobs", "ref_logprobs"):
            assert_close(getattr(out, name), getattr(exp, name), 1e-4, 1e-5, what=name)
        assert grad.dtype == policy_dtype
        assert_close(grad, e_grad, 1e-5, MIXED_GRAD_RTOL[policy_dtype], what="grad")
    with pytest.raises(TypeError, match="ref"):
        kltriton.token_kl(logits, ref.double(), labels)


def test_per_position_temperature(backend):
    """verl's per-sample temperature: a tensor of shape S; each position as if computed alone with its T."""
    logits, labels = batch(shape=(3, 4))
    ref = random_logits(logits.shape, torch.float32)
    per_sample = torch.tensor([0.6, 1.0, 1.7])
    temperature = per_sample[:, None].expand(3, 4)  # a broadcast view is accepted as it is
    x = logits.clone().requires_grad_()
    out = kltriton.token_kl(x, ref, labels, estimator="full", temperature=temperature, backend=backend)
    lp, ent = kltriton.token_logprobs(logits, labels, temperature=temperature, return_entropy=True, backend=backend)
    out.kl.sum().backward()
    for b, t in enumerate(per_sample.tolist()):
        xb = logits[b].clone().requires_grad_()
        row = kltriton.token_kl(xb, ref[b], labels[b], estimator="full", temperature=t, backend=backend)
        row.kl.sum().backward()
        assert_close(out.kl[b], row.kl, 1e-6, 1e-6, what="kl")
        assert_close(out.ref_logprobs[b], row.ref_logprobs, 1e-6, what="ref_logprobs")
        assert_close(x.grad[b], xb.grad, 1e-6, 1e-6, what="grad")
        lp_b, ent_b = kltriton.token_logprobs(logits[b], labels[b], temperature=t, return_entropy=True,
                                              backend=backend)
        assert_close(lp[b], lp_b, 1e-6, what="logp")
        assert_close(ent[b], ent_b, 1e-6, what="entropy")
    # a 0-dim tensor equals the float
    a = kltriton.token_logprobs(logits, labels, temperature=torch.tensor(0.8, dtype=torch.float64), backend=backend)
    assert torch.equal(a, kltriton.token_logprobs(logits, labels, temperature=0.8, backend=backend))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), torch.tensor(float("inf")),
                                 torch.tensor(-0.5), "per-position"], ids=str)
def test_bad_temperature_is_a_value_error_on_every_backend(backend, bad):
    logits, labels = batch()
    if isinstance(bad, str):
        bad = torch.full(labels.shape, 0.7)
        bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="temperature"):
        kltriton.token_logprobs(logits, labels, temperature=bad, backend=backend)
    with pytest.raises(ValueError, match="temperature"):
        kltriton.fused_kl_reward(logits, logits, labels, temperature=bad, backend=backend)


def test_temperature_shape_dtype_device_checks():
    logits, labels = batch()
    with pytest.raises(ValueError, match="temperature"):
        kltriton.token_logprobs(logits, labels, temperature=torch.ones(5))
    with pytest.raises(TypeError, match="temperature"):
        kltriton.token_logprobs(logits, labels, temperature=torch.ones(labels.shape, dtype=torch.long))
    with pytest.raises(TypeError, match="temperature"):
        kltriton.token_logprobs(logits, labels, temperature="1.0")
    with pytest.raises(ValueError, match="temperature"):
        kltriton.token_logprobs(logits, labels, temperature=torch.ones(labels.shape, device="meta"))


def test_temperature_tensor_needs_no_sync_with_validation_off(backend):
    logits, labels = batch()
    temperature = torch.full(labels.shape, 0.9)
    previous = kltriton.set_validation(False)
    try:
        kltriton.token_logprobs(logits, labels, temperature=temperature, backend=backend)  # warm-up: loading
        with no_host_reads("cpu"):
            kltriton.token_logprobs(logits, labels, temperature=temperature, backend=backend)
            kltriton.token_logprobs(logits, labels, temperature=torch.tensor(0.9), backend=backend)
    finally:
        kltriton.set_validation(previous)


# verl's kl_penalty names (verl/trainer/ppo/core_algos.py): "k1+", "kl+", "abs+", "k3+", "low_var_kl+" are
# straight-through: the value of the estimator without "+", the gradient of k2 ("mse").
@pytest.mark.parametrize("name,base", [("k1+", "k1"), ("kl+", "kl"), ("abs+", "abs"), ("k3+", "k3"),
                                       ("low_var_kl+", "low_var_kl"), ("mse+", "mse")])
def test_verl_straight_through_estimators(backend, name, base):
    logits, labels = batch()
    ref = random_logits(logits.shape, torch.float32)
    upstream = torch.randn(labels.shape)
    results = {}
    for est in (name, base, "k2"):
        x = logits.clone().requires_grad_()
        # kl_clamp clamps the value; the straight-through gradient is the unclamped k2's (as verl)
        out = kltriton.token_kl(x, ref, labels, estimator=est, kl_clamp=None if est == "k2" else 3.0,
                                backend=backend)
        grad, = torch.autograd.grad((out.kl * upstream).sum(), x)
        results[est] = out.kl, grad
    # the base value (k2 + (base - k2).detach(): equal up to one rounding)
    assert_close(results[name][0], results[base][0], 1e-6, 1e-6, what="value")
    # the k2 gradient ("mse+" is just "mse", as in verl)
    assert_close(results[name][1], results[base if name == "mse+" else "k2"][1], 1e-7, 1e-6, what="grad")
    with pytest.raises(ValueError, match="estimator"):
        kltriton.token_kl(logits, ref, labels, estimator="full+")


@pytest.mark.parametrize("call", ["token_logprobs", "token_kl", "fused_kl_reward", "policy_loss", "linear"])
def test_double_backward_is_a_clear_error(backend, call):
    """The backward runs kernels: a first-order gradient with create_graph=True works, and a second derivative through
    it is an error naming kltriton and the op on every backend (it was a silently wrong value on the reference)."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float64 if backend == "reference" else torch.float32
    x = torch.randn(2, 3, 11, generator=gen, dtype=dtype, requires_grad=True)
    ref = torch.randn(2, 3, 11, generator=gen, dtype=dtype)
    labels = torch.randint(0, 11, (2, 3), generator=gen)
    if call == "token_logprobs":
        out = kltriton.token_logprobs(x, labels, return_entropy=True, backend=backend)
        value = (out[0] ** 2).sum() + out[1].sum()
    elif call == "token_kl":
        value = (kltriton.token_kl(x, ref, labels, estimator="k3", backend=backend).kl ** 2).sum()
    elif call == "fused_kl_reward":
        value = (kltriton.fused_kl_reward(x, ref, labels, backend=backend).reward ** 2).sum()
    elif call == "policy_loss":
        adv = torch.randn(2, generator=gen, dtype=dtype, requires_grad=True)
        value = kltriton.policy_loss(x, labels, adv * 2, ref=ref, kl_coef=0.1, backend=backend).loss
    else:
        w = torch.randn(11, 4, generator=gen, dtype=dtype)
        h = torch.randn(2, 3, 4, generator=gen, dtype=dtype, requires_grad=True)
        out = kltriton.token_logprobs(kltriton.LinearLogits(h, w), labels, backend=backend)
        value, x = (out ** 2).sum(), h
    (grad,) = torch.autograd.grad(value, x, create_graph=True)
    with pytest.raises(RuntimeError, match="kltriton.*no second derivative"):
        torch.autograd.grad(grad.square().sum(), x)


@pytest.mark.parametrize("call", ["policy_loss", "policy_loss_head", "token_divergence", "one_tile_head",
                                  "token_logprobs"])
def test_a_second_backward_is_exact_or_refused(backend, call):
    """``retain_graph=True`` and a second backward through the same call: a call whose forward wrote the gradient
    (the fused losses: ``policy_loss`` dense or from an LM head, ``token_divergence``) or kept a logits tile (a
    one-tile ``LinearLogits``) refuses it with an error naming kltriton (the first backward wrote over what was saved:
    it was silently wrong); every other call gives the same gradient again."""
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float64 if backend == "reference" else torch.float32
    x = torch.randn(2, 3, 11, generator=gen, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3), generator=gen)
    h = torch.randn(2, 3, 4, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(11, 4, generator=gen, dtype=dtype)
    adv = torch.randn(2, generator=gen, dtype=dtype)
    if call == "policy_loss":
        value, leaf = kltriton.policy_loss(x, labels, adv, loss_type="grpo", backend=backend).loss, x
    elif call == "policy_loss_head":
        value, leaf = kltriton.policy_loss(kltriton.LinearLogits(h, w), labels, adv, backend=backend).loss, h
    elif call == "token_divergence":
        teacher = torch.randn(2, 3, 11, generator=gen, dtype=dtype)
        value, leaf = kltriton.token_divergence(x, teacher, labels, reduction="batchmean", backend=backend), x
    elif call == "one_tile_head":
        out = kltriton.token_logprobs(kltriton.LinearLogits(h, w), labels, backend=backend)
        value, leaf = (out * torch.randn(out.shape, generator=gen, dtype=dtype)).sum(), h
    else:
        out = kltriton.token_logprobs(x, labels, backend=backend)
        value, leaf = (out * torch.randn(out.shape, generator=gen, dtype=dtype)).sum(), x
    upstream = torch.tensor(1.5, dtype=dtype)
    (first,) = torch.autograd.grad(value, leaf, upstream, retain_graph=True)
    first = first.clone()
    if call == "token_logprobs":
        (second,) = torch.autograd.grad(value, leaf, upstream)
        assert torch.equal(first, second)
    else:
        with pytest.raises(RuntimeError, match="kltriton: a second backward through the same"):
            torch.autograd.grad(value, leaf, upstream)
