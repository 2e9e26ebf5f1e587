"""token_divergence: every divergence against float64 PyTorch, dense / LinearLogits / TopK teachers, reductions,
extreme teacher logits, packed == padded, opcheck and a fullgraph compile, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import kltriton
from helpers import MIXED_GRAD_RTOL, assert_close, grad_tols, random_labels, random_logits, temp, value_atol
from kltriton import dispatch
from kltriton.kernels import SKIP, statistics
from kltriton.kernels.linear import Side
from kltriton.ops import divergence as ops
from kltriton.ops._define import NeedsGrad

CASES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.1), ("jsd", 0.5), ("jsd", 0.9),
         ("jsd", 1.0)]


def _kl(log_a, log_b):
    """KL(a || b) over the last dim, float64, with no term where a == 0 (and +inf where b == 0 < a)."""
    live = log_a > float("-inf")
    la, lb = torch.where(live, log_a, 0.0), torch.where(live, log_b, 0.0)
    return torch.where(live, la.exp() * (la - lb), 0.0).sum(-1)


def oracle(student, teacher, kind, beta, temperature):
    """Per-position divergence in float64 from the dense softmaxes (the definitions, TRL's beta convention)."""
    ls = torch.log_softmax(student.double() / temperature, -1)
    lt = torch.log_softmax(teacher.double() / temperature, -1)
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return _kl(lt, ls)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return _kl(ls, lt)
    b = torch.tensor(beta, dtype=torch.float64)
    both = (ls > float("-inf")) | (lt > float("-inf"))
    lm = torch.logaddexp(torch.where(both, ls, 0.0) + torch.log1p(-b), torch.where(both, lt, 0.0) + torch.log(b))
    lm = torch.where(both, lm, float("-inf"))
    return b * _kl(lt, lm) + (1 - b) * _kl(ls, lm)


def _scored(labels, mask=None):
    scored = labels != -100
    return scored if mask is None else scored & mask


@pytest.mark.parametrize("divergence,beta", CASES)
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_dense_against_float64(backend, dtype, device, divergence, beta, reduction):
    """Values and gradients with a random upstream against the float64 definitions; unscored positions 0."""
    if reduction != "none" and dtype != torch.float32:
        pytest.skip("the reduced loss's gradient route is dtype-independent: fp32 covers it")
    shape, vocab, temperature = (3, 7), 1001, 0.8
    student = random_logits(shape + (vocab,), dtype).to(device)
    teacher = (student.float() + torch.randn(student.shape, device=device)).to(dtype)
    labels = random_labels(shape, vocab).to(device)
    mask = torch.rand(shape, device=device) < 0.8
    x = student.detach().clone().requires_grad_()
    out = kltriton.token_divergence(x, teacher, labels, divergence=divergence, beta=beta, temperature=temperature,
                                    reduction=reduction, mask=mask, backend=backend)
    x64 = student.double().requires_grad_()
    expected = torch.where(_scored(labels, mask), oracle(x64, teacher, divergence, beta, temperature), 0.0)
    upstream = torch.randn(shape, device=device) if reduction == "none" else torch.tensor(1.7, device=device)
    grad, = torch.autograd.grad((out * upstream).sum(), x)
    if reduction == "sum":
        expected = expected.sum()
    e_grad, = torch.autograd.grad((expected * upstream.double()).sum(), x64)
    assert out.dtype == torch.float32
    atol = value_atol(student, temperature) * 8 * (1 if reduction == "none" else shape[0] * shape[1])
    assert_close(out, expected, atol, 1e-6, what="divergence")
    g_atol, g_rtol = grad_tols(student, temperature, upstream.reshape(-1))
    assert_close(grad, e_grad, g_atol * 4, MIXED_GRAD_RTOL[dtype], what="grad")
    if reduction == "none":
        unscored = ~_scored(labels, mask)
        assert bool((out[unscored] == 0).all()) and bool((grad[unscored] == 0).all())


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_reductions_are_trl_gkd_reductions(backend, device, reduction):
    """``batchmean`` = sum / scored count, ``sum``, ``mean`` = sum / (count * V); gradients written in the forward
    equal autograd through the per-position divergence."""
    student = random_logits((2, 6, 257), torch.float32).to(device)
    teacher = random_logits((2, 6, 257), torch.float32).to(device)
    labels = random_labels((2, 6), 257).to(device)
    count = (labels != -100).sum().item()
    denominator = {"batchmean": count, "sum": 1, "mean": count * 257}[reduction]
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        x, y = student.clone().requires_grad_(), student.clone().requires_grad_()
        loss = kltriton.token_divergence(x, teacher, labels, divergence=divergence, beta=0.3, reduction=reduction,
                                         backend=backend)
        per = kltriton.token_divergence(y, teacher, labels, divergence=divergence, beta=0.3, backend=backend)
        (loss * 2.0).backward()
        (per.sum() / denominator * 2.0).backward()
        assert loss.dim() == 0
        assert_close(loss, per.sum() / denominator, 1e-6, 1e-5, what=f"{divergence} {reduction}")
        assert_close(x.grad, y.grad, 1e-9, 1e-5, what=f"{divergence} {reduction} grad")
    empty = torch.full((2, 6), -100, device=device)
    assert kltriton.token_divergence(student, teacher, empty, reduction=reduction, backend=backend).item() == 0.0


def test_entropy_and_mixed_teacher_dtype(backend, device):
    """``return_entropy`` is the student's entropy (token_logprobs'), from the same pass; a bf16 student with an
    fp32 teacher is read as it is."""
    student = random_logits((4, 5, 301), torch.bfloat16).to(device)
    teacher = random_logits((4, 5, 301), torch.float32).to(device)
    labels = random_labels((4, 5), 301).to(device)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        for reduction in ("none", "batchmean"):
            value, entropy = kltriton.token_divergence(student, teacher, labels, divergence=divergence,
                                                       reduction=reduction, temperature=0.9, return_entropy=True,
                                                       backend=backend)
            _, expected = kltriton.token_logprobs(student, labels, temperature=0.9, return_entropy=True,
                                                  backend=backend)
            assert_close(entropy, expected, 1e-6, 1e-6, what="entropy")
            per = oracle(student, teacher, divergence, 0.5, 0.9)
            per = torch.where(labels != -100, per, 0.0)
            target = per if reduction == "none" else per.sum() / (labels != -100).sum()
            assert_close(value, target, 2e-5, 1e-5, what=f"{divergence} {reduction}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_masked_teacher_logits(backend, device, temperature):
    """``-inf``, ``finfo.min`` and ``-1e30`` teacher / student logits: a teacher without mass (``-inf``) where the
    student has some gives ``+inf`` reverse KL (and a student without mass where the teacher has some ``+inf``
    forward KL), never NaN; every other value finite and exact (``-1e30`` under the other side's mass is a huge
    finite log-ratio); the JSD always finite."""
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(6, 700, generator=gen) * 3
    teacher = student + torch.randn(6, 700, generator=gen)
    low = torch.finfo(torch.float32).min if temperature == 1.0 else -1e30  # finfo.min / 0.7 is beyond fp32
    teacher[0, 10:20] = float("-inf")                                      # banned by the teacher only
    teacher[1, 5] = -1e30                                                  # a huge, finite log-ratio
    student[2, 100:120] = float("-inf")                                    # banned by the student only
    student[3, :350] = low                                                 # both masked alike
    teacher[3, :350] = low
    student[4, ::2] = float("-inf")
    teacher[4, ::2] = float("-inf")
    labels = torch.arange(6) + 500
    rkl = kltriton.token_divergence(student, teacher, labels, divergence="reverse_kl", temperature=temperature,
                                    backend=backend)
    fkl = kltriton.token_divergence(student, teacher, labels, divergence="forward_kl", temperature=temperature,
                                    backend=backend)
    jsd = kltriton.token_divergence(student, teacher, labels, divergence="jsd", beta=0.4, temperature=temperature,
                                    backend=backend)
    assert not torch.isnan(torch.stack([rkl, fkl, jsd])).any()
    assert torch.isinf(rkl[0]) and torch.isfinite(rkl[1:]).all()
    assert torch.isinf(fkl[2]) and torch.isfinite(fkl[[0, 1, 3, 4, 5]]).all()
    assert torch.isfinite(jsd).all()
    for name, got, kind in (("rkl", rkl, "reverse_kl"), ("fkl", fkl, "forward_kl"), ("jsd", jsd, "jsd")):
        assert_close(got, oracle(student, teacher, kind, 0.4, temperature).float(), 2e-5, 1e-5, what=name)
    x = student.clone().requires_grad_()
    kltriton.token_divergence(x, teacher, labels, divergence="jsd", beta=0.4, temperature=temperature,
                              backend=backend).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_finfo_min_teacher_under_student_mass(backend, device):
    """A teacher at ``finfo.min`` where the student has mass (one entry; a one-hot teacher): the reverse KL is the
    huge float64 value (finite in fp32: 1e37 to 1e38), never ``+inf`` or NaN, with a NaN-free gradient; the forward
    KL and the JSD stay finite and exact."""
    gen = torch.Generator().manual_seed(11)
    student = torch.randn(3, 300, generator=gen) * 2
    teacher = student + torch.randn(3, 300, generator=gen)
    teacher[0, 10] = torch.finfo(torch.float32).min
    teacher[1] = torch.finfo(torch.float32).min
    teacher[1, 5] = 0.0
    student[1, 5] = 12.0  # the student's mass mostly there: a reverse KL of ~1e38, not beyond fp32
    student, teacher = student.to(device), teacher.to(device)
    labels = torch.zeros(3, dtype=torch.long, device=device)
    for divergence in ("reverse_kl", "forward_kl", "jsd"):
        for reduction in ("none", "sum"):
            x = student.clone().requires_grad_()
            out = kltriton.token_divergence(x, teacher, labels, divergence=divergence, reduction=reduction,
                                            backend=backend)
            out.sum().backward()
            assert not torch.isnan(out).any() and not torch.isnan(x.grad).any(), (divergence, reduction)
            expected = oracle(student, teacher, divergence, 0.5, 1.0)
            if divergence == "reverse_kl":
                assert bool((expected[:2] >= 1e35).all())
            target = expected.float() if reduction == "none" else expected.sum().float()
            assert torch.isfinite(out).all()
            assert_close(out, target, 2e-5, 1e-5, what=f"{divergence} {reduction}")


@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_finfo_min_under_the_other_sides_mass_is_the_float64_value(backend, temperature):
    """Issue 33: a ``finfo.min`` logit on one side where the other side has mass gives a divergence near 1e36 that
    fp32 holds (``x / T`` is beyond fp32, its term is not), on every backend: the float64 value, not ``+inf``
    (C++ AVX-512 and Triton scaled ``x - max`` by ``log2(e) / T`` before multiplying by the mass). Student at
    ``finfo.min`` under teacher mass: the forward KL; the mirror: the reverse KL; both at once; the JSD (bounded)
    stays exact. Fused (``"sum"``) and unfused (``"none"``) routes, gradients free of NaN."""
    gen = torch.Generator().manual_seed(31)
    student = torch.randn(4, 257, generator=gen) * 2
    teacher = torch.randn(4, 257, generator=gen) * 2
    low = torch.finfo(torch.float32).min
    student[0, 3] = low                       # forward KL ~ q_3 * 3.4e38 / T
    teacher[1, 5] = low                       # reverse KL ~ p_5 * 3.4e38 / T
    student[2, 7], teacher[2, 9] = low, low   # both
    student[3, ::2] = low                     # every other student logit, the teacher's mass on half of them
    labels = torch.zeros(4, dtype=torch.long)
    for divergence, beta in (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0), ("jsd", 1.0)):
        expected = oracle(student, teacher, divergence, beta, temperature)
        assert bool(torch.isfinite(expected.float()).all()) and bool((expected.max() > 1e30) or divergence == "jsd")
        for reduction in ("none", "sum"):
            x = student.clone().requires_grad_()
            out = kltriton.token_divergence(x, teacher, labels, divergence=divergence, beta=beta,
                                            reduction=reduction, temperature=temperature, backend=backend)
            out.sum().backward()
            target = expected.float() if reduction == "none" else expected.sum().float()
            assert_close(out, target, 2e-5, 2e-6, what=f"{divergence} beta={beta} {reduction}")
            assert not torch.isnan(x.grad).any(), (divergence, beta, reduction)


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1), ("jsd", 0.5),
                                             ("jsd", 0.9)])
