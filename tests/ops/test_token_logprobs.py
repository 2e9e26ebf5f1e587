"""token_logprobs on every backend against the float64 reference, values and gradients."""
import pytest
import torch

import kltriton
from helpers import assert_close, grad_tols, random_labels, random_logits, value_atol


def run(logits, labels, backend, upstream, **kwargs):
    """(logp, entropy, grad of sum(logp * g0 + entropy * g1)) on ``backend``."""
    x = logits.detach().clone().requires_grad_()
    logp, entropy = kltriton.token_logprobs(x, labels, return_entropy=True, backend=backend, **kwargs)
    loss = (logp.nan_to_num() * upstream[0]).sum() + (entropy.nan_to_num() * upstream[1]).sum()
    grad, = torch.autograd.grad(loss, x)
    return logp, entropy, grad


def check_against_oracle(logits, labels, backend, temperature=1.0, **kwargs):
    shape = labels.shape
    upstream = torch.randn((2,) + tuple(shape), device=logits.device)
    logp, entropy, grad = run(logits, labels, backend, upstream, temperature=temperature, **kwargs)
    e_logp, e_entropy, e_grad = run(logits.double(), labels, "reference", upstream.double(),
                                    temperature=temperature, **kwargs)
    assert logp.dtype == torch.float32 and grad.dtype == logits.dtype
    atol = value_atol(logits, temperature)
    assert_close(logp, e_logp, atol, what="logp")
    assert_close(entropy, e_entropy, atol * 4, what="entropy")
    g_atol, g_rtol = grad_tols(logits, temperature, upstream)
    assert_close(grad, e_grad, g_atol, g_rtol, what="grad")
    assert bool((logp[~torch.isnan(logp)] <= 0).all())
    return logp


