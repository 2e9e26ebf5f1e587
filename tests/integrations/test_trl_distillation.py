"""TRL integration, distillation: ``GKDTrainer.generalized_jsd_loss`` and ``DistillationTrainer``'s chunked divergence
loss against TRL's own functions, and a 4-step ``GKDTrainer`` run on tiny models with and without kltriton."""
import math
import sys

import pytest
import torch

pytest.importorskip("trl")

import kltriton  # noqa: E402
from helpers import CallCounter, assert_close  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from trl_support import tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def gkd():
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer


def _logits(gen, shape=(3, 7, 211)):
    student = torch.randn(shape, generator=gen) * 2
    return student, student + torch.randn(shape, generator=gen)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_loss_matches_trl(gkd, beta):
    """Value and student gradient of every reduction, with ``num_items_in_batch`` and without labels, equal TRL's."""
    gen = torch.Generator().manual_seed(0)
    student, teacher = _logits(gen)
    labels = torch.randint(0, 211, (3, 7), generator=gen)
    labels[0, :3] = -100
    trl_fn = gkd.generalized_jsd_loss
    cases = [dict(reduction=r) for r in ("batchmean", "sum", "mean")]
    cases += [dict(num_items_in_batch=torch.tensor(11)), dict(labels=None), dict(labels=None, reduction="sum")]
    for case in cases:
        kwargs = dict(dict(labels=labels, beta=beta, temperature=0.8), **case)
        x = student.clone().requires_grad_()
        expected = trl_fn(x, teacher, **kwargs)
        e_grad, = torch.autograd.grad(expected * 1.3, x)
        with kl_trl.apply():
            y = student.clone().requires_grad_()
            got = gkd.generalized_jsd_loss(y, teacher, **kwargs)
            grad, = torch.autograd.grad(got * 1.3, y)
        assert gkd.generalized_jsd_loss is trl_fn
        assert_close(got, expected, 1e-6, 2e-5, what=f"{case}")
        # entries where p and q cancel (a few 1e-4 out of 1e-2) are judged at the gradient's scale: both sides are fp32
        assert_close(grad, e_grad, 2e-5 * e_grad.abs().max().item(), 2e-4, what=f"{case} grad")


def test_elementwise_reduction_falls_back_to_trl(gkd, caplog):
    gen = torch.Generator().manual_seed(1)
    student, teacher = _logits(gen)
    expected = gkd.generalized_jsd_loss(student, teacher, beta=0.4, reduction="none")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        got = gkd.generalized_jsd_loss(student, teacher, beta=0.4, reduction="none")
    assert torch.equal(got, expected)
    assert any("reduction='none'" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("normalizer", [None, 9.0])
def test_distillation_trainer_loss_matches_trl(beta, normalizer):
    """``DistillationTrainer``'s ``_chunked_divergence_loss``: the loss, the student's entropy sum and the scored count,
    and the gradients of the student's hidden states, LM head weight and bias, equal TRL's own (a teacher of another
    width, logit scale and softcap, temperature)."""
    from trl.trainer import distillation_trainer

    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 6, 16, generator=gen)
    weight, bias = torch.randn(97, 16, generator=gen) / 3, torch.randn(97, generator=gen)
    teacher_hidden, teacher_weight = torch.randn(2, 6, 24, generator=gen), torch.randn(97, 24, generator=gen) / 3
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    trl_fn = distillation_trainer._chunked_divergence_loss

    def run(fn):
        params = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, entropy_sum, count = fn(params[0], teacher_hidden, params[1], teacher_weight, mask, beta,
                                      num_items_in_batch=normalizer, student_lm_head_bias=params[2],
                                      student_logit_scale=0.9, teacher_logit_scale=1.1,
                                      student_final_logit_softcapping=15.0, temperature=0.8)
        (loss * 2.0).backward()
        return loss, entropy_sum, count, [p.grad for p in params]

    expected = run(trl_fn)
    with kl_trl.apply():
        got = run(distillation_trainer._chunked_divergence_loss)
    assert distillation_trainer._chunked_divergence_loss is trl_fn
    assert_close(got[0], expected[0], 1e-6, 1e-5, what="loss")
    assert_close(got[1], expected[1], 1e-5, 1e-5, what="entropy sum")
    assert int(got[2]) == int(expected[2]) == 10
    for name, a, e in zip(("hidden", "weight", "bias"), got[3], expected[3]):
        assert_close(a, e, 1e-7, 1e-4, what=f"d_{name}")