def test_identical_distributions_diverge_by_exactly_zero(backend, dtype, divergence, beta):
    """A student and a teacher with the same logits (``finfo.min`` and ``-inf`` entries included): the divergence is
    exactly +0 on every backend and route (the JSD went down to -3.3e-8), its gradient 0 up to rounding; nearly
    identical ones are never negative."""
    gen = torch.Generator().manual_seed(32)
    student = random_logits((6, 1000), dtype, generator=gen)
    student[1, ::5] = torch.finfo(dtype).min
    student[2, 10:40] = float("-inf")
    labels = torch.zeros(6, dtype=torch.long)
    for reduction in ("none", "sum"):
        x = student.clone().requires_grad_()
        out = kltriton.token_divergence(x, student.clone(), labels, divergence=divergence, beta=beta,
                                        reduction=reduction, temperature=0.7, backend=backend)
        out.sum().backward()
        assert bool((out == 0).all()) and not torch.signbit(out).any(), (reduction, out)
        assert_close(x.grad, torch.zeros_like(x.grad), 1e-6, what=f"{reduction} grad")  # 0 up to rounding
    nearly = student.float() + torch.randn(student.shape, generator=gen) * 1e-3
    out = kltriton.token_divergence(student, nearly, labels, divergence=divergence, beta=beta, temperature=0.7,
                                    backend=backend)
    assert bool((out >= 0).all()) and not torch.signbit(out).any(), out


