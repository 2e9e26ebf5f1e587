"""``Truncation``: the truncated distribution's log-probs against vLLM v1's steps applied literally in float64
(``truncation_oracle``), on every backend that runs the family; replay; gradients; the ops that take it; bad input.

A top-p cut is a comparison of cumulative sums: where the oracle's cumulative mass lies within ``AMBIGUOUS``
(relative) of the goal at the cut, fp32 sums (the kernels', and vLLM's own) may cut one token either way, so those
rows are left out of the exact comparison (``ambiguous_rows``); the random inputs make them rare.
"""
import math

import pytest
import torch

import kltriton
from helpers import STORE_RTOL, assert_close, leave_world, value_atol
from truncation_oracle import distinct_logits, vllm_logprobs

AMBIGUOUS = 1e-4
KNOBS = [dict(top_k=7), dict(top_p=0.8), dict(min_p=0.05), dict(top_k=30, top_p=0.9, min_p=0.02),
         dict(top_k=3, min_p=0.3), dict(top_p=0.5, min_p=0.01)]


@pytest.fixture(params=("reference", "cpp", "triton"))
def tbackend(request):
    """The backends that run the truncation family here (Triton on CPU tensors through its interpreter)."""
    usable, why = kltriton.dispatch.availability(request.param, "truncation")
    if not usable:
        pytest.skip(f"{request.param}: {why}")
    return request.param


def ambiguous_rows(logits64, temperature, top_p, full=None):
    """Rows whose top-p cut lies within ``AMBIGUOUS`` of a neighbouring cumulative sum, or inside a tie that vLLM
    cuts part of (its sort order decides; these semantics keep a tie whole) (float64 oracle ``full``)."""
    if top_p is None:
        return torch.zeros(logits64.shape[0], dtype=torch.bool)
    z = (logits64 / temperature).double()
    probs = z.softmax(-1).sort(-1, descending=True).values
    before = probs.cumsum(-1) - probs
    near = ((before - top_p).abs() < AMBIGUOUS).any(-1)
    if full is None:
        return near
    kept = torch.isfinite(full)
    cut = torch.where(kept, logits64, torch.tensor(math.inf, dtype=torch.float64)).amin(-1, keepdim=True)
    at_cut = logits64 == cut
    return near | ((at_cut & ~kept).any(-1))


def sample_labels(logp_full, gen):
    """Labels drawn from the truncated distribution, and one per row outside it where the row cuts anything."""
    labels = torch.multinomial(logp_full.exp(), 1, generator=gen).squeeze(1)
    labels[1] = logp_full[1].argmin()
    return labels


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
@pytest.mark.parametrize("temperature", (1.0, 0.6))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
def test_recompute_matches_vllm(tbackend, knobs, temperature, dtype):
    gen = torch.Generator().manual_seed(3)
    logits = distinct_logits((9, 1271), generator=gen).to(dtype)
    full = vllm_logprobs(logits.double(), temperature, **knobs)
    labels = sample_labels(full, gen)
    logp, entropy = kltriton.token_logprobs(logits, labels, temperature=temperature, return_entropy=True,
                                            truncation=kltriton.Truncation(**knobs), backend=tbackend)
    ok = ~ambiguous_rows(logits.double(), temperature, knobs.get("top_p"), full)
    expected = full.gather(1, labels[:, None]).squeeze(1)
    p = full.exp()
    expected_h = -torch.where(p > 0, p * full, torch.zeros_like(p)).sum(-1)
    tol = value_atol(logits, temperature)
    assert ok.sum() >= 5
    assert_close(logp[ok], expected[ok], tol, what="logp")
    assert_close(entropy[ok], expected_h[ok], 4 * tol, what="entropy")
    assert logp[1] == float("-inf")  # the label outside the kept set


