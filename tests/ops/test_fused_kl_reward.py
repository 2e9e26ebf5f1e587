"""fused_kl_reward: shaping, per-sequence means, gradients, and parity with the seed systems' arithmetic."""

import pytest
import torch

import kltriton
from helpers import HostSyncError, assert_close, no_host_reads, random_logits


def padded_batch(batch=4, width=9, vocab=307, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits((batch, width, vocab), dtype, generator=gen)
    ref = (logits.float() + 0.3 * torch.randn(logits.shape, generator=gen)).to(dtype)
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.tensor([width, 1, 5, 0][:batch])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return logits, ref, ids, mask


def shaped_by_hand(kl, mask, coef, scores=None, score_clip=None, rewards=None):
    """The contract written out: per-token ``rewards - coef * kl`` + clipped score at the last scored position.
    ``kl`` is 0 where not scored, so ``rewards`` pass through unchanged there (0 without them)."""
    reward = (rewards if rewards is not None else torch.zeros_like(kl)) - coef * kl
    if scores is not None:
        bonus = scores.clamp(-score_clip, score_clip) if score_clip is not None else scores
        for b in range(kl.shape[0]):
            valid = mask[b].nonzero()
            if len(valid):
                reward[b, valid[-1]] += bonus[b]
    counts = mask.sum(-1)
    kl_per_seq = torch.where(counts > 0, (kl * mask).sum(-1) / counts.clamp(min=1), torch.zeros_like(counts, dtype=kl.dtype))
    return reward, kl_per_seq


@pytest.mark.parametrize("estimator", ["k1", "k3", "full"])
def test_shaping_and_gradients(backend, device, estimator):
    logits, ref, ids, mask = padded_batch()
    scores, rewards = torch.randn(4) * 20, torch.randn(4, 9)
    coef = 0.05
    to = lambda t: t.to(device)  # noqa: E731
    x = to(logits).requires_grad_()
    out = kltriton.fused_kl_reward(x, to(ref), to(ids), coef=coef, estimator=estimator, scores=to(scores),
                                   rewards=to(rewards), score_clip=10.0, mask=to(mask), backend=backend)
    g_reward, g_kl_seq = torch.randn(4, 9), torch.randn(4)
    grad, = torch.autograd.grad((out.reward * to(g_reward)).sum() + (out.kl_per_seq * to(g_kl_seq)).sum(), x)

    # Oracle: float64 token_kl (itself checked against the reference) and the shaping by hand.
    x64 = logits.double().requires_grad_()
    kl = kltriton.token_kl(x64, ref.double(), ids, estimator=estimator, mask=mask, backend="reference").kl
    reward, kl_per_seq = shaped_by_hand(kl, mask, coef, scores.double(), 10.0, rewards.double())
    e_grad, = torch.autograd.grad((reward * g_reward).sum() + (kl_per_seq * g_kl_seq).sum(), x64)
    assert_close(out.kl, kl, 2e-5, what="kl")
    assert_close(out.reward, reward, 2e-5, 1e-6, what="reward")
    assert_close(out.kl_per_seq, kl_per_seq, 2e-5, what="kl_per_seq")
    assert_close(grad, e_grad, 2e-6, what="grad")
    assert out.kl_per_seq[3] == 0  # a sequence with no scored position


def test_coef_tensor_equals_float_and_needs_no_sync(backend, device):
    logits, ref, ids, mask = (t.to(device) for t in padded_batch())
    scores = torch.randn(logits.shape[0], device=device)
    a = kltriton.fused_kl_reward(logits, ref, ids, coef=0.2, mask=mask, scores=scores, backend=backend)
    previous = kltriton.set_validation(False)  # the label checks read values by design
    try:
        kltriton.fused_kl_reward(logits, ref, ids, coef=0.2, mask=mask, backend=backend)  # warm-up: loading
        with no_host_reads(device):
            b = kltriton.fused_kl_reward(logits, ref, ids, coef=torch.tensor(0.2, device=device), mask=mask,
                                         scores=scores, backend=backend)
    finally:
        kltriton.set_validation(previous)
    assert_close(a.reward, b.reward, 1e-7)


def test_no_host_reads_catches_a_sync():
    with no_host_reads("cpu"), pytest.raises(HostSyncError):
        torch.tensor(1.0).item()


def test_packed_equals_padded(backend, device):
    logits, ref, ids, mask = padded_batch(seed=3)
    lengths = mask.sum(-1)
    scores = torch.randn(4)
    padded = kltriton.fused_kl_reward(logits, ref, ids, coef=0.1, scores=scores, estimator="k3",
                                      mask=mask, shift_labels=True, backend=backend)
    keep = mask.reshape(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    packed = kltriton.fused_kl_reward(logits.reshape(-1, 307)[keep], ref.reshape(-1, 307)[keep], ids.reshape(-1)[keep],
                                      coef=0.1, scores=scores, estimator="k3", cu_seqlens=cu, shift_labels=True,
                                      backend=backend)
    for field in ("reward", "kl", "logprobs", "ref_logprobs"):
        assert torch.equal(getattr(packed, field), getattr(padded, field).reshape(-1)[keep]), field
    assert torch.equal(packed.kl_per_seq, padded.kl_per_seq)


def test_flat_without_cu_seqlens_is_one_sequence():
    logits, ref, ids = torch.randn(10, 50), torch.randn(10, 50), torch.randint(0, 50, (10,))
    out = kltriton.fused_kl_reward(logits, ref, ids, scores=torch.tensor([2.0]))
    assert out.kl_per_seq.shape == (1,)
    assert_close(out.reward[-1], -0.1 * out.kl[-1] + 2.0, 1e-6)


def test_rewards_with_trailing_dim_and_bad_scores():
    logits, ref, ids, mask = padded_batch()
    rewards = torch.randn(4, 9, 1)
    a = kltriton.fused_kl_reward(logits, ref, ids, rewards=rewards, mask=mask)
    b = kltriton.fused_kl_reward(logits, ref, ids, rewards=rewards[..., 0], mask=mask)
    assert torch.equal(a.reward, b.reward) and a.reward.shape == (4, 9)
    with pytest.raises(ValueError, match="scores"):
        kltriton.fused_kl_reward(logits, ref, ids, scores=torch.randn(3))
    with pytest.raises(ValueError, match="rewards"):
        kltriton.fused_kl_reward(logits, ref, ids, rewards=torch.randn(4, 8))
    with pytest.raises(ValueError, match="coef"):
        kltriton.fused_kl_reward(logits, ref, ids, coef=torch.tensor([0.1, 0.2]))


# --- Parity with the seed systems (their arithmetic written as plain formulas) ---------------

def naive_logprobs(logits, labels):
    return torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_parity_llm_kl_reward_transform(layout):
    """LLM KLRewardTransform: log-probs masked with masked_fill(~mask, 0), reward - coef * (lp - ref_lp)."""
    logits, ref, ids, mask = padded_batch(seed=5)
    coef, reward_in = 0.3, torch.randn(4, 9, 1)
    lp = naive_logprobs(logits, ids).masked_fill(~mask, 0)
    ref_lp = naive_logprobs(ref, ids).masked_fill(~mask, 0)
    expected = reward_in.double() - coef * (lp - ref_lp).unsqueeze(-1)
    if layout == "padded":
        out = kltriton.fused_kl_reward(logits, ref, ids, coef=coef, rewards=reward_in, mask=mask)
        got, valid = out.reward, torch.ones_like(mask)  # unscored positions: reward_in unchanged
        expected = torch.where(mask[..., None], expected, reward_in.double())
        assert torch.equal(out.reward[~mask], reward_in[..., 0][~mask])
    else:
        keep = mask.reshape(-1)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(-1).cumsum(0)])
        out = kltriton.fused_kl_reward(logits.reshape(-1, 307)[keep], ref.reshape(-1, 307)[keep],
                                       ids.reshape(-1)[keep], coef=coef, rewards=reward_in.reshape(-1)[keep],
                                       cu_seqlens=cu)
        got, valid = out.reward, torch.ones_like(out.reward, dtype=torch.bool)
        expected = expected.reshape(-1, 1)[keep]
    assert_close(got[valid], expected[..., 0][valid] if layout == "padded" else expected[..., 0], 1e-5)
    assert_close(out.ref_logprobs, ref_lp if layout == "padded" else ref_lp[mask], 1e-5)