def test_packed_equals_padded(backend, device):
    """A ``[B, T]`` batch with a mask and ``shift_labels`` and the same sequences packed with ``cu_seqlens``: the
    same values, bitwise (batch invariance), and the same gradient."""
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 3, 6]
    student = torch.randn(3, 6, 203, generator=gen)
    teacher = torch.randn(3, 6, 203, generator=gen)
    ids = torch.randint(0, 203, (3, 6), generator=gen)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    flat = torch.cat([student[b, :n] for b, n in enumerate(lengths)])
    flat_teacher = torch.cat([teacher[b, :n] for b, n in enumerate(lengths)])
    flat_ids = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])
    cu = torch.tensor([0, 5, 8, 14])
    topk = torch.topk(teacher, 4, -1).indices
    flat_topk = torch.cat([topk[b, :n] for b, n in enumerate(lengths)])
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        for make in (lambda t, i: t, lambda t, i: kltriton.TopK(i, torch.log_softmax(t, -1).gather(-1, i))):
            padded_teacher, packed_teacher = make(teacher, topk), make(flat_teacher, flat_topk)
            x = student.clone().requires_grad_()
            padded = kltriton.token_divergence(x, padded_teacher, ids, divergence=divergence, mask=mask,
                                               shift_labels=True, temperature=0.9, backend=backend)
            y = flat.clone().requires_grad_()
            packed = kltriton.token_divergence(y, packed_teacher, flat_ids, divergence=divergence, cu_seqlens=cu,
                                               shift_labels=True, temperature=0.9, backend=backend)
            assert torch.equal(torch.cat([padded[b, :n] for b, n in enumerate(lengths)]), packed), divergence
            padded.sum().backward()
            packed.sum().backward()
            assert_close(torch.cat([x.grad[b, :n] for b, n in enumerate(lengths)]), y.grad, 1e-7, 1e-6,
                         what=f"{divergence} grad")