def test_per_position_and_per_sequence_knobs(tbackend):
    gen = torch.Generator().manual_seed(5)
    logits = distinct_logits((3, 5, 211), generator=gen).float()
    top_k = torch.tensor([4, 0, 50])                         # per sequence (0: off)
    top_p = torch.rand(3, 5, generator=gen) * 0.6 + 0.35      # per position
    temperature = torch.rand(3, 5, generator=gen, dtype=torch.float64) + 0.5
    t = kltriton.Truncation(top_k=top_k, top_p=top_p.double(), min_p=0.01)
    full = vllm_logprobs(logits.view(15, -1).double(), temperature.view(-1, 1), top_k=top_k.repeat_interleave(5),
                         top_p=top_p.view(-1).double(), min_p=0.01)
    labels = sample_labels(full, gen).view(3, 5)
    logp = kltriton.token_logprobs(logits, labels, temperature=temperature.float(), truncation=t, backend=tbackend)
    expected = full.gather(1, labels.view(-1, 1)).view(3, 5)
    amb = torch.stack([ambiguous_rows(logits.view(15, -1)[i:i + 1].double(), temperature.view(-1)[i].item(),
                                      top_p.view(-1)[i].item()) for i in range(15)]).view(3, 5)
    assert_close(logp[~amb], expected[~amb], value_atol(logits, 0.5), what="logp")


def test_ties_at_the_kth_value_are_kept(tbackend):
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0, 2.0, -1.0]])
    for label, kept in ((3, True), (6, False)):
        logp = kltriton.token_logprobs(logits, torch.tensor([label]), truncation=kltriton.Truncation(top_k=2),
                                       backend=tbackend)
        expected = vllm_logprobs(logits.double(), top_k=2)[0, label]
        assert bool(torch.isfinite(logp[0])) == kept and bool(torch.isfinite(expected)) == kept
        if kept:
            assert_close(logp, expected.reshape(1), 1e-6)


@pytest.mark.parametrize("as_tensor", (False, True))
def test_disabled_values_are_the_untruncated_results_bit_for_bit(tbackend, as_tensor):
    gen = torch.Generator().manual_seed(1)
    logits = distinct_logits((6, 300), generator=gen).float().requires_grad_()
    labels = torch.randint(0, 300, (6,), generator=gen)
    knobs = dict(top_k=0, top_p=1.0, min_p=0.0)
    if as_tensor:  # tensors take the kernel path with a floor of -inf
        knobs = dict(top_k=torch.zeros(6, dtype=torch.long), top_p=torch.ones(6, dtype=torch.float64),
                     min_p=torch.zeros(6, dtype=torch.float64))
    upstream = torch.randn(6, generator=gen)
    plain, plain_h = kltriton.token_logprobs(logits, labels, temperature=0.7, return_entropy=True, backend=tbackend)
    (g_plain,) = torch.autograd.grad((plain * upstream).sum() + plain_h.sum(), logits)
    trunc, trunc_h = kltriton.token_logprobs(logits, labels, temperature=0.7, return_entropy=True, backend=tbackend,
                                             truncation=kltriton.Truncation(**knobs))
    (g_trunc,) = torch.autograd.grad((trunc * upstream).sum() + trunc_h.sum(), logits)
    assert torch.equal(plain, trunc) and torch.equal(plain_h, trunc_h) and torch.equal(g_plain, g_trunc)


def test_gradient_is_the_restricted_softmax_and_zero_outside(tbackend):
    gen = torch.Generator().manual_seed(2)
    logits = distinct_logits((8, 517), generator=gen).float()
    knobs = dict(top_k=40, top_p=0.85)
    full = vllm_logprobs(logits.double(), 0.8, **knobs)
    labels = sample_labels(full, gen)
    upstream = torch.randn(8, generator=gen) * 3
    x = logits.clone().requires_grad_()
    logp, entropy = kltriton.token_logprobs(x, labels, temperature=0.8, return_entropy=True, backend=tbackend,
                                            truncation=kltriton.Truncation(**knobs))
    (grad,) = torch.autograd.grad((logp.masked_fill(torch.isinf(logp), 0) * upstream).sum() + entropy.sum(), x)
    # float64 autograd through the oracle's restricted log-softmax (the kept set held fixed)
    x64 = logits.double().requires_grad_()
    kept = torch.isfinite(full)
    lp64 = torch.where(kept, x64 / 0.8, torch.tensor(-math.inf, dtype=torch.float64)).log_softmax(-1)
    label_lp = lp64.gather(1, labels[:, None]).squeeze(1)
    safe = torch.where(kept, lp64, torch.zeros_like(lp64))
    ent64 = -torch.where(kept, safe.exp() * safe, torch.zeros_like(lp64)).sum(-1)
    inside = torch.isfinite(label_lp)
    (expected,) = torch.autograd.grad((torch.where(inside, label_lp, 0) * upstream).sum() + ent64.sum(), x64)
    ok = ~ambiguous_rows(logits.double(), 0.8, 0.85)
    assert bool((grad[~kept] == 0).all())
    assert_close(grad[ok], expected[ok], 1e-4, STORE_RTOL[torch.float32], what="grad")
    assert not bool(inside[1]) and torch.isfinite(grad[1]).all()


