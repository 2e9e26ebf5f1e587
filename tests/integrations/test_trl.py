"""TRL integration: GRPOTrainer trains on a tiny Llama with and without kltriton, same seed, same metrics."""
import contextlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("trl")

import kltriton  # noqa: E402
from helpers import CallCounter  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from trl_support import TOLERANCES, assert_same_logs, tie_head_rows, tiny_llama, tiny_mixtral, train, train_rloo  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The tiny Llama with its LM head's rows tied in pairs (``tie_head_rows``)."""
    path = tmp_path_factory.mktemp("tiny-llama-tied")
    tiny_llama(path)
    tie_head_rows(path)
    return path


def test_grpo_trains_the_same_with_kltriton(model_dir, tmp_path, monkeypatch, caplog):
    trl_logs = train(model_dir, tmp_path / "trl", use_bias_correction_kl=False)
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    losses = CallCounter(monkeypatch, "policy_loss")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = train(model_dir, tmp_path / "kltriton", use_bias_correction_kl=False)
    # One line each says what runs: kltriton's head on both models, kltriton's loss.
    lines = [record.getMessage() for record in caplog.records]
    assert any("LlamaForCausalLM scores its log_probs and entropy with kltriton's LM head" in line for line in lines)
    assert sum("GRPOTrainer loss: kltriton.policy_loss" in line for line in lines) == 1, lines
    # The test can fail: clipping happened, the KL moved off zero, training moved the model.
    assert any(log["clip_ratio/region_mean"] > 0 for log in trl_logs)
    assert all(log["kl"] > 0 for log in trl_logs[1:])
    assert_same_logs(trl_logs, kl_logs)
    # Every generation batch is scored by the reference model and, with num_iterations=2, by the old policy.
    assert logprobs.calls >= 2 * 2, logprobs.calls
    # The configuration maps onto policy_loss: every optimizer step's loss came from kltriton.
    assert losses.calls >= 4, losses.calls
    print("\nstep | " + " | ".join(["loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"]), file=sys.stderr)
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        cells = [f"{a[k]:.7g} / {b[k]:.7g}" for k in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean")]
        print(f"{step} | " + " | ".join(cells), file=sys.stderr)


class _TrlHeadCounter:
    """Counts the calls of TRL's own fused head (``ChunkedLogProbFunction``, as ``trl.trainer.utils`` holds it)."""

    def __init__(self, monkeypatch):
        from trl.trainer import utils as trl_utils

        self.calls = 0
        original = trl_utils._ChunkedLogProbFunction
        counter = self

        class Counted:
            @staticmethod
            def apply(*args):
                counter.calls += 1
                return original.apply(*args)

        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Counted)


def test_rloo_trains_the_same_with_kltriton_head(model_dir, tmp_path, monkeypatch, caplog):
    """RLOOTrainer (its own generation at temperature 0.8, a reference model, two iterations per batch): kltriton's
    head scores the policy and the reference in every step, TRL's head never runs, and every logged metric equals
    plain TRL's."""
    trl_head = _TrlHeadCounter(monkeypatch)
    trl_logs = train_rloo(model_dir, tmp_path / "trl")
    assert trl_head.calls > 0  # the counter sees TRL's head where it runs
    trl_head.calls = 0
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = train_rloo(model_dir, tmp_path / "kltriton")
    lines = [record.getMessage() for record in caplog.records]
    assert any("scores its log_probs and entropy with kltriton's LM head" in line for line in lines), lines
    assert not any("keeps TRL's fused LM head" in line for line in lines), lines
    assert trl_head.calls == 0
    assert logprobs.calls >= 4 * 2, logprobs.calls  # policy and reference, every optimizer step
    # The test can fail: the KL (logged at generation steps) moved off zero, clipping happened.
    assert any(log.get("kl", 0) > 0 for log in trl_logs) and any(log["clip_ratio/region_mean"] > 0 for log in trl_logs)
    # RLOO's loss is its policy term alone, O(1) advantage-weighted ratios of both signs that nearly cancel (about
    # 1e-2 here): judged like GRPO's policy_loss, at 1e-5 absolute.
    assert_same_logs(trl_logs, kl_logs, loss=TOLERANCES["policy_loss"])


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor an op makes whose last dimension is the vocabulary ``vocab``."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kltriton_head", [True, False])
def test_the_head_builds_no_logits_of_the_batch(kltriton_head, model_dir, monkeypatch):
    """Forward and backward through the fused head of a batch of N = 8 x 40 positions: kltriton's head makes no
    tensor of N x V / 2 elements or more (its working tile: 64 rows); TRL's own head on a CPU (every position in one
    chunk) does, which shows the check can fail."""
    from transformers import AutoModelForCausalLM
    from trl.trainer import grpo_trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    vocab = model.config.vocab_size
    # The tile's budget as a real vocabulary sets it: 2^23 elements are 256 rows at V = 32000, but would be the
    # 1024-row cap at this tiny V = 18, more than the batch; 64 rows (the least) stand for a batch of thousands.
    monkeypatch.setenv("KLTRITON_LINEAR_TILE", str(64 * vocab))
    ids = torch.randint(3, vocab, (8, 40), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(40) < 4, -100, ids)
    with kl_trl.apply() if kltriton_head else contextlib.nullcontext():
        grpo_trainer.add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
        watch = _LargestLogits(vocab)
        with watch:
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            (out.loss + out.entropy.sum()).backward()
    n = ids.numel()
    if kltriton_head:
        assert 0 < watch.largest < n * vocab // 2, (watch.largest, n * vocab)
    else:
        assert watch.largest >= n * vocab // 2, (watch.largest, n * vocab)


