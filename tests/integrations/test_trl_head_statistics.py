"""``token_logprobs(outputs=...)`` against TRL's own fused LM head (``trl.kernels.chunked_logprob``, its torch path on
CPU), which fills ``FusedCausalLMOutput``: the same is_top1, mean_logits and log_sum_sq_probs per token."""
import pytest
import torch

pytest.importorskip("trl")

import kltriton  # noqa: E402
from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: E402

OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tile", [None, 64 * 97], ids=["whole-vocab", "vocab-tiles"])
def test_head_outputs_match_trl(backend, temperature, tile):
    """Small integer hidden states and weights: every logit is an exact integer in any summation order (TRL's and
    kltriton's tiles agree bit for bit on the logits), with many tied maxima."""
    gen = torch.Generator().manual_seed(0)
    n, hidden, vocab = 37, 16, 1003
    h = torch.randint(-3, 4, (n, hidden), generator=gen).float()
    w = torch.randint(-3, 4, (vocab, hidden), generator=gen).float()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    logits = h @ w.T
    labels[:8] = logits[:8].argmax(-1)  # top-1 labels
    labels[8] = int((logits[8] == logits[8].max()).nonzero()[-1])  # the last of the maxima
    with torch.no_grad():
        logp, entropy, log_sum_sq, mean, is_top1 = ChunkedLogProbFunction.apply(
            h, w, None, labels, temperature, 256, None, 1.0, OUTPUTS)
    out = kltriton.token_logprobs(kltriton.LinearLogits(h, w, tile_elements=tile), labels, temperature=temperature,
                                  backend=backend, outputs=OUTPUTS)
    dense = kltriton.token_logprobs(logits, labels, temperature=temperature, backend=backend, outputs=OUTPUTS)
    for got in (out, dense):
        assert torch.equal(got.is_top1, is_top1)
        torch.testing.assert_close(got.mean_logits, mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(got.log_sum_sq_probs, log_sum_sq, rtol=0, atol=2e-5)
        torch.testing.assert_close(got.logp, logp, rtol=0, atol=5e-5)
    assert is_top1[:8].all()