def test_replay_matches_recompute_and_vllm(tbackend):
    gen = torch.Generator().manual_seed(4)
    logits = distinct_logits((2, 6, 401), generator=gen).float()
    knobs = dict(top_k=20, top_p=0.9)
    full = vllm_logprobs(logits.view(12, -1).double(), 0.9, **knobs)
    labels = sample_labels(full, gen).view(2, 6)
    kept = torch.isfinite(full)
    k = int(kept.sum(-1).max())
    ids = torch.where(kept, torch.arange(401).expand(12, -1), torch.full((12, 401), -1)).sort(-1, descending=True)
    support = ids.values[:, :k + 3].view(2, 6, -1)          # the kept ids, -1 padded
    x = logits.clone().requires_grad_()
    logp, entropy = kltriton.token_logprobs(x, labels, temperature=0.9, return_entropy=True, backend=tbackend,
                                            truncation=kltriton.Truncation(support=support))
    expected = full.gather(1, labels.view(-1, 1)).view(2, 6)
    assert_close(logp, expected, value_atol(logits, 0.9), what="replay logp")
    (grad,) = torch.autograd.grad(logp.masked_fill(torch.isinf(logp), 0).sum() + entropy.sum(), x)
    assert bool((grad.view(12, -1)[~kept] == 0).all())
    recomputed = kltriton.token_logprobs(logits, labels, temperature=0.9, truncation=kltriton.Truncation(**knobs),
                                         backend=tbackend)
    ok = ~ambiguous_rows(logits.view(12, -1).double(), 0.9, 0.9).view(2, 6)
    assert_close(recomputed[ok], logp[ok].detach(), value_atol(logits, 0.9))


def replay_oracle(logits, support, temperature):
    """``(log-probs [N, V], kept [N, V])`` in float64 of each row restricted to the set of its ``support`` ids
    (``-1`` padding, repeats counted once): ``-inf`` outside the kept set, a row that keeps nothing all ``-inf``.
    Differentiable w.r.t. ``logits`` (float64, ``[N, V]``) without a NaN in the backward."""
    ids = support.reshape(logits.shape[0], -1)
    kept = torch.zeros(logits.shape, dtype=torch.long).scatter_add_(1, ids.clamp(min=0), (ids >= 0).long()) > 0
    z = torch.where(kept, logits / temperature, torch.tensor(-math.inf, dtype=torch.float64))
    some = kept.any(-1, keepdim=True)
    z = torch.where(some, z, torch.zeros_like(z))  # no kept id: no distribution (masked below)
    logp = z - torch.logsumexp(z, -1, keepdim=True)
    return torch.where(kept, logp, torch.tensor(-math.inf, dtype=torch.float64)), kept