def test_parity_kl_computation():
    """torchrl KLComputation: kl = gen_lp - ref_lp (0 at padding); reward [..., 1] - coeff * kl.unsqueeze(-1),
    so the reward at unscored positions passes through unchanged."""
    logits, ref, ids, mask = padded_batch(seed=6)
    gen_lp, ref_lp = naive_logprobs(logits, ids), naive_logprobs(ref, ids)
    reward_in, coeff = torch.randn(4, 9, 1), 0.7
    expected = reward_in.double() - coeff * (gen_lp - ref_lp).unsqueeze(-1)
    out = kltriton.fused_kl_reward(logits, ref_lp.float(), ids, coef=coeff, rewards=reward_in, mask=mask)
    assert_close(out.reward[mask], expected[..., 0][mask], 1e-5)
    assert torch.equal(out.reward[~mask], reward_in[..., 0][~mask])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_parity_rollout_from_model(layout):
    """RolloutFromModel: log_ratio masked by attention_mask[:, :-1];
    reward = clip(score) * done - kl_coef * log_ratio with done at the terminal token."""
    torch.manual_seed(7)
    batch, width, vocab = 3, 8, 97
    generated = torch.randint(0, vocab, (batch, width))
    attention = torch.arange(width)[None] < torch.tensor([8, 5, 3])[:, None]
    logits, ref = torch.randn(batch, width, vocab) * 2, torch.randn(batch, width, vocab) * 2
    scores, kl_coef, score_clip = torch.tensor([12.0, -3.0, 0.5]), 0.1, 10.0
    log_ratio = (naive_logprobs(logits[:, :-1], generated[:, 1:]) - naive_logprobs(ref[:, :-1], generated[:, 1:]))
    step_mask = attention[:, :-1]
    log_ratio = log_ratio.masked_fill(~step_mask, 0)
    done = torch.zeros(batch, width - 1)
    done[torch.arange(batch), step_mask.sum(-1) - 1] = 1
    expected = scores.clamp(-score_clip, score_clip)[:, None] * done - kl_coef * log_ratio
    if layout == "padded":
        out = kltriton.fused_kl_reward(logits[:, :-1], ref[:, :-1], generated[:, 1:], coef=kl_coef, scores=scores,
                                       score_clip=score_clip, mask=step_mask)
        assert_close(out.reward, expected, 1e-5)
    else:
        lengths = step_mask.sum(-1)
        keep = step_mask.reshape(-1)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        flat = lambda t: t[:, :-1].reshape(-1, vocab)[keep]  # noqa: E731
        out = kltriton.fused_kl_reward(flat(logits), flat(ref), generated[:, 1:].reshape(-1)[keep], coef=kl_coef,
                                       scores=scores, score_clip=score_clip, cu_seqlens=cu)
        assert_close(out.reward, expected[step_mask], 1e-5)


