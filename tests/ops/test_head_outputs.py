"""``token_logprobs(..., outputs=...)``: a trainer head's metrics (``is_top1``, ``mean_logits``, ``log_sum_sq_probs``)
on every backend against float64 definitions, through the public call (labels, mask, shift, temperature per
position); no gradient; what is refused for now. Tolerances as ``tests/kernels/test_head_statistics.py``."""
import pytest
import torch

import kltriton
from helpers import EPS32, assert_close, random_labels, random_logits


def expected(logits, labels, temperature):
    """float64 ``(is_top1, mean_logits, log_sum_sq_probs)`` at every position of sliced (convention B) inputs; 0 /
    False where the label is -100."""
    x = logits.double()
    t = temperature.double()[..., None] if torch.is_tensor(temperature) else temperature
    z = x / t
    scored = labels != -100
    label = labels.clamp(min=0)
    is_top1 = (x.argmax(-1) == label) & scored
    zero = torch.zeros((), dtype=torch.float64)
    mean = torch.where(scored, z.sum(-1) / x.shape[-1], zero)
    log_sum_sq = torch.where(scored, torch.logsumexp(2 * torch.log_softmax(z, -1), -1), zero)
    return is_top1, mean, log_sum_sq


@pytest.mark.parametrize("per_position", [False, True])
def test_outputs_match_float64(backend, dtype, device, per_position):
    vocab = 1001
    logits = random_logits((3, 7, vocab), dtype)
    labels = random_labels((3, 7), vocab)
    labels[0, 2] = int(logits[0, 2].float().argmax())       # a label that is the argmax
    logits[1, 3, 10], logits[1, 3, 900] = 40.0, 40.0        # tied maxima: the earlier one wins
    labels[1, 3], labels[1, 4] = 900, 10
    logits[1, 4, 10], logits[1, 4, 900] = 40.0, 40.0
    temperature = torch.rand(3, 7, dtype=torch.float64) * 2 + 0.25 if per_position else 0.7
    logits, labels = logits.to(device), labels.to(device)
    x = logits.clone().requires_grad_()
    out = kltriton.token_logprobs(x, labels, temperature=temperature, backend=backend,
                                  outputs=("entropy", "is_top1", "mean_logits", "log_sum_sq_probs"))
    is_top1, mean, log_sum_sq = expected(logits.cpu(), labels.cpu(), temperature)
    assert out.is_top1.dtype == torch.bool and torch.equal(out.is_top1.cpu(), is_top1)
    assert not out.is_top1[1, 3] and out.is_top1[1, 4] and out.is_top1[0, 2]
    z = logits.cpu().double() / (temperature[..., None] if per_position else temperature)
    scale = 1 + z.abs().amax().item()
    assert_close(out.log_sum_sq_probs.cpu(), log_sum_sq, 64 * EPS32 * scale, what="log_sum_sq_probs")
    assert_close(out.mean_logits.cpu(), mean, 1e-5 * z.abs().mean().item(), what="mean_logits")
    for name in ("is_top1", "mean_logits", "log_sum_sq_probs"):
        assert not getattr(out, name).requires_grad, name
    # The log-prob, the entropy and their gradient are those of the call without the head's outputs.
    logp, entropy = kltriton.token_logprobs(logits, labels, temperature=temperature, backend=backend,
                                            return_entropy=True)
    assert torch.equal(out.logp, logp) and torch.equal(out.entropy, entropy)


def test_outputs_with_shift_labels_and_mask(backend, device):
    logits = random_logits((2, 9, 257), torch.float32).to(device)
    ids = torch.randint(0, 257, (2, 9)).to(device)
    mask = torch.ones(2, 9, dtype=torch.long, device=device)
    mask[1, 6:] = 0
    out = kltriton.token_logprobs(logits, ids, mask=mask, shift_labels=True, backend=backend,
                                  outputs=["is_top1", "mean_logits"])
    assert out.entropy is None and out.log_sum_sq_probs is None
    labels = torch.full((2, 9), -100, dtype=torch.long)
    labels[:, :-1] = ids[:, 1:].cpu()
    labels[:, :-1][mask[:, 1:].cpu() == 0] = -100
    is_top1, mean, _ = expected(logits.cpu(), labels, 1.0)
    assert torch.equal(out.is_top1.cpu(), is_top1)
    assert_close(out.mean_logits.cpu(), mean, 1e-5 * logits.abs().mean().item(), what="mean_logits")
    assert not out.is_top1[:, -1].any() and (out.mean_logits[:, -1] == 0).all()