def _replay_case(gen, dtype, n=10, vocab=401):
    """Logits with ``finfo.min`` stretches and a ragged support: ``-1`` padded, repeated ids, a row whose label is
    outside its kept set, a row that keeps nothing, a row that keeps one id, a kept ``finfo.min`` logit."""
    logits = distinct_logits((n, vocab), generator=gen).to(dtype)
    logits[:, ::9] = torch.finfo(dtype).min
    support = torch.full((n, 30), -1, dtype=torch.long)
    counts = torch.randint(2, 25, (n,), generator=gen)
    labels = torch.empty(n, dtype=torch.long)
    for row in range(n):
        ids = torch.randperm(vocab, generator=gen)[:counts[row]]
        support[row, :counts[row]] = ids
        support[row, counts[row]:counts[row] + 3] = ids[:3]                   # repeated ids
        labels[row] = ids[torch.randint(0, int(counts[row]), (1,), generator=gen)]
    labels[1] = next(v for v in range(vocab) if not bool((support[1] == v).any()))  # outside the kept set
    support[2] = -1                                                           # keeps nothing
    support[3, 1:] = support[3, 0]                                            # one id, repeated
    labels[3] = support[3, 0]
    support[4, 5] = 9                                                         # a finfo.min logit kept
    return logits, support, labels


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
def test_replay_padding_and_repeats_against_float64(tbackend, dtype):
    """Values and gradients (random upstream on the log-prob, entropy with weight 0.3) of a ragged, ``-1``-padded
    support with repeated ids against float64 autograd through the restricted softmax: finite gradients (the
    NaN of issue 33 came from a ``where`` whose untaken branch was ``-inf``), zero outside the kept set."""
    gen = torch.Generator().manual_seed(21)
    logits, support, labels = _replay_case(gen, dtype)
    upstream = torch.randn(labels.shape, generator=gen) * 2
    x = logits.clone().requires_grad_()
    logp, entropy = kltriton.token_logprobs(x, labels, temperature=0.8, return_entropy=True, backend=tbackend,
                                            truncation=kltriton.Truncation(support=support))
    (grad,) = torch.autograd.grad((logp * upstream).sum() + 0.3 * entropy.sum(), x)

    x64 = logits.double().requires_grad_()
    lp64, kept = replay_oracle(x64, support, 0.8)
    label_lp = lp64.gather(1, labels[:, None]).squeeze(1)
    inside = torch.isfinite(label_lp)
    safe = torch.where(kept, lp64, 0.0)
    ent64 = -torch.where(kept, safe.exp() * safe, 0.0).sum(-1)
    (expected,) = torch.autograd.grad((torch.where(inside, label_lp, 0.0) * upstream).sum() + 0.3 * ent64.sum(), x64)
    tol = value_atol(logits, 0.8)
    assert_close(logp, label_lp, tol, what="logp")
    assert_close(entropy, ent64, 4 * tol, what="entropy")
    assert logp[1] == -math.inf and logp[2] == -math.inf and entropy[2] == 0 and logp[3] == 0 and entropy[3] == 0
    assert torch.isfinite(grad).all() and bool((grad[~kept] == 0).all()) and bool((grad[2] == 0).all())
    assert_close(grad, expected, 4 * tol * 2, STORE_RTOL[dtype], what="grad")


def test_replay_bad_support_id_on_a_device_is_flagged_without_a_host_read(tbackend, monkeypatch):
    """On a device a support id outside ``[-1, V)`` is not read on the host: it is recorded in the device's flag vector,
    its position gives NaN (no gradient), every other position and its gradient are the call's without it, and
    ``kltriton.check_inputs()`` raises it (once). Run on CPU with the host check off, as on a device (on CPU the call
    raises at once)."""
    gen = torch.Generator().manual_seed(21)  # (a seed whose rows keep 3 ids or more: _replay_case repeats three)
    logits, support, labels = _replay_case(gen, torch.float32)
    bad = support.clone()
    bad[4, 1] = 401 + 76

    def run(ids):
        x = logits.clone().requires_grad_()
        logp = kltriton.token_logprobs(x, labels, backend=tbackend, truncation=kltriton.Truncation(support=ids))
        logp.masked_fill(~torch.isfinite(logp), 0).sum().backward()
        return logp, x.grad

    want, want_grad = run(support)
    with pytest.raises(ValueError, match="support ids must lie in"):
        run(bad)
    monkeypatch.setattr(kltriton._inputs, "host_checks", lambda device=None: False)
    got, got_grad = run(bad)
    others = torch.arange(len(labels)) != 4
    assert torch.isnan(got[4]) and not torch.isnan(want).any() and bool((got_grad[4] == 0).all())
    assert torch.equal(got[others], want[others]) and torch.equal(got_grad[others], want_grad[others])
    with pytest.raises(ValueError, match=r"support ids must lie in \[0, V\) or be -1 \(padding\); found 477"):
        kltriton.check_inputs()
    kltriton.check_inputs()  # cleared


