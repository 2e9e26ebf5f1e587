"""token_kl: every estimator, both reference forms, packed == padded, bad input."""
import pytest
import torch

import kltriton
from helpers import assert_close, grad_tols, random_labels, random_logits, value_atol

ESTIMATORS = ["k1", "abs", "k2", "k3", "full"]


def run_kl(logits, ref, labels, backend, upstream, **kwargs):
    x = logits.detach().clone().requires_grad_()
    out = kltriton.token_kl(x, ref, labels, backend=backend, **kwargs)
    loss = (out.kl.nan_to_num() * upstream[0] + out.logprobs.nan_to_num() * upstream[1]).sum()
    grad, = torch.autograd.grad(loss, x)
    return out, grad


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("ref_form", ["logits", "logprobs"])
def test_estimators_against_float64(backend, dtype, device, estimator, ref_form):
    if estimator == "full" and ref_form == "logprobs":
        pytest.skip("full needs reference logits")
    shape, vocab, temperature = (3, 7), 1001, 0.8
    logits = random_logits(shape + (vocab,), dtype).to(device)
    ref_logits = (logits.float() + 0.5 * torch.randn(logits.shape, device=device)).to(dtype)
    labels = random_labels(shape, vocab).to(device)
    mask = torch.rand(shape, device=device) < 0.8
    if ref_form == "logits":
        ref, ref64 = ref_logits, ref_logits.double()
    else:
        ref = kltriton.token_logprobs(ref_logits, labels, temperature=temperature, mask=mask, backend="reference")
        ref64 = ref.double()
    upstream = torch.randn((2,) + shape, device=device)
    kwargs = dict(estimator=estimator, temperature=temperature, mask=mask)
    out, grad = run_kl(logits, ref, labels, backend, upstream, **kwargs)
    exp, e_grad = run_kl(logits.double(), ref64, labels, "reference", upstream.double(), **kwargs)
    atol = value_atol(logits, temperature) * 8
    for name in ("kl", "logprobs", "ref_logprobs"):
        assert getattr(out, name).dtype == torch.float32
        assert_close(getattr(out, name), getattr(exp, name), atol, what=name)
    g_atol, g_rtol = grad_tols(logits, temperature, upstream)
    assert_close(grad, e_grad, g_atol * 4, g_rtol, what="grad")
    invalid = ~mask | (labels == -100)
    assert bool((out.kl[invalid] == 0).all()) and bool((grad[invalid] == 0).all())


def test_estimator_formulas_and_aliases(device):
    logits, ref = random_logits((64, 97), torch.float32).to(device), random_logits((64, 97), torch.float32).to(device)
    labels = torch.randint(0, 97, (64,), device=device)
    base = kltriton.token_kl(logits, ref, labels, backend="reference")
    d = base.logprobs.double() - base.ref_logprobs.double()
    expected = {"k1": d, "kl": d, "abs": d.abs(), "k2": 0.5 * d * d, "mse": 0.5 * d * d,
                "k3": torch.exp(-d) + d - 1, "low_var_kl": torch.exp(-d) + d - 1}
    for name, value in expected.items():
        assert_close(kltriton.token_kl(logits, ref, labels, estimator=name, backend="reference").kl, value, 1e-5, 1e-6,
                     what=name)
    clamped = kltriton.token_kl(logits, ref, labels, estimator="k1", kl_clamp=0.5, backend="reference").kl
    assert_close(clamped, d.clamp(-0.5, 0.5), 1e-5, what="clamp")


def test_full_against_kl_div(backend, device):
    logits, ref = random_logits((9, 3001), torch.float32).to(device), random_logits((9, 3001), torch.float32).to(device)
    labels = torch.randint(0, 3001, (9,), device=device)
    out = kltriton.token_kl(logits, ref, labels, estimator="full", temperature=1.5, backend=backend)
    expected = torch.nn.functional.kl_div(torch.log_softmax(ref.double() / 1.5, -1),
                                          torch.log_softmax(logits.double() / 1.5, -1),
                                          log_target=True, reduction="none").sum(-1)
    assert_close(out.kl, expected, 1e-5, what="full kl")


def test_kl_clamp_gradient(backend, device):
    logits = random_logits((16, 257), torch.float32).to(device)
    ref = random_logits((16, 257), torch.float32).to(device)
    labels = torch.randint(0, 257, (16,), device=device)
    upstream = torch.randn(2, 16, device=device)
    for estimator in ("k3", "full"):
        kwargs = dict(estimator=estimator, kl_clamp=0.3)
        out, grad = run_kl(logits, ref, labels, backend, upstream, **kwargs)
        exp, e_grad = run_kl(logits.double(), ref.double(), labels, "reference", upstream.double(), **kwargs)
        assert bool((out.kl.abs() <= 0.3).all())
        assert_close(grad, e_grad, 1e-5, what=f"{estimator} clamped grad")


def test_neg_inf_in_either_row(backend, device):
    logits, ref = random_logits((4, 129), torch.float32), random_logits((4, 129), torch.float32)
    logits[0, :64] = float("-inf")   # policy bans tokens: they contribute nothing
    ref[1, 5] = float("-inf")        # reference bans a token the policy uses: KL is infinite
    logits[2, 10:20] = float("-inf")
    ref[2, 10:20] = float("-inf")    # both ban the same tokens: finite
    labels = torch.tensor([100, 6, 3, 4])
    out = kltriton.token_kl(logits.to(device), ref.to(device), labels.to(device), estimator="full", backend=backend)
    exp = kltriton.token_kl(logits.double(), ref.double(), labels, estimator="full", backend="reference")
    assert out.kl[1] == float("inf") and torch.isfinite(out.kl[[0, 2, 3]]).all()
    assert_close(out.kl.cpu(), exp.kl, 1e-5, what="kl with -inf")


