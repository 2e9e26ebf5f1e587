"""The ops as torch.library custom ops: opcheck, and torch.compile(fullgraph=True) without
graph breaks or recompiles when float hyperparameters change."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kltriton
from kltriton import dispatch
from kltriton.kernels import SKIP
from kltriton.kernels.constants import INVARIANT
from kltriton.kernels import statistics
from kltriton.kernels.linear import Side
from kltriton.ops._define import NeedsGrad
from kltriton.ops.statistics import statistics as statistics_op, statistics_backward


def op_samples(backend):
    """Every variant of the statistics ops on dense logits (the ``stream`` family): entropy, reference, full KL,
    temperatures."""
    dense = lambda x: None if x is None else Side(x, None, None, None, None)  # noqa: E731
    scalar = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
    vocab = 67
    logits = torch.randn(2, 3, vocab, requires_grad=True)
    ref = torch.randn(2, 3, vocab)
    target = torch.randint(0, vocab, (6,))
    target[1] = SKIP
    for ref_logits, with_entropy, with_full_kl, temperature in (
            (None, False, False, 1.0), (None, True, False, 0.7), (ref, False, False, 1.3),
            (ref, True, True, 0.9), (ref, False, True, 1.0)):
        wanted = statistics.request(entropy=with_entropy, ref=ref_logits is not None, full_kl=with_full_kl)
        yield statistics_op, (dense(logits), dense(ref_logits), target, scalar(temperature), wanted, 0, True, None, backend)
    # the invariant mode: the ``invariant`` family's passes, each side its own
    yield statistics_op, (dense(logits), dense(ref), target, scalar(0.7),
                          statistics.request(entropy=True, ref=True) | INVARIANT, 0, True, None, backend)
    impl = dispatch.implementation("stream", backend)
    stats = impl.forward(logits.detach(), ref, target, scalar(1.0), statistics.request(entropy=True, ref=True,
                                                                                         full_kl=True))
    g = torch.randn(6)
    full = statistics.gradient_basis({"logp": g, "entropy": g, "full_kl": g}, stats, scalar(1.0))
    yield statistics_backward, (dense(logits.detach()), dense(ref), target, scalar(1.0), stats.lse, stats.ref_lse, full,
                                NeedsGrad(True, False, False), 0, False, backend)
    plain = statistics.gradient_basis({"logp": g}, stats, scalar(0.8))
    yield statistics_backward, (dense(logits.detach()), None, target, scalar(0.8), stats.lse, None, plain,
                                NeedsGrad(True, False, False), 0, False, backend)


@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_opcheck(backend_name):
    usable, why = dispatch.availability(backend_name)
    if not usable:
        pytest.skip(why)
    for op, args in op_samples(backend_name):
        torch.library.opcheck(op.overload, op.flatten(*args))


@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_eager_dense_path_equals_the_registered_op(backend_name):
    """An eager call on dense logits runs the stream kernels through its own autograd node
    (``ops.statistics.local``); every statistic and the logits' gradient (upstream gradients that are not 1, one per
    differentiable statistic) equal the registered op's through the dispatcher, and a second derivative through it
    is the error naming kltriton."""
    from kltriton.ops import statistics as statistics_ops

    usable, why = dispatch.availability(backend_name)
    if not usable:
        pytest.skip(why)
    for op, args in op_samples(backend_name):
        if op is not statistics_op or args[4] & INVARIANT:  # (the invariant mode always takes the op)
            continue
        policy, ref, target, temperature, request = args[:5]

        def run(eager):
            x = policy.x.detach().clone().requires_grad_()
            side = Side(x, None, None, None, None)
            if eager:
                stats = statistics_ops.local(side, ref, target, temperature, request, 0, backend_name)
            else:
                flat = statistics_op.flatten(side, ref, target, temperature, request, 0, True, None, backend_name)
                stats = statistics.StreamStats(*statistics_op.overload(*flat)[:len(statistics.NAMES)])
            names = [n for n in statistics.DIFFERENTIABLE if statistics.present(request, n)]
            gen = torch.Generator().manual_seed(len(names))
            total = sum((getattr(stats, n) * torch.randn(target.shape, generator=gen)).nansum() for n in names)
            grad, = torch.autograd.grad(total, x)
            return stats, grad, type(stats.logp.grad_fn).__name__

        (eager_stats, eager_grad, node), (op_stats, op_grad, _) = run(True), run(False)
        assert node == "_DenseStatisticsBackward"
        for name in statistics.NAMES:
            torch.testing.assert_close(getattr(eager_stats, name), getattr(op_stats, name), equal_nan=True,
                                       msg=name)
        torch.testing.assert_close(eager_grad, op_grad)
    x = torch.randn(2, 3, 11, requires_grad=True)
    logp = kltriton.token_logprobs(x, torch.randint(0, 11, (2, 3)), backend=backend_name)
    grad, = torch.autograd.grad(logp.sum() * 2, x, create_graph=True)
    with pytest.raises(RuntimeError, match="kltriton: kltriton::statistics has no second derivative"):
        grad.pow(2).sum().backward()



def _backend_inputs(backend_name, seed):
    """``(generator, dtype)`` of a test on ``backend_name`` (float64 on the reference backend, else float32); skips
    where the backend does not run."""
    usable, why = dispatch.availability(backend_name)
    if not usable:
        pytest.skip(why)
    return torch.Generator().manual_seed(seed), torch.float64 if backend_name == "reference" else torch.float32


@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_plain_path_equals_the_general_path(backend_name, monkeypatch):
    """A plain ``token_logprobs`` call (dense logits and the label side as plain tensors: ``route.plain``) takes the
    lean path, the target made with the statistics (``forward_labels``, one C++ op); its log-probs, entropy and
    gradient (an upstream gradient that is not 1) equal the general path's (``front_door.enter``, the layout op, then
    the statistics), and a bad label is the same error. Strided logits, a mask, packed sequences with shifted labels,
    a per-position temperature, bf16."""
    from kltriton import route

    gen, dtype = _backend_inputs(backend_name, 11)
    full = torch.randn(3, 6, 37, generator=gen, dtype=dtype) * 4
    labels = torch.randint(0, 37, (3, 5), generator=gen)
    labels[0, 1] = -100
    mask = torch.rand(3, 5, generator=gen) > 0.3
    packed = torch.randn(9, 37, generator=gen, dtype=dtype)
    ids = torch.randint(0, 37, (9,), generator=gen)
    cases = [
        dict(logits=full[:, :-1], labels=labels, mask=mask, return_entropy=True),  # a strided view, as given
        dict(logits=full[:, :-1], labels=labels, temperature=0.7 + torch.rand(3, 5, generator=gen, dtype=dtype)),
        dict(logits=packed, labels=ids, cu_seqlens=torch.tensor([0, 4, 4, 9]), shift_labels=True, temperature=1.3,
             return_entropy=True),
    ]
    if backend_name != "reference":
        cases.append(dict(logits=full.to(torch.bfloat16), labels=torch.randint(0, 37, (3, 6), generator=gen)))

    plain_route = route.plain

    def run(case, plain):
        x = case["logits"].detach().clone().requires_grad_()
        given = {name: value for name, value in case.items() if name != "logits"}
        assert plain_route(x, given["labels"], given.get("mask"), given.get("cu_seqlens"),
                           given.get("temperature", 1.0))
        monkeypatch.setattr(route, "plain", plain_route if plain else lambda *args: False)
        out = kltriton.token_logprobs(x, **given, backend=backend_name)
        out = out if isinstance(out, tuple) else (out,)
        weights = torch.Generator().manual_seed(3)
        total = sum((value * torch.randn(value.shape, generator=weights, dtype=value.dtype)).sum() for value in out)
        grad, = torch.autograd.grad(total, x)
        return out, grad

    for case in cases:
        (lean, lean_grad), (general, general_grad) = run(case, True), run(case, False)
        for a, b in zip(lean, general, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(lean_grad, general_grad)
    bad = labels.clone()
    bad[1, 2] = 37
    messages = []
    for plain in (True, False):
        monkeypatch.setattr(route, "plain", plain_route if plain else lambda *args: False)
        with pytest.raises(ValueError, match="labels must lie in") as error:
            kltriton.token_logprobs(full[:, :-1], bad, backend=backend_name)
        messages.append(str(error.value))
    assert messages[0] == messages[1]



@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_statistics_made_with_the_target_equal_the_layout_op_first(backend_name, monkeypatch):
    """``route.statistics`` on local dense logits whose target is not made yet makes it with the statistics
    (``dense_labels``, one op on the C++ backend): ``token_kl`` with reference logits in another dtype and
    ``fused_kl_reward`` equal the path that runs the layout op first (values and the logits' gradient)."""
    from kltriton._inputs import Layout

    gen, dtype = _backend_inputs(backend_name, 12)
    logits = torch.randn(2, 7, 41, generator=gen, dtype=dtype) * 3
    ref = torch.randn(2, 7, 41, generator=gen, dtype=dtype if backend_name == "reference" else torch.bfloat16)
    labels = torch.randint(0, 41, (2, 7), generator=gen)
    mask = torch.rand(2, 7, generator=gen) > 0.3
    upstream = torch.randn(2, 7, generator=gen, dtype=torch.float32)

    def run(first):
        if first:
            monkeypatch.setattr(Layout, "pending", property(lambda self: False))
        x = logits.clone().requires_grad_()
        kl = kltriton.token_kl(x, ref, labels, estimator="k3", mask=mask, shift_labels=True, backend=backend_name)
        reward = kltriton.fused_kl_reward(x, ref, labels, coef=0.1, mask=mask, backend=backend_name)
        grad, = torch.autograd.grad((kl.kl * upstream).sum() + reward.kl_per_seq.sum(), x)
        monkeypatch.undo()
        return (kl.kl, kl.logprobs, kl.ref_logprobs, reward.reward, reward.kl_per_seq), grad

    (made, made_grad), (first, first_grad) = run(False), run(True)
    for a, b in zip(made, first, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(made_grad, first_grad)


@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_loss_made_with_its_row_weights_equals_the_layout_op_first(backend_name, monkeypatch):
    """``policy_loss``'s common call on local dense logits makes the target and the loss's per-row weights with the
    loss (``route.weighted_loss``: the loss family's ``forward_labels``, one C++ op): its loss, per-token outputs,
    metrics and gradient (an upstream gradient that is not 1) equal the path that runs the layout op first. Reference
    logits in another dtype (the C++ backend composes), given reference log-probs with per-sequence advantages and
    shifted packed labels, and a call without the gradient."""
    from kltriton._inputs import Layout

    gen, dtype = _backend_inputs(backend_name, 13)
    logits = torch.randn(2, 7, 41, generator=gen, dtype=dtype) * 3
    ref = torch.randn(2, 7, 41, generator=gen, dtype=dtype if backend_name == "reference" else torch.bfloat16)
    labels = torch.randint(0, 41, (2, 7), generator=gen)
    mask = torch.rand(2, 7, generator=gen) > 0.3
    old = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0] + 0.1 * torch.randn(
        2, 7, generator=gen, dtype=dtype)
    cases = [
        dict(ref=ref, labels=labels, advantages=torch.randn(2, 7, generator=gen, dtype=dtype), old_logprobs=old,
             mask=mask, loss_type="grpo", kl_coef=0.05, entropy_coef=0.01, temperature=0.8),
        dict(ref=(old - 0.2).reshape(-1), labels=labels.reshape(-1), advantages=torch.randn(3, generator=gen, dtype=dtype),
             cu_seqlens=torch.tensor([0, 5, 5, 14]), shift_labels=True, loss_type="dapo", kl_coef=0.1,
             kl_estimator="k2"),
        dict(labels=labels, advantages=torch.randn(2, generator=gen, dtype=dtype), loss_type="dr_grpo",
             compute_entropy=False, grad=False),
    ]

    def run(case, first):
        case = dict(case)
        with_grad = case.pop("grad", True)
        if first:
            monkeypatch.setattr(Layout, "pending", property(lambda self: False))
        x = (logits if case["labels"].dim() == 2 else logits.reshape(14, 41)).clone().requires_grad_(with_grad)
        out = kltriton.policy_loss(x, **case, backend=backend_name)
        grad = torch.autograd.grad(out.loss * 1.7, x)[0] if with_grad else None
        monkeypatch.undo()
        return out, grad

    for case in cases:
        (made, made_grad), (first, first_grad) = run(case, False), run(case, True)
        for a, b in zip(made[:-1], first[:-1], strict=True):
            assert torch.equal(a, b)
        assert made.metrics.keys() == first.metrics.keys()
        for name in made.metrics:
            assert torch.equal(made.metrics[name], first.metrics[name]), name
        assert (made_grad is None and first_grad is None) or torch.equal(made_grad, first_grad)


@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_one_tile_rows_made_with_the_target_equal_the_layout_op_first(backend_name, monkeypatch):
    """An LM head whose rows fit one tile (``tiles.one_tile``) makes its GEMM operand (the scored rows, the others
    zero) with the target, one op on the C++ backend (``Layout.scored_rows``): log-probs, entropy and the gradients
    of hidden states, weight and bias (upstream gradients that are not 1) equal the path that runs the layout op
    first. A mask with shifted labels and a temperature; a bf16 head."""
    from kltriton._inputs import Layout
    from kltriton.ops import layout as layout_ops

    gen, dtype = _backend_inputs(backend_name, 14)
    hidden = torch.randn(2, 6, 8, generator=gen, dtype=dtype)
    weight = torch.randn(37, 8, generator=gen, dtype=dtype) * 0.5
    bias = torch.randn(37, generator=gen, dtype=dtype)
    labels = torch.randint(0, 37, (2, 6), generator=gen)
    mask = torch.rand(2, 6, generator=gen) > 0.3
    upstream = (torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen))
    made = []
    launch = layout_ops.launch_target_rows
    monkeypatch.setattr(layout_ops, "launch_target_rows", lambda *args: made.append(1) or launch(*args))

    def run(first, hidden_dtype):
        if first:
            monkeypatch.setattr(Layout, "pending", property(lambda self: False))
        leaves = [t.to(hidden_dtype).requires_grad_() for t in (hidden, weight, bias)]
        logp, entropy = kltriton.token_logprobs(kltriton.LinearLogits(*leaves), labels, mask=mask, shift_labels=True,
                                                temperature=0.9, return_entropy=True, backend=backend_name)
        grads = torch.autograd.grad((logp, entropy), leaves, (upstream[0].to(logp.dtype),
                                                              upstream[1].to(logp.dtype)))
        if first:
            monkeypatch.setattr(Layout, "pending", property(lambda self: self._target is None))
        return (logp, entropy, *grads)

    for hidden_dtype in (dtype,) if backend_name == "reference" else (dtype, torch.bfloat16):
        made.clear()
        with_target, first = run(False, hidden_dtype), run(True, hidden_dtype)
        assert made == [1]  # the made path took the one-tile route, the other did not
        for a, b in zip(with_target, first, strict=True):
            assert torch.equal(a, b)