def test_dropins_match_formulas(backend, device, monkeypatch):
    monkeypatch.setenv("KLTRITON_BACKEND", backend)  # the drop-ins keep their libraries' signatures
    logits, index = torch.randn(3, 5, 211, device=device), torch.randint(0, 211, (3, 5), device=device)
    trl = logits.double().gather(-1, index[..., None]).squeeze(-1) - torch.logsumexp(logits.double(), -1)
    assert_close(kltriton.selective_log_softmax(logits, index), trl, 1e-5)
    assert_close(kltriton.logprobs_of_labels(logits, index), naive_logprobs(logits, index), 1e-5)


def test_parity_verl_apply_kl_penalty():
    """verl ``apply_kl_penalty``: ``token_level_rewards = token_level_scores - beta * kld * response_mask``,
    so per-token rewards outside the response mask pass through unchanged."""
    logits, ref, ids, mask = padded_batch(seed=8)
    scores_tok, beta = torch.randn(4, 9), 0.2
    kld = (naive_logprobs(logits, ids) - naive_logprobs(ref, ids)) * mask
    expected = scores_tok.double() - beta * kld
    out = kltriton.fused_kl_reward(logits, ref, ids, coef=beta, rewards=scores_tok, mask=mask.long())
    assert_close(out.reward, expected, 1e-5)
    assert torch.equal(out.reward[~mask], scores_tok[~mask])


@pytest.mark.parametrize("layout", ["padded", "packed", "flat"])
def test_empty_batch_with_every_option(backend, layout):
    """N == 0 ([B, 0, V], or packed with cu_seqlens, or flat): empty in, empty out, with every option."""
    vocab = 11
    if layout == "padded":
        shape, seq = (3, 0), dict()
    elif layout == "packed":
        shape, seq = (0,), dict(cu_seqlens=torch.zeros(3, dtype=torch.long))
    else:
        shape, seq = (0,), dict()
    num_seqs = {"padded": 3, "packed": 2, "flat": 1}[layout]
    logits = torch.randn(*shape, vocab, requires_grad=True)
    ref = torch.randn(*shape, vocab)
    ids = torch.randint(0, vocab, shape)
    for estimator in ("k1", "k3", "full"):
        for ref_arg in (ref, torch.randn(shape)):
            if estimator == "full" and ref_arg.dim() != logits.dim():
                continue
            out = kltriton.fused_kl_reward(
                logits, ref_arg, ids, coef=torch.tensor(0.1), estimator=estimator, kl_clamp=5.0,
                scores=torch.randn(num_seqs), rewards=torch.randn(*shape, 1), score_clip=1.0,
                temperature=torch.full(shape, 0.7), mask=torch.ones(shape, dtype=torch.long),
                shift_labels=True, backend=backend, **seq)
            for t in out[:4]:
                assert t.shape == shape and t.dtype == torch.float32
            assert out.kl_per_seq.shape == (num_seqs,) and (out.kl_per_seq == 0).all()
            grad, = torch.autograd.grad(out.reward.sum() + out.kl_per_seq.sum(), logits)
            assert grad.shape == logits.shape
