"""The oracle itself: the reference backend in float64 against naive full-softmax PyTorch."""
import pytest
import torch

import kltriton
from kltriton.kernels.stream import reference
from helpers import assert_close, kernel_forward, random_labels, random_logits, temp


def naive_logprobs(logits, labels, temperature, ignore_index=-100):
    logp_all = torch.log_softmax(logits.double() / temperature, -1)
    valid = labels != ignore_index
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_matches_naive_values_and_grads(temperature):
    logits = random_logits((5, 9, 301), torch.float64).requires_grad_()
    labels = random_labels((5, 9), 301)
    g1, g2 = torch.randn(5, 9, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    lp, ent = kltriton.token_logprobs(logits, labels, temperature=temperature, return_entropy=True, backend="reference")
    grad, = torch.autograd.grad((lp * g1 + ent * g2).sum(), logits)
    lp_n, ent_n = naive_logprobs(logits, labels, temperature)
    grad_n, = torch.autograd.grad((lp_n * g1 + ent_n * g2).sum(), logits)
    assert_close(lp, lp_n, 1e-6, what="logp")  # outputs are fp32 by contract
    assert_close(ent, ent_n, 1e-6, what="entropy")
    assert_close(grad, grad_n, 1e-12, what="grad")


def test_reference_full_kl_matches_kl_div():
    logits, ref = random_logits((7, 513), torch.float64), random_logits((7, 513), torch.float64)
    target = torch.randint(0, 513, (7,))
    stats = kernel_forward(reference, logits, ref, target, temp(1.3), full_kl=True)
    expected = torch.nn.functional.kl_div(torch.log_softmax(ref / 1.3, -1), torch.log_softmax(logits / 1.3, -1),
                                          log_target=True, reduction="none").sum(-1)
    assert_close(stats.full_kl, expected, 1e-6, what="full kl")


def test_reference_memory_is_chunked(monkeypatch):
    """Rows are processed a chunk at a time: the chunk size bounds the temporaries."""
    seen = []
    original = reference._log_softmax_rows
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 4 * 1000)
    monkeypatch.setattr(reference, "_log_softmax_rows", lambda rows, t: seen.append(rows.shape[0]) or original(rows, t))
    kernel_forward(reference, random_logits((37, 1000), torch.float32), None, torch.randint(0, 1000, (37,)), temp(1.0),
                   entropy=True)
    assert max(seen) <= 4 and sum(seen) == 37 + 1  # the lone last row is reduced twice (batch invariance)