def test_mean_over_padding(backend, dtype, device):
    """``finfo.min`` padding counts at its value (a finite mean, though the fp32 sum of a few overflows); one ``-inf``
    entry makes the mean ``-inf``, as TRL's plain sum over every column."""
    logits = random_logits((3, 300), dtype)
    logits[:, 200:] = torch.finfo(dtype).min
    logits[2, 7] = float("-inf")
    labels = torch.tensor([1, 2, 3])
    out = kltriton.token_logprobs(logits.to(device), labels.to(device), temperature=0.5, backend=backend,
                                  outputs=("mean_logits",))
    _, mean, _ = expected(logits, labels, 0.5)
    assert out.mean_logits[2].item() == float("-inf") and torch.isfinite(out.mean_logits[:2]).all()
    assert_close(out.mean_logits[:2].cpu(), mean[:2], 1e-5 * mean[:2].abs().max().item(), what="mean_logits")


@pytest.mark.parametrize("tile", [None, 64 * 97], ids=["whole-vocab", "vocab-tiles"])
def test_linear_logits_match_the_dense_oracle(backend, dtype, tile):
    """An LM head (``LinearLogits``) cut into vocab tiles gives the dense logits' values: small integer hidden states
    and weights make every logit an exact integer in any summation order, with ties inside and across tiles."""
    vocab, hidden = 1001, 8
    gen = torch.Generator().manual_seed(4)
    h = torch.randint(-3, 4, (3, 5, hidden), generator=gen).to(dtype)
    w = torch.randint(-3, 4, (vocab, hidden), generator=gen).to(dtype)
    labels = random_labels((3, 5), vocab)
    logits = h.double() @ w.double().T
    labels[0, 0] = int(logits[0, 0].argmax())          # the first maximum: True
    top = (logits[0, 1] == logits[0, 1].max()).nonzero().squeeze(1)
    labels[0, 1] = int(top[-1])                        # the last of the maxima: True only if it is the only one
    head = kltriton.LinearLogits(h, w, tile_elements=tile)
    out = kltriton.token_logprobs(head, labels, temperature=0.7, backend=backend,
                                  outputs=("is_top1", "mean_logits", "log_sum_sq_probs"))
    is_top1, mean, log_sum_sq = expected(logits, labels, 0.7)
    assert torch.equal(out.is_top1, is_top1) and out.is_top1[0, 0]
    z = logits / 0.7
    assert_close(out.log_sum_sq_probs, log_sum_sq, 64 * EPS32 * (1 + z.abs().amax().item()), what="log_sum_sq_probs")
    assert_close(out.mean_logits, mean, 1e-5 * z.abs().mean().item(), what="mean_logits")


def test_outputs_refused_where_not_available():
    logits = torch.randn(4, 50)
    labels = torch.randint(0, 50, (4,))
    with pytest.raises(ValueError, match="unknown outputs"):
        kltriton.token_logprobs(logits, labels, outputs=("top1",))
    with pytest.raises(ValueError, match="return_entropy"):
        kltriton.token_logprobs(logits, labels, outputs=("entropy",), return_entropy=True)
    with pytest.raises(NotImplementedError, match="truncation"):
        kltriton.token_logprobs(logits, labels, outputs=("mean_logits",), truncation=kltriton.Truncation(top_k=5))
    previous = kltriton.set_invariant(True)
    try:
        with pytest.raises(NotImplementedError, match="invariant"):
            kltriton.token_logprobs(logits, labels, outputs=("is_top1",))
    finally:
        kltriton.set_invariant(previous)
    # Only the log-prob and the entropy: every input kind as before.
    out = kltriton.token_logprobs(kltriton.LinearLogits(torch.randn(4, 8), torch.randn(50, 8)), labels,
                                  outputs=("entropy",))
    assert out.is_top1 is None and out.entropy.shape == (4,)