@pytest.mark.parametrize("loss_type", ("ppo", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "gpg", "clip_cov",
                                       "kl_cov", "geo_mean", "dppo_tv", "vespo"))
def test_replay_policy_loss_gradient_is_finite_and_drops_empty_rows(tbackend, loss_type):
    """``policy_loss`` differentiates the entropy even with ``entropy_coef=0``: with a ``-1``-padded support its
    logits gradient is finite for every loss type (issue 33's repro), and a scored position whose support is all
    ``-1`` keeps nothing: log-prob ``-inf``, counted in ``outside_support_frac`` and dropped, no gradient."""
    gen = torch.Generator().manual_seed(22)
    logits = torch.randn(2, 4, 8, generator=gen)
    support = torch.tensor([0, 1, 2, -1]).expand(2, 4, 4).clone()
    support[1, 2] = -1
    labels = torch.zeros(2, 4, dtype=torch.long)
    advantages, old = torch.randn(2, 4, generator=gen), torch.full((2, 4), -1.1)
    truncation = kltriton.Truncation(support=support)
    x = logits.clone().requires_grad_()
    out = kltriton.policy_loss(x, labels, advantages, old_logprobs=old, loss_type=loss_type, truncation=truncation,
                               backend=tbackend)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all(), loss_type
    assert out.logprobs[1, 2] == -math.inf and bool((x.grad[1, 2] == 0).all())
    assert bool((x.grad[..., 3:] == 0).all())
    assert_close(out.metrics["outside_support_frac"], torch.tensor(1 / 8), 1e-7)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 2] = False
    masked = kltriton.policy_loss(logits, labels, advantages, old_logprobs=old, loss_type=loss_type, mask=mask,
                                  truncation=truncation, backend=tbackend)
    assert_close(out.loss, masked.loss, 1e-6, 1e-6, what="the dropped position as a masked one")


def _replay_outputs(logits, labels, support, backend, upstream):
    x = logits.clone().requires_grad_()
    logp, entropy = kltriton.token_logprobs(x, labels, temperature=0.7, return_entropy=True, backend=backend,
                                            truncation=kltriton.Truncation(support=support))
    (grad,) = torch.autograd.grad((logp.masked_fill(logp.isinf(), 0) * upstream).sum() - 0.2 * entropy.sum(), x)
    return logp, entropy, grad


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
def test_replay_is_bitwise_independent_of_padding_order_and_batch(tbackend, dtype):
    """Every bit of the values and gradients is independent of how wide the support is padded (its tight width,
    41 and 512 columns), of the order and repetitions of the ids, and of the other rows (a row alone against the
    row inside the batch)."""
    gen = torch.Generator().manual_seed(23)
    logits, support, labels = _replay_case(gen, dtype)
    upstream = torch.randn(labels.shape, generator=gen)
    tight = max(int((support >= 0).sum(-1).max()), 1)
    canonical = torch.where(support >= 0, support, torch.iinfo(torch.long).max).sort(-1).values[:, :tight]
    canonical = torch.where(canonical == torch.iinfo(torch.long).max, -1, canonical)
    expected = _replay_outputs(logits, labels, canonical, tbackend, upstream)
    widths = {}
    for width in (41, 512):
        padded = torch.full((support.shape[0], width), -1, dtype=torch.long)
        padded[:, :support.shape[1]] = support
        widths[width] = padded[:, torch.randperm(width, generator=gen)]   # padding and repeats anywhere
    for name, wide in widths.items():
        for field, a, e in zip(("logp", "entropy", "grad"), _replay_outputs(logits, labels, wide, tbackend,
                                                                            upstream), expected):
            assert torch.equal(a, e), f"K={name}: {field} differs"
    for row in (0, 4, 7):
        alone = _replay_outputs(logits[row:row + 1], labels[row:row + 1], widths[41][row:row + 1], tbackend,
                                upstream[row:row + 1])
        for field, a, e in zip(("logp", "entropy", "grad"), alone, expected):
            assert torch.equal(a[0], e[row]), f"row {row} alone: {field} differs"


