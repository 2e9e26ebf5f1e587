"""The float64 oracle of truncated sampling: vLLM v1's sampler steps applied literally (shared by the truncation
tests; a support module, not a test).

vLLM v1 (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``, the min-p logits processor): divide by the
temperature; min-p masks ``probs < min_p * max(probs)``; then the rows are sorted ascending, top-k masks the values
``<`` the k-th largest, top-p takes the softmax of the sorted rows, its cumulative sum, masks ``cumsum <= 1 - p``
(never the last, largest entry), and the rows are scattered back. The log-probs are ``log_softmax`` of the result
(vLLM's ``logprobs_mode="processed_logprobs"``).
"""
import math

import torch


def per_row(value, n, off, dtype):
    if value is None:
        return torch.full((n,), off, dtype=dtype)
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(dtype) if value.numel() == n else value.to(dtype)
    return torch.full((n,), value, dtype=dtype)


def vllm_logprobs(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """``[N, V]`` float64 log-probs of the truncated distribution (``-inf`` outside the kept set); the knobs are
    numbers or ``[N]`` tensors with vLLM's "off" values (top_k 0 / V, top_p 1, min_p 0)."""
    x = logits.reshape(-1, logits.shape[-1]).double()
    n, vocab = x.shape
    t = temperature if not isinstance(temperature, torch.Tensor) else temperature.reshape(-1, 1).double()
    z = x / t
    k, p, mp = per_row(top_k, n, 0, torch.long), per_row(top_p, n, 1.0, torch.float64), per_row(min_p, n, 0.0,
                                                                                                   torch.float64)
    probs = z.softmax(-1)
    invalid = probs < probs.amax(-1, keepdim=True) * mp[:, None]
    z = z.masked_fill(invalid & (mp > 0)[:, None], -math.inf)
    zs, idx = z.sort(-1, descending=False)
    k_on = (k > 0) & (k < vocab)
    kth = zs.gather(1, (vocab - k.clamp(1, vocab))[:, None])
    zs = zs.masked_fill((zs < kth) & k_on[:, None], -math.inf)
    p_on = p < 1
    cums = zs.softmax(-1).cumsum(-1)
    mask = cums <= 1 - p[:, None]
    mask[:, -1] = False
    zs = zs.masked_fill(mask & p_on[:, None], -math.inf)
    z = z.scatter(-1, idx, zs)
    return z.log_softmax(-1).reshape(logits.shape)


def distinct_logits(shape, scale=3.0, generator=None) -> torch.Tensor:
    """Random float64 logits without ties (a random permutation of spread values per row), so a top-p cut never
    falls inside a tie (where vLLM's sort order, undefined, would decide)."""
    base = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
    return base + torch.arange(shape[-1], dtype=torch.float64)[torch.randperm(shape[-1], generator=generator)] * 1e-6
