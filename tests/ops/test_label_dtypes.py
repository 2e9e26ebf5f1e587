"""Labels of every integer dtype give the int64 labels' results, bit for bit, on every backend; the error for a
non-integer dtype says so."""
import pytest
import torch

import kltriton
from helpers import random_logits

V = 37  # odd, not a multiple of any block
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.uint16, torch.uint32,
                  torch.uint64)


def _inputs():
    torch.manual_seed(0)
    logits, ref = random_logits((2, 5, V), torch.float32), random_logits((2, 5, V), torch.float32)
    labels = torch.randint(0, V, (2, 5))
    mask = torch.rand(2, 5) > 0.3
    return logits, ref, labels, mask


def _outputs(logits, ref, labels, mask, backend, ignore_index):
    """Every op's outputs and the policy loss's logits gradient (upstream 0.7: not 1) for these labels."""
    common = dict(mask=mask, ignore_index=ignore_index, backend=backend)
    x = logits.clone().requires_grad_(True)
    loss = kltriton.policy_loss(x, labels, torch.randn(2, generator=torch.Generator().manual_seed(1)), ref=ref,
                                kl_coef=0.1, **common).loss
    (0.7 * loss).backward()
    return [
        *kltriton.token_logprobs(logits, labels, shift_labels=True, return_entropy=True, **common),
        *kltriton.token_kl(logits, ref, labels, estimator="k3", **common),
        kltriton.fused_kl_reward(logits, ref, labels, scores=torch.tensor([1.0, -2.0]), **common).reward,
        kltriton.token_divergence(logits, ref, labels, divergence="forward_kl", **common),
        loss.detach(), x.grad,
    ]


def test_every_integer_dtype_gives_the_int64_results(backend):
    logits, ref, labels, mask = _inputs()
    ignore_index = 100  # past the vocabulary, and every integer dtype holds it
    labels = labels.masked_fill(torch.tensor([[True, False, False, False, False]] * 2), ignore_index)
    expected = _outputs(logits, ref, labels, mask, backend, ignore_index)
    # the scored log-probs against float64
    oracle = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, labels[:, 1:, None].clamp(0, V - 1))[..., 0]
    scored = (labels[:, 1:] != ignore_index) & mask[:, 1:]
    assert torch.allclose(expected[0][:, :-1][scored].double(), oracle[scored], atol=1e-5, rtol=0)
    assert (expected[0][:, :-1][~scored] == 0).all() and (expected[0][:, -1] == 0).all()
    for dtype in INTEGER_DTYPES:
        got = _outputs(logits, ref, labels.to(dtype), mask, backend, ignore_index)
        for e, g in zip(expected, got):
            assert g.dtype == e.dtype and torch.equal(g, e), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64])
def test_a_non_integer_dtype_is_refused_naming_the_rule(dtype):
    logits, _, labels, _ = _inputs()
    with pytest.raises(TypeError, match=r"labels must be an integer tensor \(any integer dtype"):
        kltriton.token_logprobs(logits, labels.to(dtype))
