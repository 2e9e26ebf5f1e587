"""verl integration, distillation: ``forward_kl_topk`` (the FSDP logits processor) and the estimator losses served by
kltriton, against verl's own functions: values, diagnostics and the student's gradient."""
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("tensordict")

import kltriton  # noqa: E402
from helpers import assert_close  # noqa: E402
from kltriton.integrations import verl as kl_verl  # noqa: E402


def _teacher(lengths, vocab, k, gen):
    """Nested (jagged) top-k ids and log-probs of a teacher, as verl's rollout stores them."""
    ids, logp = [], []
    for n in lengths:
        logits = torch.randn(n, vocab, generator=gen) * 2
        top = torch.topk(logits + torch.rand(logits.shape, generator=gen), k, -1).indices
        ids.append(top)
        logp.append(torch.log_softmax(logits, -1).gather(-1, top))
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return nested(ids), nested(logp)


@pytest.mark.parametrize("clamp", [-10.0, -3.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_kl_topk_matches_verl(clamp, dtype):
    from verl.trainer.distillation.fsdp import losses as fsdp_losses
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    gen = torch.Generator().manual_seed(0)
    lengths, vocab, k = (5, 3, 7), 301, 12
    ids, logp = _teacher(lengths, vocab, k, gen)
    student = (torch.randn(1, sum(lengths), vocab, generator=gen) * 2).to(dtype)
    config = DistillationConfig(distillation_loss=DistillationLossConfig(loss_mode="forward_kl_topk", topk=k,
                                                                         log_prob_min_clamp=clamp))
    verl_fn = fsdp_losses.compute_forward_kl_topk

    def run(fn):
        x = student.clone().requires_grad_()
        out = fn(x, logp, ids, config, "thd")
        upstream = torch.linspace(-1.0, 2.0, sum(lengths)).view(1, -1)
        (out["distillation_losses"] * upstream).sum().backward()
        return out, x.grad

    expected, e_grad = run(verl_fn)
    with kl_verl.apply():
        got, grad = run(fsdp_losses.compute_forward_kl_topk)
    assert fsdp_losses.compute_forward_kl_topk is verl_fn
    # verl gathers bf16 log-probs from a bf16 log_softmax; kltriton's are fp32 of the same logits
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    for name in ("distillation_losses", "student_mass", "teacher_mass", "overlap_token_advantage"):
        assert got[name].shape == expected[name].shape == (1, sum(lengths)), name
        assert_close(got[name], expected[name].float(), tol, tol, what=name)
    # bf16: verl's student top-k ids come from a bf16 log_softmax, whose rounding ties at the k-th place
    difference = (got["overlap_count"] - expected["overlap_count"]).abs().max()
    assert difference == 0 if dtype == torch.float32 else difference <= 1
    if dtype == torch.bfloat16 and clamp is not None:
        return  # a bf16 log-prob near the clamp is cut (no gradient) on one side and not on the other
    assert_close(grad, e_grad, tol * 0.1, 1e-4 if dtype == torch.float32 else 1.6e-2, what="grad")


def _batch(gen, lengths=(4, 6), prompt=3):
    """A padded verl micro-batch: prompts, responses, attention mask and response mask, and flat (no-padding)
    student / teacher log-probs over every token."""
    from tensordict import TensorDict

    b, width = len(lengths), max(lengths)
    attention = torch.zeros(b, prompt + width, dtype=torch.long)
    response_mask = torch.zeros(b, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention[i, :prompt + n] = 1
        response_mask[i, :n] = 1
    nnz = int(attention.sum())
    teacher = [-torch.rand(prompt + n, 1, generator=gen) * 3 for n in lengths]  # one per sequence, no padding
    data = TensorDict({"prompts": torch.ones(b, prompt, dtype=torch.long),
                       "responses": torch.ones(b, width, dtype=torch.long), "attention_mask": attention,
                       "response_mask": response_mask,
                       "teacher_logprobs": torch.nested.nested_tensor(teacher, layout=torch.jagged)},
                      batch_size=[b])
    return data, -torch.rand(nnz, generator=gen) * 3


@pytest.mark.parametrize("loss_mode", kl_verl.ESTIMATOR_LOSSES)
def test_estimator_losses_match_verl(loss_mode):
    from verl.trainer.distillation import losses
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    gen = torch.Generator().manual_seed(1)
    data, student = _batch(gen)
    # verl refuses to backpropagate k1 directly: as its advantage (policy gradient) instead
    config = DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode=loss_mode, use_policy_gradient=loss_mode in ("k1", "kl")))

    def run():
        x = student.clone().requires_grad_()
        fn = losses.get_distillation_loss_fn(loss_mode)
        values, metrics = fn(config=None, distillation_config=config, model_output={"log_probs": x}, data=data)
        values.sum().backward()
        return fn, values, torch.as_tensor(metrics["distillation/abs_loss"].values), x.grad

    verl_fn, expected, e_metric, e_grad = run()
    with kl_verl.apply():
        fn, got, metric, grad = run()
    assert fn is kl_verl.estimator_distillation_loss and verl_fn is not fn
    assert losses.get_distillation_loss_fn(loss_mode) is verl_fn  # undone
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(metric, e_metric, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, e_grad, rtol=1e-6, atol=1e-7)


def test_topk_loss_is_served_through_verls_logits_processor():
    """verl's ``distillation_ppo_loss`` called as the logits processor reaches kltriton's ``forward_kl_topk``."""
    from verl.trainer.distillation import losses
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    gen = torch.Generator().manual_seed(2)
    ids, logp = _teacher((4, 2), 97, 5, gen)
    config = DistillationConfig(distillation_loss=DistillationLossConfig(loss_mode="forward_kl_topk", topk=5))
    actor = type("Actor", (), {"strategy": "fsdp"})()
    student = torch.randn(1, 6, 97, generator=gen)
    expected = losses.compute_topk_loss(actor, config, {"teacher_logprobs": logp, "teacher_ids": ids}, student, "thd")
    with kl_verl.apply():
        got = losses.compute_topk_loss(actor, config, {"teacher_logprobs": logp, "teacher_ids": ids}, student, "thd")
    assert_close(got["distillation_losses"], expected["distillation_losses"], 1e-6, 1e-5, what="losses")
    assert kltriton.token_divergence is not None
