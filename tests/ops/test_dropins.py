"""TRL 1.16 drop-ins (``trl.trainer.utils``): same signatures and semantics, fp32 results.

The cases follow TRL's own ``tests/test_utils.py`` (selective_log_softmax against
``gather(log_softmax(logits))`` for every dtype, the ``[..., K]`` index, ``row_mask`` zeroing,
entropy_from_logits against ``-(p * log p).sum(-1)``), here on every backend and with gradients.
"""
import pytest
import torch

import kltriton
from helpers import assert_close


def naive(logits, index, temperature=1.0):
    """TRL's documented equivalent: gather(log_softmax(logits / T)) (float64)."""
    logp = torch.log_softmax(logits.double() / temperature, -1)
    squeeze = index.dim() == logits.dim() - 1
    out = logp.gather(-1, index[..., None] if squeeze else index)
    return out[..., 0] if squeeze else out


def naive_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.fixture
def use_backend(backend, monkeypatch):
    monkeypatch.setenv("KLTRITON_BACKEND", backend)  # the drop-ins keep their libraries' signatures
    return backend


# From TRL tests/test_utils.py (selective_log_softmax): every dtype against gather(log_softmax).
def test_selective_log_softmax_every_dtype(use_backend, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 257) * 2).to(dtype)
    index = torch.randint(0, 257, (3, 5))
    got = kltriton.selective_log_softmax(logits, index)
    assert got.dtype == torch.float32 and got.shape == index.shape  # fp32: the documented difference
    assert_close(got, naive(logits, index), 2e-5)


# From TRL tests/test_utils.py: index of shape [..., K] gathers K log-probs per position.
def test_selective_log_softmax_topk_index_with_temperature_and_row_mask(use_backend):
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 131) * 3
    index = logits.topk(5, dim=-1).indices
    row_mask = (torch.rand(2, 4, 5) < 0.7).long()
    x = logits.clone().requires_grad_()
    got = kltriton.selective_log_softmax(x, index, temperature=0.8, row_mask=row_mask)
    expected = naive(logits, index, 0.8).masked_fill(row_mask == 0, 0.0)
    assert got.shape == (2, 4, 5)
    assert_close(got, expected, 2e-5)
    assert (got[row_mask == 0] == 0).all()
    upstream = torch.randn(2, 4, 5)
    grad, = torch.autograd.grad((got * upstream).sum(), x)
    x64 = logits.double().requires_grad_()
    e_grad, = torch.autograd.grad((naive(x64, index, 0.8).masked_fill(row_mask == 0, 0.0) * upstream).sum(), x64)
    assert_close(grad, e_grad, 1e-5)
    # K = 1 equals the unsqueezed single index
    one = kltriton.selective_log_softmax(logits, index[..., :1])
    assert torch.equal(one[..., 0], kltriton.selective_log_softmax(logits, index[..., 0]))


def test_selective_log_softmax_strided_view_and_bad_index(use_backend):
    logits = torch.randn(2, 6, 97)
    view = logits[:, :-1]  # the shifted view trainers pass
    index = torch.randint(0, 97, (2, 5, 3))
    assert_close(kltriton.selective_log_softmax(view, index), naive(view, index), 2e-5)
    with pytest.raises(ValueError, match="index"):
        kltriton.selective_log_softmax(logits, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        kltriton.selective_log_softmax(logits, torch.zeros(2, 6, dtype=torch.long), temperature=0.0)


def test_selective_log_softmax_and_entropy(use_backend):
    torch.manual_seed(2)
    logits = torch.randn(3, 4, 203) * 2
    index = torch.randint(0, 203, (3, 4))
    row_mask = torch.ones(3, 4, dtype=torch.long)
    row_mask[1, 2:] = 0
    x = logits.clone().requires_grad_()
    logp, entropy = kltriton.selective_log_softmax_and_entropy(x, index, temperature=1.3, row_mask=row_mask)
    assert_close(logp, naive(logits, index, 1.3).masked_fill(row_mask == 0, 0.0), 2e-5)
    assert_close(entropy, naive_entropy(logits, 1.3).masked_fill(row_mask == 0, 0.0), 2e-5)
    assert entropy.requires_grad
    _, detached = kltriton.selective_log_softmax_and_entropy(x, index, entropy_requires_grad=False)
    assert not detached.requires_grad


# From TRL tests/test_utils.py (entropy_from_logits): against -(p * log p).sum(-1), any leading shape.
@pytest.mark.parametrize("shape", [(7,), (2, 3), (2, 2, 3)])
def test_entropy_from_logits(use_backend, shape):
    torch.manual_seed(3)
    logits = torch.randn(*shape, 64) * 2
    got = kltriton.entropy_from_logits(logits)
    assert got.shape == shape and got.dtype == torch.float32
    assert_close(got, naive_entropy(logits), 2e-5)
    assert_close(kltriton.entropy_from_logits(logits, chunk_size=2), got, 0.0)