def test_replay_ops_pass_opcheck(tbackend):
    """The replay custom ops (``kltriton::replay_columns``, ``kltriton::replay_statistics``): schema, fake tensors and
    autograd registration, as ``torch.library.opcheck`` checks them (``torch.compile`` traces through them)."""
    from kltriton.kernels import constants
    from kltriton.ops import truncation as ops

    gen = torch.Generator().manual_seed(24)
    logits = torch.randn(2, 3, 50, generator=gen, requires_grad=True)
    ids = ops.replay_support(torch.randint(-1, 50, (6, 7), generator=gen), tbackend)
    target = torch.where(ids[:, 0] >= 0, ids[:, 0], 3)
    target[1] = constants.SKIP
    temperature = torch.tensor(0.8, dtype=torch.float64)
    torch.library.opcheck(ops._columns_op.overload, (logits, ids, tbackend))
    values = ops.replay_columns(logits.detach(), ids, tbackend).requires_grad_()
    for request in (0, constants.ENTROPY):
        torch.library.opcheck(ops._replay_statistics_op.overload, (values, ids, target, temperature, request,
                                                                    tbackend))


def test_replay_compiles_fullgraph(tbackend):
    """``torch.compile(fullgraph=True)`` traces replay (its support, columns, statistics and their backward are
    custom ops) and gives the eager values and gradient, bitwise."""
    from torch._dynamo.testing import CompileCounterWithBackend

    gen = torch.Generator().manual_seed(25)
    x = torch.randn(4, 50, generator=gen).requires_grad_()
    labels = torch.randint(0, 50, (4,), generator=gen)
    support = x.detach().topk(8).indices
    support[:, 6:] = -1
    support[1, 3] = support[1, 2]

    def loss(x, labels, support):
        logp, entropy = kltriton.token_logprobs(x, labels, temperature=0.9, return_entropy=True, backend=tbackend,
                                                truncation=kltriton.Truncation(support=support))
        return logp.masked_fill(logp.isinf(), 0).sum() + entropy.sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    got, expected = compiled(x, labels, support), loss(x, labels, support)
    assert torch.equal(got, expected) and counter.frame_count == 1
    assert torch.equal(torch.autograd.grad(got, x)[0], torch.autograd.grad(expected, x)[0])


def test_packed_equals_padded(tbackend):
    gen = torch.Generator().manual_seed(6)
    logits = distinct_logits((2, 5, 333), generator=gen).float()
    labels = torch.randint(0, 333, (2, 5), generator=gen)
    top_p = torch.tensor([0.7, 0.95], dtype=torch.float64)
    padded = kltriton.token_logprobs(logits, labels, shift_labels=True, backend=tbackend,
                                     truncation=kltriton.Truncation(top_p=top_p, top_k=25))
    cu = torch.tensor([0, 5, 10])
    packed = kltriton.token_logprobs(logits.view(10, -1), labels.view(-1), cu_seqlens=cu, shift_labels=True,
                                     backend=tbackend, truncation=kltriton.Truncation(top_p=top_p, top_k=25))
    assert torch.equal(padded.view(-1), packed)