# --- LinearLogits ----------------------------------------------------------------------------------------------

def _heads(dtype, gen):
    hidden = torch.randn(3, 5, 24, generator=gen).to(dtype)
    weight = (torch.randn(301, 24, generator=gen) / 2).to(dtype)
    bias = torch.randn(301, generator=gen).to(dtype)
    teacher_hidden = (hidden.float() + 0.3 * torch.randn(hidden.shape, generator=gen)).to(dtype)
    teacher_weight = (weight.float() + 0.1 * torch.randn(weight.shape, generator=gen)).to(dtype)
    return hidden, weight, bias, teacher_hidden, teacher_weight


@pytest.mark.parametrize("teacher_form", ["linear", "logits"])
@pytest.mark.parametrize("reduction", ["none", "batchmean"])
def test_linear_logits(backend, teacher_form, reduction):
    """Student as ``LinearLogits`` (bias, logit_scale, softcap; vocab tiles of 100 for the two-pass route, whole
    rows for the loss); teacher as ``LinearLogits`` or logits: values and the hidden / weight / bias gradients
    against float64 on the dense logits."""
    gen = torch.Generator().manual_seed(4)
    hidden, weight, bias, teacher_hidden, teacher_weight = _heads(torch.float32, gen)
    labels = random_labels((3, 5), 301)
    teacher_logits = F.linear(teacher_hidden, teacher_weight)

    def head(h, w, b):
        return 20.0 * torch.tanh(0.8 * F.linear(h, w, b) / 20.0)

    for divergence, beta in (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)):
        params = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        student = kltriton.LinearLogits(*params, logit_scale=0.8, softcap=20.0, tile_elements=64 * 100)
        teacher = (kltriton.LinearLogits(teacher_hidden, teacher_weight, tile_elements=64 * 100)
                   if teacher_form == "linear" else teacher_logits)
        out = kltriton.token_divergence(student, teacher, labels, divergence=divergence, beta=beta,
                                        temperature=0.9, reduction=reduction, backend=backend)
        upstream = torch.randn(3, 5, generator=gen) if reduction == "none" else torch.tensor(1.3)
        (out * upstream).sum().backward()
        params64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
        expected = torch.where(labels != -100, oracle(head(*params64), teacher_logits, divergence, beta, 0.9), 0.0)
        if reduction == "batchmean":
            expected = expected.sum() / (labels != -100).sum()
        (expected * upstream.double()).sum().backward()
        assert_close(out, expected, 2e-5, 1e-5, what=f"{divergence} {reduction}")
        for name, p, q in zip(("hidden", "weight", "bias"), params, params64):
            assert_close(p.grad, q.grad, 1e-5, 1e-4, what=f"{divergence} {reduction} d_{name}")


def test_tensor_student_linear_teacher(backend):
    """A logits student with a ``LinearLogits`` teacher (the linear family with a dense policy side)."""
    gen = torch.Generator().manual_seed(5)
    _, _, _, teacher_hidden, teacher_weight = _heads(torch.float32, gen)
    student = random_logits((3, 5, 301), torch.float32, generator=gen)
    labels = random_labels((3, 5), 301)
    teacher = kltriton.LinearLogits(teacher_hidden, teacher_weight, tile_elements=64 * 100)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        for reduction in ("none", "sum"):
            x = student.clone().requires_grad_()
            out = kltriton.token_divergence(x, teacher, labels, divergence=divergence, reduction=reduction,
                                            backend=backend)
            out.sum().backward()
            x64 = student.double().requires_grad_()
            expected = torch.where(labels != -100, oracle(x64, F.linear(teacher_hidden, teacher_weight), divergence,
                                                          0.5, 1.0), 0.0)
            expected.sum().backward()
            assert_close(out.sum(), expected.sum(), 1e-4, 1e-5, what=divergence)
            assert_close(x.grad, x64.grad, 1e-6, 1e-4, what=f"{divergence} grad")


# --- TopK teacher ----------------------------------------------------------------------------------------------