def loss_fn(logits, ref, ids, mask, temperature, coef):
    lp = kltriton.token_logprobs(logits, ids, mask=mask, temperature=temperature)
    kl = kltriton.token_kl(logits, ref, ids, estimator="k3", mask=mask, temperature=temperature)
    shaped = kltriton.fused_kl_reward(logits, ref, ids, coef=coef, mask=mask, temperature=temperature)
    return (lp * 0.3).sum() + kl.kl.sum() - shaped.reward.sum() + shaped.kl_per_seq.sum()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_compile_fullgraph_matches_eager_without_recompiles(compiler, dynamic):
    """Temperature and coef reach the kernels as 0-dim tensors, so new values never specialize
    the graph. With Dynamo's default (``dynamic=None``) every Python scalar starts static and
    turns dynamic at its first change: one recompile, then none; ``dynamic=True`` gives none."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(compiler)
    compiled = torch.compile(loss_fn, backend=counter, fullgraph=True, dynamic=dynamic)
    logits, ref = torch.randn(2, 5, 301), torch.randn(2, 5, 301)
    ids, mask = torch.randint(0, 301, (2, 5)), torch.rand(2, 5) < 0.8
    for temperature, coef in ((1.0, 0.1), (0.7, 0.05), (1.3, 0.2), (0.9, 0.3)):
        x = logits.clone().requires_grad_()
        expected = loss_fn(x, ref, ids, mask, temperature, coef)
        e_grad, = torch.autograd.grad(expected, x)
        x = logits.clone().requires_grad_()
        got = compiled(x, ref, ids, mask, temperature, coef)
        grad, = torch.autograd.grad(got, x)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(grad, e_grad)
    assert counter.frame_count == (1 if dynamic else 2), f"compiled {counter.frame_count} frames"


@pytest.mark.parametrize("per_position", [False, True])
def test_compile_temperature_tensor_never_recompiles(per_position):
    """A temperature tensor (0-dim, or one per position as verl's per-sample temperature) is data:
    new values never recompile, even with Dynamo's default static shapes."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss_fn, backend=counter, fullgraph=True)
    logits, ref = torch.randn(2, 5, 301), torch.randn(2, 5, 301).bfloat16()  # a reference in another dtype
    ids, mask = torch.randint(0, 301, (2, 5)), (torch.rand(2, 5) < 0.8).long()  # an integer mask
    first = None
    for value in (1.0, 0.7, 1.3):
        temperature = torch.full((2, 5) if per_position else (), value, dtype=torch.float64)
        if per_position:
            temperature[1] = value / 2
        x = logits.clone().requires_grad_()
        expected = loss_fn(x, ref, ids, mask, temperature, 0.1)
        e_grad, = torch.autograd.grad(expected, x)
        x = logits.clone().requires_grad_()
        got = compiled(x, ref, ids, mask, temperature, 0.1)
        grad, = torch.autograd.grad(got, x)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(grad, e_grad)
        first = counter.frame_count if first is None else first
    # (The first compile of the 0-dim case may restart its analysis once: Dynamo's scalar
    # tensorification pass, counted as a second frame; no new value ever compiles again.)
    assert counter.frame_count == first <= 2, f"compiled {counter.frame_count} frames"