@pytest.mark.parametrize("replay", (False, True))
def test_linear_logits(tbackend, replay):
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 4, 16, generator=gen)
    weight = torch.randn(257, 16, generator=gen)
    bias = torch.randn(257, generator=gen)
    dense = ((hidden @ weight.t() + bias) * 0.5)
    dense = 6.0 * torch.tanh(dense / 6.0)
    labels = torch.randint(0, 257, (3, 4), generator=gen)
    if replay:
        support = dense.topk(12).indices
        support[0, 0, 5:] = -1
        truncation = kltriton.Truncation(support=support)
    else:
        truncation = kltriton.Truncation(top_k=10, min_p=0.01)
    d = dense.detach().requires_grad_()
    expected = kltriton.token_logprobs(d, labels, temperature=0.8, truncation=truncation, backend=tbackend)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    linear = kltriton.LinearLogits(h, w, b, logit_scale=0.5, softcap=6.0, tile_elements=2 * 257)
    actual = kltriton.token_logprobs(linear, labels, temperature=0.8, truncation=truncation, backend=tbackend)
    assert_close(actual, expected, 1e-4, what="LinearLogits logp")
    upstream = torch.randn(3, 4, generator=gen)
    finite = torch.isfinite(expected)
    (expected * upstream).masked_fill(~finite, 0).sum().backward()
    (actual * upstream).masked_fill(~finite, 0).sum().backward()
    dense_ref = (hidden.requires_grad_() @ weight.t() + bias) * 0.5
    dense_ref = 6.0 * torch.tanh(dense_ref / 6.0)
    (d_h,) = torch.autograd.grad(dense_ref, hidden, d.grad)
    assert_close(h.grad, d_h, 1e-4, 1e-4, what="hidden grad")
    if replay:  # every bit independent of the support's padding width and order
        wide = torch.cat([support, torch.full((3, 4, 29), -1)], -1)[..., torch.randperm(41, generator=gen)]
        h2, w2, b2 = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
        linear = kltriton.LinearLogits(h2, w2, b2, logit_scale=0.5, softcap=6.0, tile_elements=2 * 257)
        again = kltriton.token_logprobs(linear, labels, temperature=0.8, truncation=kltriton.Truncation(support=wide),
                                        backend=tbackend)
        (again * upstream).masked_fill(~finite, 0).sum().backward()
        assert torch.equal(again, actual) and torch.equal(h2.grad, h.grad) and torch.equal(w2.grad, w.grad)
        assert torch.equal(b2.grad, b.grad)


def test_policy_loss_and_reward_drop_rows_outside_the_kept_set(tbackend):
    gen = torch.Generator().manual_seed(8)
    logits = distinct_logits((2, 6, 301), generator=gen).float().requires_grad_()
    ref = distinct_logits((2, 6, 301), generator=gen).float()
    truncation = kltriton.Truncation(top_k=5)
    labels = logits.detach().argmax(-1)
    labels[0, 2] = logits[0, 2].detach().argmin()           # outside the kept set
    out = kltriton.policy_loss(logits, labels, torch.randn(2, 6, generator=gen), ref=ref, kl_coef=0.1,
                               old_logprobs=torch.full((2, 6), -1.0), entropy_coef=0.01, backend=tbackend,
                               truncation=truncation)
    assert torch.isfinite(out.loss) and out.logprobs[0, 2] == float("-inf")
    assert out.ratio[0, 2] == 0 and out.kl[0, 2] == 0
    assert_close(out.metrics["outside_support_frac"], torch.tensor(1 / 12), 1e-6)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all() and bool((logits.grad[0, 2] == 0).all())
    # the other rows as if the dropped one were masked
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 2] = False
    masked = kltriton.policy_loss(logits, labels, out.logprobs.new_ones(2, 6), ref=ref, kl_coef=0.1,
                                  old_logprobs=torch.full((2, 6), -1.0), mask=mask, backend=tbackend,
                                  truncation=truncation)
    again = kltriton.policy_loss(logits, labels, out.logprobs.new_ones(2, 6), ref=ref, kl_coef=0.1,
                                 old_logprobs=torch.full((2, 6), -1.0), backend=tbackend, truncation=truncation)
    assert_close(again.loss, masked.loss, 1e-6)
    reward = kltriton.fused_kl_reward(logits, ref, labels, scores=torch.tensor([1.0, 2.0]), backend=tbackend,
                                      truncation=truncation)
    assert torch.isfinite(reward.reward).all() and reward.kl[0, 2] == 0
    kl = kltriton.token_kl(logits, ref, labels, estimator="k3", backend=tbackend, truncation=truncation)
    assert kl.kl[0, 2] == float("inf") and torch.isfinite(kl.kl.view(-1)[torch.arange(12) != 2]).all()