def topk_oracle(student, ids, teacher_logp, kind, beta, tail, temperature, min_logprob=None):
    """The top-k divergences in float64, written out bin by bin from the student's full softmax."""
    vocab = student.shape[-1]
    ls_full = torch.log_softmax(student.double() / temperature, -1)
    valid = ids >= 0
    ls = ls_full.gather(-1, ids.clamp(min=0))
    lt = teacher_logp.double()
    if min_logprob is not None:
        ls, lt = ls.clamp(min=min_logprob), lt.clamp(min=min_logprob)
    ls = torch.where(valid, ls, float("-inf"))
    lt = torch.where(valid, lt, float("-inf"))
    if tail == "renormalize":
        ls, lt = ls - torch.logsumexp(ls, -1, keepdim=True), lt - torch.logsumexp(lt, -1, keepdim=True)
    elif tail == "bucket":
        covered = valid.sum(-1, keepdim=True) >= vocab
        s_rest = (1 - ls.exp().sum(-1, keepdim=True)).clamp(min=0)
        t_rest = (1 - lt.exp().sum(-1, keepdim=True)).clamp(min=0)
        s_rest, t_rest = torch.where(covered, 0.0, s_rest), torch.where(covered, 0.0, t_rest)
        ls = torch.cat([ls, torch.where(s_rest > 0, s_rest.clamp(min=1e-300).log(), float("-inf"))], -1)
        lt = torch.cat([lt, torch.where(t_rest > 0, t_rest.clamp(min=1e-300).log(), float("-inf"))], -1)
    if kind == "forward_kl":
        return _kl(lt, ls)
    if kind == "reverse_kl":
        return _kl(ls, lt)
    b = torch.tensor(beta, dtype=torch.float64)
    both = (ls > float("-inf")) | (lt > float("-inf"))
    lm = torch.logaddexp(torch.where(both, ls, 0.0) + torch.log1p(-b), torch.where(both, lt, 0.0) + torch.log(b))
    lm = torch.where(both, lm, float("-inf"))
    return b * _kl(lt, lm) + (1 - b) * _kl(ls, lm)


def _topk_teacher(teacher, k, gen, pad=True):
    ids = torch.topk(teacher + torch.rand(teacher.shape, generator=gen), k, -1).indices
    logp = torch.log_softmax(teacher, -1).gather(-1, ids)
    if pad:
        ids[0, 1, -1] = -1   # a padded slot
        ids[1, 2, 1:] = -1   # one id only
    return ids, logp


@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
def test_topk_against_float64(backend, dtype, tail):
    """Values and gradients with a random upstream, padding ids, a position with one id, both tails."""
    gen = torch.Generator().manual_seed(6)
    student = random_logits((2, 4, 999), dtype, generator=gen)
    teacher = student.float() + torch.randn(student.shape, generator=gen)
    ids, logp = _topk_teacher(teacher, 16, gen)
    labels = random_labels((2, 4), 999)
    for divergence, beta in (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1), ("jsd", 0.9)):
        x = student.clone().requires_grad_()
        out = kltriton.token_divergence(x, kltriton.TopK(ids, logp), labels, divergence=divergence, beta=beta,
                                        tail=tail, temperature=0.8, backend=backend)
        upstream = torch.randn(2, 4, generator=gen)
        (out * upstream).sum().backward()
        x64 = student.double().requires_grad_()
        expected = torch.where(labels != -100, topk_oracle(x64, ids, logp, divergence, beta, tail, 0.8), 0.0)
        (expected * upstream.double()).sum().backward()
        assert_close(out, expected, value_atol(student, 0.8) * 8, 1e-5, what=f"{divergence} {tail}")
        g_atol, _ = grad_tols(student, 0.8, upstream)
        assert_close(x.grad, x64.grad, g_atol * 4, MIXED_GRAD_RTOL[dtype], what=f"{divergence} {tail} grad")


def test_topk_repeated_ids_count_once(backend):
    """A ``TopK`` id repeated at a position counts once, at its first occurrence (the replay support's rule): the
    same values and gradients, bitwise, as the ids with the repeats replaced by ``-1``, and the float64 value."""
    gen = torch.Generator().manual_seed(33)
    student = random_logits((2, 3, 300), torch.float32, generator=gen)
    teacher = random_logits((2, 3, 300), torch.float32, generator=gen)
    ids, logp = _topk_teacher(teacher, 6, gen, pad=False)
    repeated = torch.cat([ids, ids[..., :2], ids[..., 4:5]], -1)
    repeated_logp = torch.cat([logp, torch.full((2, 3, 3), -0.5)], -1)   # ignored: the first occurrence counts
    unique = torch.cat([ids, torch.full((2, 3, 3), -1)], -1)
    assert torch.equal(kltriton.TopK(repeated, repeated_logp).ids, unique)
    labels = torch.zeros(2, 3, dtype=torch.long)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        results = []
        for teacher_ids, teacher_logp in ((repeated, repeated_logp), (unique, repeated_logp)):
            x = student.clone().requires_grad_()
            out = kltriton.token_divergence(x, kltriton.TopK(teacher_ids, teacher_logp), labels,
                                            divergence=divergence, backend=backend)
            out.sum().backward()
            results.append((out, x.grad))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1]), divergence
        expected = topk_oracle(student.double(), unique, repeated_logp, divergence, 0.5, "bucket", 1.0)
        assert_close(results[0][0], expected, 2e-5, 1e-5, what=divergence)