def pack(seqs):
    return torch.cat(seqs), torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_packed_equals_padded(backend, device, padding_side):
    vocab, lengths = 211, [5, 0, 1, 7, 3]
    gen = torch.Generator().manual_seed(0)
    seq_logits = [random_logits((n, vocab), torch.float32, generator=gen) for n in lengths]
    seq_ref = [random_logits((n, vocab), torch.float32, generator=gen) for n in lengths]
    seq_ids = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    seq_mask = [torch.rand(n, generator=gen) < 0.8 for n in lengths]
    flat_logits, cu = pack(seq_logits)
    flat_ref, _ = pack(seq_ref)
    flat_ids, _ = pack(seq_ids)
    flat_mask, _ = pack(seq_mask)
    batch, width = len(lengths), max(lengths)
    pad_logits = torch.randn(batch, width, vocab)  # padding holds garbage, never read
    pad_ref = torch.randn(batch, width, vocab)
    pad_ids = torch.full((batch, width), 7)
    pad_mask = torch.zeros(batch, width, dtype=torch.bool)
    where = []
    for b, n in enumerate(lengths):
        cols = slice(0, n) if padding_side == "right" else slice(width - n, width)
        pad_logits[b, cols], pad_ref[b, cols], pad_ids[b, cols] = seq_logits[b], seq_ref[b], seq_ids[b]
        pad_mask[b, cols] = seq_mask[b]
        where.append((b, cols))
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    for estimator in ("k3", "full"):
        packed = kltriton.token_kl(*to(flat_logits, flat_ref, flat_ids), estimator=estimator,
                                   mask=flat_mask.to(device), cu_seqlens=cu.to(device), shift_labels=True,
                                   backend=backend)
        padded = kltriton.token_kl(*to(pad_logits, pad_ref, pad_ids), estimator=estimator, mask=pad_mask.to(device),
                                   shift_labels=True, backend=backend)
        for field in packed._fields:
            rebuilt = torch.cat([getattr(padded, field)[b, cols] for b, cols in where])
            assert torch.equal(getattr(packed, field), rebuilt), field
    # The last position of every sequence has no next token in its sequence: never scored.
    ends = (cu[1:] - 1)[torch.tensor(lengths) > 0]
    assert bool((packed.kl[ends.to(device)] == 0).all())


def test_all_masked_batch(backend, device):
    logits = random_logits((2, 5, 64), torch.float32).to(device).requires_grad_()
    out = kltriton.token_kl(logits, random_logits((2, 5, 64), torch.float32).to(device),
                            torch.randint(0, 64, (2, 5), device=device), estimator="full",
                            mask=torch.zeros(2, 5, dtype=torch.bool, device=device), backend=backend)
    assert bool((out.kl == 0).all()) and bool((out.logprobs == 0).all())
    out.kl.sum().backward()
    assert bool((logits.grad == 0).all())


def test_reference_gets_no_gradient(backend, device):
    logits = random_logits((3, 40), torch.float32).to(device).requires_grad_()
    ref = random_logits((3, 40), torch.float32).to(device).requires_grad_()
    out = kltriton.token_kl(logits, ref, torch.tensor([1, 2, 3], device=device), estimator="full", backend=backend)
    out.kl.sum().backward()
    assert ref.grad is None and logits.grad is not None and bool(logits.grad.abs().sum() > 0)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(estimator="nope"), ValueError, "estimator"),
    (dict(estimator="full", ref="logprobs"), ValueError, "full"),
    (dict(ref="wrong_shape"), ValueError, "ref"),
    (dict(labels="wrong_shape"), ValueError, "labels"),
    (dict(labels="float"), TypeError, "labels"),
    (dict(logits="int"), TypeError, "logits"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(kl_clamp=-1.0), ValueError, "kl_clamp"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 6])), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 3, 5])), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([1, 3, 6])), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0.0, 6.0])), TypeError, "cu_seqlens"),
    (dict(mask="float"), TypeError, "mask"),  # integer masks are accepted (HF attention_mask)
    (dict(backend="cuda"), ValueError, "backend"),
])
def test_bad_input(kwargs, error, match):
    logits, ref, labels = torch.randn(6, 10), torch.randn(6, 10), torch.randint(0, 10, (6,))
    args = dict(kwargs)
    if args.pop("ref", None) == "logprobs":
        ref = torch.randn(6)
    elif kwargs.get("ref") == "wrong_shape":
        ref = torch.randn(6, 9)
    if args.get("labels") == "wrong_shape":
        labels = torch.randint(0, 10, (5,))
    elif args.get("labels") == "float":
        labels = labels.float()
    if args.pop("logits", None) == "int":
        logits = logits.long()
    if args.get("mask") == "float":
        args["mask"] = torch.ones(6)
    args.pop("labels", None)
    with pytest.raises(error, match=match):
        kltriton.token_kl(logits, ref, labels, **args)
