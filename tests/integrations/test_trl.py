"""TRL integration: GRPOTrainer trains on a tiny Llama with and without kltriton, same seed, same metrics."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

import kltriton  # noqa: E402
from helpers import CallCounter  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "log", "big", "small", "red", "blue", "and", "then"]


def _tiny_llama(path):
    """A 2-layer Llama with random weights and a word-level tokenizer, saved to ``path`` (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                                        unk_token="[UNK]")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=2, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _reward_cats(completions, **kwargs):
    """Deterministic reward with spread inside every group: how often "cat" is said."""
    return [float(c.split().count("cat")) - 0.1 * len(c.split()) for c in completions]


def _train(model_dir, out_dir, peft_config=None, **overrides):
    """Run GRPOTrainer for 4 optimizer steps; return the per-step logs."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": ["the cat sat on", "a dog ran and", "the big red", "then a small"] * 4})
    args = GRPOConfig(
        output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=4,
        num_iterations=2,          # the second pass over a generation batch is off-policy: ratios move
        learning_rate=0.05,        # big steps on purpose, so that some ratios leave [1 - eps, 1 + eps]
        epsilon=0.1, beta=0.1, temperature=0.9, logging_steps=1, save_strategy="no",
        use_bias_correction_kl=False,  # TRL's default (True) weights the KL by the ratio: no kltriton equivalent
        disable_tqdm=True, dataloader_num_workers=0, **overrides,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=_reward_cats, args=args, train_dataset=dataset,
                          peft_config=peft_config)
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    _tiny_llama(path)
    return path


# Tolerances. The two runs differ only in fp32 rounding: TRL's CPU head folds the vocab in torch, kltriton
# streams it in its C++ kernel; per-token log-probs agree to ~1e-6, and Adam steps of 0.05 on a 2-layer model
# carry that to ~1e-5 relative in the weights after 4 steps. Sampling sees the same seed, and a ~1e-6 shift of
# a probability flips a sampled token with probability ~1e-6 per token, so the completions are the same.
# Loss, kl, entropy: 1e-4 relative (+1e-6 absolute). grad_norm: 1e-3 relative (a norm over ~20k parameters
# after 3 updates). clip_ratio/*: fractions of 24 completion tokens (1/24 apart), so they must be equal up to
# float noise, 1e-6: a single token clipped differently fails the test.
TOLERANCES = {"loss": 1e-4, "kl": 1e-4, "entropy": 1e-4, "grad_norm": 1e-3}
CLIP_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
             "clip_ratio/high_max")


def _assert_same_metrics(trl_logs, kl_logs):
    assert len(trl_logs) == len(kl_logs) == 4
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        for key, rtol in TOLERANCES.items():
            assert math.isclose(a[key], b[key], rel_tol=rtol, abs_tol=1e-6), (step, key, a[key], b[key])
        for key in CLIP_KEYS:
            assert math.isclose(a[key], b[key], abs_tol=1e-6), (step, key, a[key], b[key])
        for key in ("reward", "reward_std", "num_tokens", "completions/mean_length"):  # at generation steps
            assert a.get(key) == b.get(key), (step, "completions differ", key, a.get(key), b.get(key))


def test_grpo_trains_the_same_with_kltriton(model_dir, tmp_path, monkeypatch, caplog):
    trl_logs = _train(model_dir, tmp_path / "trl")
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    losses = CallCounter(monkeypatch, "policy_loss")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = _train(model_dir, tmp_path / "kltriton")
    # One line each says what runs: kltriton's head on both models, kltriton's loss.
    lines = [record.getMessage() for record in caplog.records]
    assert any("LlamaForCausalLM scores its log_probs and entropy with kltriton's LM head" in line for line in lines)
    assert sum("GRPOTrainer loss: kltriton.policy_loss" in line for line in lines) == 1, lines
    # The test can fail: clipping happened, the KL moved off zero, training moved the model.
    assert any(log["clip_ratio/region_mean"] > 0 for log in trl_logs)
    assert all(log["kl"] > 0 for log in trl_logs[1:])
    _assert_same_metrics(trl_logs, kl_logs)
    # Every generation batch is scored by the reference model and, with num_iterations=2, by the old policy.
    assert logprobs.calls >= 2 * 2, logprobs.calls
    # The configuration maps onto policy_loss: every optimizer step's loss came from kltriton.
    assert losses.calls >= 4, losses.calls
    print("\nstep | " + " | ".join(["loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"]), file=sys.stderr)
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        cells = [f"{a[k]:.7g} / {b[k]:.7g}" for k in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean")]
        print(f"{step} | " + " | ".join(cells), file=sys.stderr)


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


def test_model_built_while_applied_uses_trl_head_after_undo(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM
    from trl.trainer import grpo_trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    labels = ids.clone()
    labels[:, :2] = -100
    with kl_trl.apply():
        grpo_trainer.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
        logprobs = CallCounter(monkeypatch, "token_logprobs")
        ours = model(input_ids=ids, labels=labels, fused_lm_head=True)
        assert logprobs.calls == 1
    theirs = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert logprobs.calls == 1  # undone: TRL's head scored this call
    torch.testing.assert_close(ours.log_probs, theirs.log_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.entropy, theirs.entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    assert bool((ours.log_probs[:, :1] == 0).all()) and bool((ours.entropy[:, :1] == 0).all())


def test_unmapped_configuration_falls_back_to_trl_loss_with_a_log_line(model_dir, tmp_path, caplog):
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        logs = _train(model_dir, tmp_path / "sapo", loss_type="sapo")
    assert len(logs) == 4
    assert any("TRL's own code" in record.getMessage() for record in caplog.records)


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
    top_k, top_p, temperature = 6, 0.8, 0.9  # _train's temperature
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
        moved.append(float((want - expect(logits, labels, None))[mask].abs().max()))

    losses = _Recorder(monkeypatch, "policy_loss", check_loss)
    heads = _Recorder(monkeypatch, "token_logprobs", check_head)
    with kl_trl.apply(truncation=True):
        assert grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies is not trl_logps
        logs = _train(model_dir, tmp_path / "truncated", top_k=top_k, top_p=top_p)
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
        _train(model_dir, tmp_path / "lora", peft_config=lora, top_k=6)
    # every call runs on the one (PEFT) model: only the reference's, under use_adapter, is untruncated
    assert None in heads.truncations, heads.truncations
    assert any(t is not None and t.top_k == 6 for t in heads.truncations), heads.truncations


def test_importing_the_integration_imports_no_trl():
    code = ("import sys, kltriton.integrations.trl; "
            "sys.exit(int(any(m == 'trl' or m.startswith('trl.') for m in sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(kltriton.__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