def test_topk_bad_id_on_a_device_is_flagged_without_a_host_read(backend, monkeypatch):
    """On a device a ``TopK`` id outside ``[-1, V)`` is not read on the host: it is recorded in the device's flag
    vector and read as padding, its position gives NaN, every other position and the gradient there are the call's
    without it, and ``kltriton.check_inputs()`` raises it (once). Run on CPU with the host check off, as on a
    device (on CPU the call raises at once: ``test_bad_input``)."""
    from kltriton import _inputs

    gen = torch.Generator().manual_seed(35)
    student = random_logits((2, 3, 50), torch.float32, generator=gen)
    ids, logp = _topk_teacher(random_logits((2, 3, 50), torch.float32, generator=gen), 4, gen, pad=True)
    labels = torch.zeros(2, 3, dtype=torch.long)
    bad_ids = ids.clone()
    bad_ids[1, 2, 0] = 99

    def run(teacher_ids):
        x = student.clone().requires_grad_()
        out = kltriton.token_divergence(x, kltriton.TopK(teacher_ids, logp), labels, backend=backend)
        out.masked_fill(out.isnan(), 0).sum().backward()
        return out, x.grad

    want, want_grad = run(ids)
    monkeypatch.setattr(_inputs, "host_checks", lambda device=None: False)
    got, got_grad = run(bad_ids)
    assert torch.isnan(got[1, 2]) and not torch.isnan(want).any()
    others = ~torch.isnan(got)
    assert torch.equal(got[others], want[others])
    assert torch.equal(got_grad[0], want_grad[0]) and torch.equal(got_grad[1, :2], want_grad[1, :2])
    with pytest.raises(ValueError, match=r"TopK ids must lie in \[0, V\) or be -1 \(padding\); found 99"):
        kltriton.check_inputs()
    kltriton.check_inputs()  # cleared


def test_set_columns_writes_exactly_the_written_entries():
    """``tiles.set_columns`` (one scatter over every entry, no host read) writes ``values`` at the ids ``>= 0`` of the
    scored rows and leaves every other entry as it was: padding beside a real id 0, a row of padding only, an
    unscored row."""
    from kltriton.kernels.linear import tiles

    gen = torch.Generator().manual_seed(36)
    grad = torch.randn(5, 9, generator=gen).bfloat16()
    ids = torch.tensor([[3, -1, 0], [-1, -1, -1], [2, 5, 7], [0, 4, -1], [1, 8, 6]])
    ok = torch.tensor([True, True, False, True, True])
    values = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    want = grad.clone()
    for n in range(5):
        for k in range(3):
            if ok[n] and ids[n, k] >= 0:
                want[n, ids[n, k]] = values[n, k].to(grad.dtype)
    tiles.set_columns(grad, ids, ok, values)
    assert torch.equal(grad, want)


def test_topk_k_equals_v_is_dense_and_k_one(backend):
    """``K = V``: both tails give the dense divergence (the bucket is empty). ``K = 1``: the renormalized
    distributions are equal (0) and the bucket compares ``(t, 1 - t)`` with ``(s, 1 - s)``."""
    gen = torch.Generator().manual_seed(7)
    student = random_logits((3, 4, 64), torch.float32, generator=gen)
    teacher = random_logits((3, 4, 64), torch.float32, generator=gen)
    labels = random_labels((3, 4), 64)
    ids, logp = _topk_teacher(teacher, 64, gen, pad=False)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        dense = kltriton.token_divergence(student, teacher, labels, divergence=divergence, backend=backend)
        for tail in ("bucket", "renormalize"):
            sparse = kltriton.token_divergence(student, kltriton.TopK(ids, logp), labels, divergence=divergence,
                                               tail=tail, backend=backend)
            assert_close(sparse, dense, 2e-6, 1e-5, what=f"K=V {divergence} {tail}")
    ids1, logp1 = _topk_teacher(teacher, 1, gen, pad=False)
    renormalized = kltriton.token_divergence(student, kltriton.TopK(ids1, logp1), labels, tail="renormalize",
                                             backend=backend)
    assert bool((renormalized == 0).all())
    bucket = kltriton.token_divergence(student, kltriton.TopK(ids1, logp1), labels, divergence="forward_kl",
                                       backend=backend)
    s = torch.log_softmax(student.double(), -1).gather(-1, ids1).exp().squeeze(-1)
    t = logp1.double().exp().squeeze(-1)
    expected = t * (t / s).log() + (1 - t) * ((1 - t) / (1 - s)).log()
    assert_close(bucket, torch.where(labels != -100, expected, 0.0), 1e-5, 1e-5, what="K=1 bucket")