@pytest.mark.parametrize("shape,vocab", [((3, 7), 1001), ((41,), 4099)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_odd_shapes(backend, dtype, device, shape, vocab, temperature):
    logits = random_logits(shape + (vocab,), dtype).to(device)
    labels = random_labels(shape, vocab).to(device)
    logp = check_against_oracle(logits, labels, backend, temperature)
    assert bool((logp[labels == -100] == 0).all())


def test_vocab_above_65536(backend, device):
    logits = random_logits((2, 70001), torch.bfloat16).to(device)
    labels = torch.tensor([3, 70000], device=device)
    check_against_oracle(logits, labels, backend)


def test_large_vocab_262144(backend, device):
    logits = random_logits((1, 262144), torch.float32, scale=5.0).to(device)
    check_against_oracle(logits, torch.tensor([262143], device=device), backend)


def test_mask_and_ignore_index(backend, dtype, device):
    logits = random_logits((4, 9, 517), dtype).to(device)
    labels = random_labels((4, 9), 517, ignore_index=-1).to(device)
    mask = torch.rand(4, 9, device=device) < 0.7
    logp = check_against_oracle(logits, labels, backend, ignore_index=-1, mask=mask)
    assert bool((logp[~mask | (labels == -1)] == 0).all())


def test_neg_inf_entries_and_dead_row(backend, dtype, device):
    logits = random_logits((5, 333), dtype)
    logits[0, ::2] = float("-inf")          # half the vocab banned
    logits[1, :] = float("-inf")            # a row with no distribution at all
    logits[2, 7] = float("-inf")            # the label itself banned
    labels = torch.tensor([1, 4, 7, 9, 10])
    logp = check_against_oracle(logits.to(device), labels.to(device), backend)
    assert torch.isnan(logp[1]) and logp[2] == float("-inf") and torch.isfinite(logp[0])


def test_large_magnitudes(backend, device):
    logits = random_logits((6, 2049), torch.float32, scale=1e4).to(device)
    check_against_oracle(logits, torch.randint(0, 2049, (6,), device=device), backend, temperature=0.7)


def test_strided_view_is_not_copied(backend, dtype, device):
    base = random_logits((3, 12, 389), dtype).to(device)
    ids = torch.randint(0, 389, (3, 12), device=device)
    view = base[:, :-1]
    assert not view.is_contiguous()
    check_against_oracle(view, ids[:, 1:], backend)
    shifted = kltriton.token_logprobs(base, ids, shift_labels=True, backend=backend)
    direct = kltriton.token_logprobs(view, ids[:, 1:], backend=backend)
    assert torch.equal(shifted[:, :-1], direct) and bool((shifted[:, -1] == 0).all())


def test_empty_input(backend, device):
    logits = torch.randn(0, 11, device=device, requires_grad=True)
    logp = kltriton.token_logprobs(logits, torch.zeros(0, dtype=torch.long, device=device), backend=backend)
    assert logp.shape == (0,)
    logp.sum().backward()
    assert logits.grad.shape == (0, 11)


def test_int32_labels_and_user_tensors_untouched(backend, device):
    logits = random_logits((4, 100), torch.float32).to(device)
    labels = torch.randint(0, 100, (4,), dtype=torch.int32, device=device)
    before = (logits.clone(), labels.clone())
    out = kltriton.token_logprobs(logits, labels, backend=backend)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, labels.long()[:, None]).squeeze(-1)
    assert_close(out, expected, value_atol(logits, 1.0))
    assert torch.equal(logits, before[0]) and torch.equal(labels, before[1])


def test_out_of_range_label_without_validation_gives_nan(backend, device):
    logits = random_logits((3, 50), torch.float32).to(device)
    labels = torch.tensor([1, 50, -5], device=device)
    with pytest.raises(ValueError, match="labels"):
        kltriton.token_logprobs(logits, labels, backend=backend)
    kltriton.set_validation(False)
    try:
        logits.requires_grad_()
        out = kltriton.token_logprobs(logits, labels, backend=backend)
        out.nan_to_num().sum().backward()
    finally:
        kltriton.set_validation(True)
    assert torch.isfinite(out[0]) and torch.isnan(out[1:]).all()
    assert bool((logits.grad[1:] == 0).all())


@pytest.mark.parametrize("make,error,match", [
    (lambda: (torch.randn(4, 0), torch.zeros(4, dtype=torch.long)), ValueError, "V == 0"),
    (lambda: ([[0.1, 0.2]], torch.zeros(1, dtype=torch.long)), TypeError, "logits"),
    (lambda: (torch.randn(4, 9).long(), torch.zeros(4, dtype=torch.long)), TypeError, "logits"),
    (lambda: (torch.randn(4, 9), torch.zeros(4)), TypeError, "labels"),
    (lambda: (torch.randn(4, 9), torch.zeros(5, dtype=torch.long)), ValueError, "labels"),
    (lambda: (torch.randn(4, 9), torch.zeros(4, dtype=torch.long, device="meta")), ValueError, "labels"),
])
def test_bad_input(make, error, match):
    logits, labels = make()
    with pytest.raises(error, match=match):
        kltriton.token_logprobs(logits, labels)


def test_bad_keyword_arguments():
    logits, labels = torch.randn(2, 3, 9), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        kltriton.token_logprobs(logits, labels, temperature=-1.0)
    with pytest.raises(TypeError, match="temperature"):
        kltriton.token_logprobs(logits, labels, temperature="hot")
    with pytest.raises(ValueError, match="mask"):
        kltriton.token_logprobs(logits, labels, mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens"):
        kltriton.token_logprobs(logits, labels, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="backend"):
        kltriton.token_logprobs(logits, labels, backend="gpu")


def test_sliced_logits_with_shift_labels_say_what_to_do():
    """The two conventions: unsliced logits + shift_labels=True, or logits[:, :-1] + labels[:, 1:]."""
    logits, input_ids = torch.randn(2, 6, 9), torch.randint(0, 9, (2, 6))
    with pytest.raises(ValueError, match=r"unsliced logits with shift_labels=True, or sliced logits with labels\[:, 1:\]"):
        kltriton.token_logprobs(logits[:, :-1], input_ids, shift_labels=True)
    shifted = kltriton.token_logprobs(logits, input_ids, shift_labels=True)[:, :-1]
    sliced = kltriton.token_logprobs(logits[:, :-1], input_ids[:, 1:])
    assert torch.equal(shifted, sliced)


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv("KLTRITON_BACKEND", "nope")
    with pytest.raises(ValueError, match="KLTRITON_BACKEND"):
        kltriton.token_logprobs(torch.randn(2, 9), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv("KLTRITON_BACKEND", "reference")
    assert kltriton.dispatch.resolve(None, "stream", "cpu", False) == "reference"