# ------------------------------------------------------------------------------------------- a GKDTrainer run
SENTENCES = ["the cat sat on the mat", "a dog ran on the log", "the big red cat and the small blue dog",
             "then a cat sat", "a small dog ran and then sat", "the blue mat and the red log"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    student, teacher = tmp_path_factory.mktemp("student"), tmp_path_factory.mktemp("teacher")
    tiny_llama(student, seed=0)
    tiny_llama(teacher, seed=1, hidden_size=48)  # a wider teacher with the same vocabulary
    return student, teacher


def _collate(tokenizer):
    """Padded ``input_ids`` / ``attention_mask`` and ``labels`` that score the completion (the words after the first
    two), as TRL's ChatML collator does."""
    def collate(examples):
        batch = tokenizer([e["text"] for e in examples], padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        labels[:, :2] = -100
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}
    return collate


def _train_gkd(models, out_dir):
    """Four optimizer steps of ``GKDTrainer`` on the dataset's completions (``lmbda=0``: no generation); the logs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    student_dir, teacher_dir = models
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    args = GKDConfig(output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                     per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=4, lmbda=0.0,
                     beta=0.3, learning_rate=0.02, logging_steps=1, save_strategy="no", disable_tqdm=True,
                     dataloader_num_workers=0)
    trainer = GKDTrainer(model=AutoModelForCausalLM.from_pretrained(student_dir),
                         teacher_model=AutoModelForCausalLM.from_pretrained(teacher_dir), args=args,
                         train_dataset=Dataset.from_dict({"text": SENTENCES * 4}), processing_class=tokenizer,
                         data_collator=_collate(tokenizer))
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def test_gkd_trainer_trains_the_same_with_kltriton(models, tmp_path, monkeypatch, caplog):
    """The logged loss (and grad norm) of a 4-step ``GKDTrainer`` run equals TRL's own run; every step's loss came
    from ``token_divergence`` on the models' hidden states. Tolerances as the GRPO run's: the two runs differ in fp32
    rounding (TRL's dense softmax in torch, kltriton's streamed C++ kernel), ~1e-6 per token, carried by Adam steps of
    0.02 to ~1e-5 relative after 4 steps."""
    trl_logs = _train_gkd(models, tmp_path / "trl")
    calls = CallCounter(monkeypatch, "token_divergence")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = _train_gkd(models, tmp_path / "kltriton")
    lines = [record.getMessage() for record in caplog.records]
    assert any("GKDTrainer loss: kltriton.token_divergence" in line for line in lines), lines
    assert calls.calls >= 4 * 2, calls.calls  # every micro-batch of every step
    assert len(trl_logs) == len(kl_logs) == 4
    assert trl_logs[0]["loss"] > 0 and trl_logs[-1]["loss"] != trl_logs[0]["loss"]  # it trains: the test can fail
    print("\nstep | loss TRL / kltriton | grad_norm TRL / kltriton", file=sys.stderr)
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        print(f"{step} | {a['loss']:.7g} / {b['loss']:.7g} | {a['grad_norm']:.7g} / {b['grad_norm']:.7g}",
              file=sys.stderr)
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6), (step, a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-3), (step, a["grad_norm"], b["grad_norm"])


def test_apply_and_undo_distillation(gkd):
    from trl.trainer import distillation_trainer

    before = (gkd.compute_loss, gkd.generalized_jsd_loss, distillation_trainer._chunked_divergence_loss)
    with kl_trl.apply():
        assert gkd.compute_loss is not before[0]
        assert gkd.generalized_jsd_loss is not before[1]
        assert distillation_trainer._chunked_divergence_loss is not before[2]
    assert (gkd.compute_loss, gkd.generalized_jsd_loss, distillation_trainer._chunked_divergence_loss) == before
    assert kltriton.token_divergence is not None