def test_topk_extreme_teacher_and_verl_clamp(backend):
    """A teacher log-prob of ``-inf`` where the student has mass: ``+inf`` reverse KL, finite forward KL, never NaN;
    ``min_logprob`` raises both sides' log-probs (verl's ``log_prob_min_clamp``) and cuts the gradient below it."""
    gen = torch.Generator().manual_seed(8)
    student = random_logits((2, 3, 500), torch.float32, generator=gen)
    teacher = random_logits((2, 3, 500), torch.float32, generator=gen)
    ids, logp = _topk_teacher(teacher, 8, gen, pad=False)
    logp[0, 0, 3] = float("-inf")
    labels = torch.zeros(2, 3, dtype=torch.long)
    for tail in ("bucket", "renormalize", "none"):
        rkl = kltriton.token_divergence(student, kltriton.TopK(ids, logp), labels, tail=tail, backend=backend)
        fkl = kltriton.token_divergence(student, kltriton.TopK(ids, logp), labels, divergence="forward_kl",
                                        tail=tail, backend=backend)
        assert torch.isinf(rkl[0, 0]) and torch.isfinite(rkl.view(-1)[1:]).all(), tail
        assert torch.isfinite(fkl).all(), tail
    x = student.clone().requires_grad_()
    clamped = kltriton.TopK(ids, logp, min_logprob=-3.0)
    out = kltriton.token_divergence(x, clamped, labels, divergence="forward_kl", tail="none", backend=backend)
    out.sum().backward()
    x64 = student.double().requires_grad_()
    expected = topk_oracle(x64, ids, logp, "forward_kl", 0.5, "none", 1.0, min_logprob=-3.0)
    expected.sum().backward()
    assert_close(out, expected, 1e-5, 1e-5, what="clamped")
    assert_close(x.grad, x64.grad, 1e-6, 1e-4, what="clamped grad")


def test_topk_linear_student(backend):
    """A ``LinearLogits`` student with a ``TopK`` teacher: the columns gathered from the LM head rows, their
    gradient scattered to hidden / weight / bias (softcap and scale chained)."""
    gen = torch.Generator().manual_seed(9)
    hidden, weight, bias, _, _ = _heads(torch.float32, gen)
    teacher = random_logits((3, 5, 301), torch.float32, generator=gen)
    ids, logp = _topk_teacher(teacher, 12, gen)
    labels = random_labels((3, 5), 301)
    for divergence in ("forward_kl", "jsd"):
        params = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        student = kltriton.LinearLogits(*params, logit_scale=0.8, softcap=20.0, tile_elements=64 * 100)
        out = kltriton.token_divergence(student, kltriton.TopK(ids, logp), labels, divergence=divergence,
                                        temperature=0.9, backend=backend)
        upstream = torch.randn(3, 5, generator=gen)
        (out * upstream).sum().backward()
        params64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
        logits64 = 20.0 * torch.tanh(0.8 * F.linear(*params64) / 20.0)
        expected = torch.where(labels != -100, topk_oracle(logits64, ids, logp, divergence, 0.5, "bucket", 0.9), 0.0)
        (expected * upstream.double()).sum().backward()
        assert_close(out, expected, 2e-5, 1e-5, what=divergence)
        for name, p, q in zip(("hidden", "weight", "bias"), params, params64):
            assert_close(p.grad, q.grad, 1e-5, 1e-4, what=f"{divergence} d_{name}")


# --- custom ops and torch.compile ------------------------------------------------------------------------------

def op_samples(backend):
    """The distillation ops: the JSD pass and its gradient, the divergence loss, the column log-probs (dense and
    LinearLogits)."""
    vocab = 67
    logits = torch.randn(2, 3, vocab, requires_grad=True)
    ref = torch.randn(2, 3, vocab)
    target = torch.randint(0, vocab, (6,))
    target[1] = SKIP
    beta = torch.tensor(0.3, dtype=torch.float64)
    stats = dispatch.implementation("stream", backend).forward(logits.detach(), ref, target, temp(0.9),
                                                               statistics.request(ref=True))
    lse, ref_lse = stats.lse, stats.ref_lse
    dense = lambda x: Side(x, None, None, None, None)  # noqa: E731
    yield ops.jsd, (dense(logits), dense(ref), target, temp(0.9), lse, ref_lse, beta, 0, backend)
    jsd, kl = dispatch.implementation("divergence", backend).forward(logits.detach(), ref, target, temp(0.9), lse,
                                                                     ref_lse, beta)
    yield ops.jsd_backward, (dense(logits.detach()), dense(ref), target, temp(0.9), lse, ref_lse, beta, kl,
                             torch.randn(6), NeedsGrad(True, False, False), 0, backend)
    weight = torch.rand(6)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        yield ops.divergence_loss, (dense(logits), dense(ref), target, temp(0.9), weight, kind, beta, True,
                                    NeedsGrad(True, False, False), 0, backend)
    ids = torch.randint(0, vocab, (6, 4))
    ids[0, 2] = -1
    yield ops.columns, (dense(logits), ids, target, temp(0.9), stats.lse, False, 1 << 20, backend)
    yield ops.columns, (dense(logits), ids, target, temp(0.9), None, True, 1 << 20, backend)
    hidden, w, b = torch.randn(2, 3, 8, requires_grad=True), torch.randn(vocab, 8, requires_grad=True), None
    lin_lse = torch.logsumexp(F.linear(hidden.detach(), w.detach()).view(6, vocab) / 0.9, -1)
    yield ops.columns, (Side(hidden, w, b, None, None), ids, target, temp(0.9), None, True, 1 << 20, backend)
    yield ops.columns_backward, (Side(hidden.detach(), w.detach(), b, None, None), ids, target, temp(0.9), lin_lse,
                                 torch.randn(6), torch.randn(6, 4), NeedsGrad(True, True, False), 1 << 20, backend)
    yield ops.jsd, (Side(hidden, w, b, None, None), dense(ref), target, temp(0.9), lin_lse, ref_lse, beta, 1 << 20,
                    backend)
    yield ops.divergence_loss, (Side(hidden, w, b, None, None), dense(ref), target, temp(0.9), weight, "jsd", beta,
                                False, NeedsGrad(True, True, False), 1 << 20, backend)