@pytest.mark.parametrize("trainer, outputs", [
    ("sft_trainer", ("log_probs", "entropy", "is_top1")),
    ("dpo_trainer", ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")),
    ("kto_trainer", ("log_probs", "entropy", "mean_logits")),
])
def test_every_head_output_equals_trls(trainer, outputs, tied_model_dir, monkeypatch):
    """The head of SFT, DPO (with WPO's weight) and KTO, asked for what each trainer asks for: kltriton's head fills
    every field as TRL's does (zeros where the label is -100), is_top1 exactly, on a model whose head rows tie in pairs
    so that argmax's first-index rule decides it; then undo() and the same model scores with TRL's head again."""
    import importlib

    from transformers import AutoModelForCausalLM

    trainer_module = importlib.import_module(f"trl.trainer.{trainer}")
    model = AutoModelForCausalLM.from_pretrained(tied_model_dir)
    ids = torch.randint(3, model.config.vocab_size, (6, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(12) < 3, -100, ids)
    with torch.no_grad():  # labels at each position's tied maximum: half the earlier token of the pair, half the later
        logits = model(input_ids=ids).logits[:, :-1]
    top = logits.argmax(-1)
    labels[:3, 1:] = torch.where(labels[:3, 1:] == -100, -100, top[:3])
    labels[3:, 1:] = torch.where(labels[3:, 1:] == -100, -100, top[3:] + 1)
    assert bool((logits.gather(-1, (top + 1)[..., None]).squeeze(-1) == logits.max(-1).values)[3:].all())
    trl_head = _TrlHeadCounter(monkeypatch)
    with kl_trl.apply():
        trainer_module.add_fused_lm_head(model, outputs=outputs)
        ours = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert trl_head.calls == 0
    theirs = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert trl_head.calls == 1
    assert torch.equal(ours.label_mask, theirs.label_mask)
    if "is_top1" in outputs:
        assert torch.equal(ours.is_top1, theirs.is_top1)
        assert bool(ours.is_top1[:3, 3:].all()) and not bool(ours.is_top1[3:].any())  # the tie rule decided
    for name in ("loss", *(name for name in outputs if name != "is_top1")):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-5, atol=1e-6)
    for name in {"entropy", "mean_logits", "is_top1", "log_sum_sq_probs"} - set(outputs):
        assert getattr(ours, name) is None and getattr(theirs, name) is None


def test_a_head_asked_for_an_unknown_output_keeps_trls_head_with_a_log_line(model_dir, caplog):
    from transformers import AutoModelForCausalLM
    from trl.trainer import utils as trl_utils

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "a_future_statistic"))
    assert [r.getMessage() for r in caplog.records] == [
        "kltriton: LlamaForCausalLM keeps TRL's fused LM head, because it is asked for a_future_statistic, which "
        "kltriton's head does not compute"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_trains_the_same(loss_type, model_dir, tmp_path, monkeypatch, caplog):
    """Four GRPOTrainer steps per TRL loss type, with TRL's defaults for the bias-corrected KL and the
    importance-sampling level that loss type is meant for, an entropy mask and an entropy bonus: the logged
    metrics equal TRL's own run, and every step's loss came from kltriton."""
    overrides = dict(loss_type=loss_type, top_entropy_quantile=0.5, entropy_coef=0.01,
                     importance_sampling_level="sequence" if loss_type in ("grpo", "luspo") else "token",
                     epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    trl_logs = train(model_dir, tmp_path / "trl", **overrides)
    losses = CallCounter(monkeypatch, "policy_loss")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = train(model_dir, tmp_path / "kltriton", **overrides)
    assert not any("TRL's own code" in record.getMessage() for record in caplog.records)
    assert losses.calls >= 4, losses.calls
    assert_same_logs(trl_logs, kl_logs)


def test_apply_changes_nothing_until_called_and_undo_restores(model_dir):
    from trl.trainer import grpo_trainer

    before = (grpo_trainer.add_fused_lm_head, grpo_trainer.GRPOTrainer._compute_loss)
    patch = kl_trl.apply()
    assert grpo_trainer.add_fused_lm_head is not before[0]
    assert grpo_trainer.GRPOTrainer._compute_loss is not before[1]
    with pytest.raises(RuntimeError, match="already applied"):
        kl_trl.apply()
    patch.undo()
    assert (grpo_trainer.add_fused_lm_head, grpo_trainer.GRPOTrainer._compute_loss) == before
    patch.undo()  # a second undo is harmless
    with kl_trl.apply():
        pass
    assert (grpo_trainer.add_fused_lm_head, grpo_trainer.GRPOTrainer._compute_loss) == before


@pytest.mark.parametrize("module", ["trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer", "trl.trainer.utils",
                                    "trl.experimental.async_grpo.async_grpo_trainer"])
def test_model_built_while_applied_uses_trl_head_after_undo(module, model_dir, monkeypatch):
    """Each module's ``add_fused_lm_head`` (AsyncGRPOTrainer's needs CUDA and a vLLM server to train: its head is
    tested here directly) scores with kltriton while applied, equal to TRL's head, which serves again after undo."""
    import importlib
    import warnings

    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's warning on importing trl.experimental
        trainer_module = importlib.import_module(module)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    labels = ids.clone()
    labels[:, :2] = -100
    with kl_trl.apply():
        trainer_module.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
        logprobs = CallCounter(monkeypatch, "token_logprobs")
        ours = model(input_ids=ids, labels=labels, fused_lm_head=True)
        assert logprobs.calls == 1
    theirs = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert logprobs.calls == 1  # undone: TRL's head scored this call
    torch.testing.assert_close(ours.log_probs, theirs.log_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.entropy, theirs.entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    assert bool((ours.log_probs[:, :1] == 0).all()) and bool((ours.entropy[:, :1] == 0).all())


def test_moe_router_loss_falls_back_to_trl_loss_with_a_log_line(tmp_path, caplog):
    """A model whose forward returns MoE router logits is scored by kltriton's head (which returns the
    load-balancing loss, tests/integrations/test_trl_moe.py), but GRPO's loss is TRL's (policy_loss does not add the
    aux loss), with a log line saying so."""
    model = tmp_path / "tiny-mixtral"
    tiny_mixtral(model)
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        logs = train(model, tmp_path / "moe", max_steps=1, num_iterations=1)
    assert len(logs) == 1 and "aux_loss" in logs[0]
    lines = [record.getMessage() for record in caplog.records]
    assert any("MixtralForCausalLM scores its log_probs and entropy with kltriton's LM head" in line
               for line in lines), lines
    assert any("GRPOTrainer loss: TRL's own code" in line and "MoE aux loss" in line for line in lines), lines


class _Recorder:
    """Replaces ``kltriton.<name>`` (which the integration calls) for the test; keeps each call's truncation
    and, with ``check``, runs ``check(args, kwargs, out)`` on it."""

    def __init__(self, monkeypatch, name, check=None):
        original = getattr(kltriton, name)
        self.truncations = []

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            self.truncations.append(kwargs.get("truncation"))
            if check is not None:
                check(args, kwargs, out)
            return out

        monkeypatch.setattr(kltriton, name, recorded)


def _logits_of(linear):
    """The float64 logits of a ``kltriton.LinearLogits`` (no softcap here)."""
    x = linear.hidden.double() @ linear.weight.double().T * linear.logit_scale
    return x if linear.bias is None else x + linear.bias.double()


def test_truncation_switch_scores_the_sampled_distribution(model_dir, tmp_path, monkeypatch):
    """``apply(truncation=True)``: the policy's log-probs, in TRL's head and in the loss, are those of the
    distribution the completions were sampled from (the config's top-k / top-p at its temperature, against the
    float64 vLLM oracle); the reference's stay untruncated; off by default."""
    from truncation_oracle import vllm_logprobs
    from trl.trainer import grpo_trainer

    trl_logps = grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies
    with kl_trl.apply():  # off by default: TRL's log-prob function stays its own
        assert grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies is trl_logps
    top_k, top_p, temperature = 6, 0.8, 0.9  # train's temperature
    moved = []

    def expect(logits, labels, truncation):
        """float64 log-probs of ``labels``: truncated (the vLLM oracle) or plain."""
        x = _logits_of(logits)
        full = (torch.log_softmax(x / temperature, -1) if truncation is None
                else vllm_logprobs(x, temperature, truncation.top_k, truncation.top_p, truncation.min_p))
        return full.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    def check_head(args, kwargs, out):
        got = out[0] if isinstance(out, tuple) else out
        want = expect(args[0], args[1], kwargs["truncation"])
        torch.testing.assert_close(got.detach().double(), want, rtol=1e-5, atol=1e-5)  # fp32 vs float64, V = 18

    def check_loss(args, kwargs, out):
        logits, labels, mask = args[0], args[1], kwargs["mask"].bool()
        want = expect(logits, labels, kwargs["truncation"])
        torch.testing.assert_close(out.logprobs[mask].double(), want[mask], rtol=1e-5, atol=1e-5)
        moved.append(float((want - expect(logits, labels, None))[mask].abs().max().detach()))

    losses = _Recorder(monkeypatch, "policy_loss", check_loss)
    heads = _Recorder(monkeypatch, "token_logprobs", check_head)
    with kl_trl.apply(truncation=True):
        assert grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies is not trl_logps
        logs = train(model_dir, tmp_path / "truncated", top_k=top_k, top_p=top_p)
    assert grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies is trl_logps  # undone
    assert len(logs) == 4 and all(math.isfinite(log["loss"]) for log in logs)
    policy = [t for t in heads.truncations if t is not None]
    assert policy and all((t.top_k, t.top_p, t.min_p) == (top_k, top_p, None) for t in policy), heads.truncations
    assert None in heads.truncations  # the reference model (beta = 0.1) is scored untruncated
    assert len(losses.truncations) >= 4 and all(t is not None and t.top_k == top_k for t in losses.truncations)
    assert max(moved) > 1e-2  # the test can fail: truncation moved the log-probs the loss sees


def test_truncation_switch_leaves_a_peft_reference_untruncated(model_dir, tmp_path, monkeypatch):
    """With a LoRA adapter TRL scores the reference as the policy model with the adapter off (``use_adapter``):
    those log-probs stay untruncated, the policy's are truncated."""
    peft = pytest.importorskip("peft")
    heads = _Recorder(monkeypatch, "token_logprobs")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with kl_trl.apply(truncation=True):
        train(model_dir, tmp_path / "lora", peft_config=lora, top_k=6)
    # every call runs on the one (PEFT) model: only the reference's, under use_adapter, is untruncated
    assert None in heads.truncations, heads.truncations
    assert any(t is not None and t.top_k == 6 for t in heads.truncations), heads.truncations


def test_importing_the_integration_imports_no_trl():
    code = ("import sys, kltriton.integrations.trl; "
            "sys.exit(int(any(m == 'trl' or m.startswith('trl.') for m in sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(kltriton.__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