def test_bad_input():
    logits = torch.randn(2, 3, 10)
    labels = torch.randint(0, 10, (2, 3))
    T = kltriton.Truncation
    for kwargs, error in ((dict(top_p=0.0), ValueError), (dict(top_p=1.5), ValueError),
                          (dict(min_p=-0.1), ValueError), (dict(min_p=1.2), ValueError),
                          (dict(top_p=float("nan")), ValueError), (dict(top_k=2.5), TypeError),
                          (dict(top_p=torch.tensor([0.5, 0.0])), ValueError),
                          (dict(top_k=torch.tensor([1.0])), TypeError), (dict(top_k=True), TypeError)):
        with pytest.raises(error, match=list(kwargs)[0]):
            T(**kwargs)
    with pytest.raises(ValueError, match="support"):
        T(top_k=3, support=torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="support"):
        T(support=torch.zeros(2, 3, 4))
    for ids, match in ((torch.full((2, 3, 4), 10), r"\[0, V=10\)"), (torch.full((2, 3, 4), -2), "-1"),
                       (torch.zeros(2, 4, 4, dtype=torch.long), "shape")):
        with pytest.raises(ValueError, match=match):
            kltriton.token_logprobs(logits, labels, truncation=T(support=ids))
    with pytest.raises(ValueError, match="top_k"):
        kltriton.token_logprobs(logits, labels, truncation=T(top_k=torch.tensor([1, 2, 3, 4])))
    with pytest.raises(TypeError, match="truncation"):
        kltriton.token_logprobs(logits, labels, truncation=dict(top_k=3))
    with pytest.raises(ValueError, match="full"):
        kltriton.token_kl(logits, logits, labels, estimator="full", truncation=T(top_k=3))
    before = logits.clone()
    kltriton.token_logprobs(logits, labels, truncation=T(top_k=3, top_p=0.5))
    assert torch.equal(before, logits)


def _vocab_parallel_worker(rank, world, init_file, report_dir):
    import json
    import os

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    sizes = {2: (300, 207), 3: (400, 300, 301)}[world]            # uneven shards
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    gen = torch.Generator().manual_seed(0)
    x = distinct_logits((4, 5, sum(sizes)), generator=gen).float()
    labels = x.argmax(-1)
    labels[0, 0] = x[0, 0].argmin()
    support = torch.cat([x.topk(30).indices, torch.full((4, 5, 7), -1)], -1)   # -1 padded, repeated ids, a row
    support[..., 30:33] = support[..., :3]                                     # that keeps nothing
    support[1, 2] = -1
    report = {}
    for name, truncation in (("recompute", kltriton.Truncation(top_k=40, top_p=0.9, min_p=0.01)),
                             ("replay", kltriton.Truncation(support=support))):
        full, part = x.clone().requires_grad_(), x[..., start:stop].clone().requires_grad_()
        a, ha = kltriton.token_logprobs(full, labels, temperature=0.9, truncation=truncation, backend="cpp",
                                        return_entropy=True)
        b, hb = kltriton.token_logprobs(part, labels, temperature=0.9, truncation=truncation, backend="cpp",
                                        process_group=dist.group.WORLD, return_entropy=True)
        weight = 0.5 if name == "replay" else 0.0
        (a.masked_fill(a.isinf(), 0).sum() + weight * ha.sum()).backward()
        (b.masked_fill(b.isinf(), 0).sum() + weight * hb.sum()).backward()
        if name == "replay":  # the K values are exchanged exactly (one rank holds each), then the same arithmetic
            report[name] = (torch.equal(a, b) and torch.equal(ha, hb)
                            and torch.equal(full.grad[..., start:stop], part.grad))
            continue
        same = torch.equal(a.isinf(), b.isinf()) and torch.allclose(a[a.isfinite()], b[b.isfinite()], atol=1e-5)
        report[name] = same and torch.allclose(full.grad[..., start:stop], part.grad, atol=1e-6)
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    leave_world()


@pytest.mark.parametrize("world", (2, 3))
def test_vocab_parallel_gloo(world):
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp
    if not kltriton.dispatch.availability("cpp", "truncation")[0]:
        pytest.skip("the C++ backend is unavailable")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_vocab_parallel_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world)
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                assert json.load(f) == {"recompute": True, "replay": True}