@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_opcheck(backend_name):
    usable, why = dispatch.availability(backend_name)
    if not usable:
        pytest.skip(why)
    for op, args in op_samples(backend_name):
        # The losses' eager backward scales their output ``grad`` in place (no copy), which
        # test_aot_dispatch_dynamic sees as an output that differs from the compiled one (as the policy loss's
        # ops); under torch.compile it scales out of place: test_compile_fullgraph_matches_eager checks it.
        in_place = op is ops.divergence_loss
        test_utils = ("test_schema", "test_autograd_registration", "test_faketensor") if in_place else None
        torch.library.opcheck(op.overload, op.flatten(*args), **({"test_utils": test_utils} if in_place else {}))


def _loss_fn(student, teacher, ids, topk, labels, beta, temperature):
    jsd = kltriton.token_divergence(student, teacher, labels, divergence="jsd", beta=beta, temperature=temperature)
    fused = kltriton.token_divergence(student, teacher, labels, divergence="forward_kl", reduction="batchmean",
                                      temperature=temperature)
    sparse = kltriton.token_divergence(student, kltriton.TopK(ids, topk), labels, divergence="jsd", beta=beta,
                                       temperature=temperature)
    return jsd.sum() + fused + sparse.sum()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(compiler):
    """``torch.compile(fullgraph=True)`` of the dense JSD, a fused reduced loss and a TopK teacher: equal to eager;
    ``beta`` and the temperature are data (one recompile at most, when Dynamo first sees them change)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(compiler)
    compiled = torch.compile(_loss_fn, backend=counter, fullgraph=True)
    student, teacher = torch.randn(2, 5, 301), torch.randn(2, 5, 301)
    ids = torch.topk(teacher, 6, -1).indices
    topk = torch.log_softmax(teacher, -1).gather(-1, ids)
    labels = torch.randint(0, 301, (2, 5))
    for beta, temperature in ((0.5, 1.0), (0.3, 0.8), (0.7, 1.2)):
        x = student.clone().requires_grad_()
        expected = _loss_fn(x, teacher, ids, topk, labels, beta, temperature)
        e_grad, = torch.autograd.grad(expected, x)
        x = student.clone().requires_grad_()
        got = compiled(x, teacher, ids, topk, labels, beta, temperature)
        grad, = torch.autograd.grad(got, x)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(grad, e_grad)
    assert counter.frame_count <= 2, f"compiled {counter.frame_count} frames"


# --- bad input -------------------------------------------------------------------------------------------------

def test_bad_input():
    student, teacher = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    labels = torch.zeros(2, 3, dtype=torch.long)
    call = lambda **kw: kltriton.token_divergence(kw.pop("student", student), kw.pop("teacher", teacher),  # noqa
                                                  labels, **kw)
    for kwargs, error, match in (
        (dict(divergence="kl"), ValueError, "divergence"),
        (dict(tail="drop"), ValueError, "tail"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(beta=1.5), ValueError, "beta"),
        (dict(beta=-0.1), ValueError, "beta"),
        (dict(beta=math.nan), ValueError, "beta"),
        (dict(beta=torch.tensor(0.5)), TypeError, "beta"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(teacher=torch.randn(2, 3, 12)), ValueError, "teacher"),
        (dict(teacher=torch.randn(2, 3)), ValueError, "teacher"),
        (dict(teacher=torch.randn(2, 3, 11, dtype=torch.float64)), TypeError, "teacher"),
        (dict(teacher=torch.ones(2, 3, 11, dtype=torch.long)), TypeError, "teacher"),
        (dict(teacher="logits"), TypeError, "teacher"),
        (dict(student=torch.ones(2, 3, 11, dtype=torch.long)), TypeError, "student"),
        (dict(teacher=kltriton.TopK(torch.zeros(2, 4, 3, dtype=torch.long), torch.zeros(2, 4, 3))), ValueError,
         "TopK"),
        (dict(teacher=kltriton.TopK(torch.full((2, 3, 2), 11), torch.zeros(2, 3, 2))), ValueError, "TopK ids"),
        (dict(teacher=kltriton.TopK(torch.full((2, 3, 2), -2), torch.zeros(2, 3, 2))), ValueError, "TopK ids"),
    ):
        with pytest.raises(error, match=match):
            call(**kwargs)
    with pytest.raises(TypeError, match="TopK ids"):
        kltriton.TopK(torch.zeros(2, 3, 2), torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="same shape"):
        kltriton.TopK(torch.zeros(2, 3, 2, dtype=torch.long), torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="K >= 1"):
        kltriton.TopK(torch.zeros(2, 3, 0, dtype=torch.long), torch.zeros(2, 3, 0))
    with pytest.raises(ValueError, match="min_logprob"):
        kltriton.TopK(torch.zeros(2, 3, 1, dtype=torch.long), torch.zeros(2, 3, 1), min_logprob=math.inf)
    empty = kltriton.token_divergence(torch.randn(0, 11), torch.randn(0, 11), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,)
