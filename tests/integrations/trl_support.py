"""Shared by the TRL integration tests: tiny models built from configs (no downloads), a deterministic reward, a
4-step GRPOTrainer (and RLOOTrainer) run, and a GRPOTrainer whose ``_compute_loss`` can be called on a hand-made batch."""
import math

import torch

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "log", "big", "small", "red", "blue", "and", "then"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return vocab, PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                                          unk_token="[UNK]")


def tiny_llama(path, seed=0, hidden_size=32):
    """A 2-layer Llama with random weights (``seed``) and a word-level tokenizer, saved to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, tokenizer = _tokenizer()
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def tie_head_rows(model_dir):
    """Make the LM head's rows of each token pair (2k, 2k + 1) equal (saved back to ``model_dir``): every position's
    logits then tie in pairs, so a label is its row's argmax only as the earlier of its pair (``argmax``'s rule)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight[1::2] = weight[0::2][:weight[1::2].shape[0]]
    model.save_pretrained(model_dir)


def tiny_mixtral(path):
    """A 2-layer Mixtral (4 experts, 2 per token) that returns its router logits: TRL adds its load-balancing
    loss (``router_aux_loss_coef`` 0.01)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    vocab, tokenizer = _tokenizer()
    config = MixtralConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.01, pad_token_id=0, bos_token_id=2, eos_token_id=2,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def reward_cats(completions, **kwargs):
    """Deterministic reward with spread inside every group: how often "cat" is said."""
    return [float(c.split().count("cat")) - 0.1 * len(c.split()) for c in completions]


def config(out_dir, **overrides):
    from trl import GRPOConfig

    base = dict(output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=4,
                num_iterations=2,          # the second pass over a generation batch is off-policy: ratios move
                learning_rate=0.05,        # big steps on purpose, so that some ratios leave [1 - eps, 1 + eps]
                epsilon=0.1, beta=0.1, temperature=0.9, logging_steps=1, save_strategy="no",
                disable_tqdm=True, dataloader_num_workers=0)
    base.update(overrides)
    return GRPOConfig(**base)


def train_rloo(model_dir, out_dir, **overrides):
    """Run RLOOTrainer (TRL's own generation, temperature 0.8, a reference model) for 4 optimizer steps; return the
    per-step logs."""
    from trl import RLOOConfig, RLOOTrainer

    args = dict(output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=4,
                num_iterations=2, learning_rate=0.05, epsilon=0.1, beta=0.1, temperature=0.8, logging_steps=1,
                save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    args.update(overrides)
    trainer = RLOOTrainer(model=str(model_dir), reward_funcs=reward_cats, args=RLOOConfig(**args),
                          train_dataset=dataset())
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


PREFERENCES = {"prompt": ["the cat sat on", "a dog ran and", "the big red", "then a small"] * 2,
               "chosen": [" the mat", " then sat", " cat ran", " dog sat on the log"] * 2,
               "rejected": [" a log", " a big dog", " blue mat and", " red"] * 2}


def train_offline(trainer_name, model_dir, out_dir, steps=3, **overrides):
    """Run TRL's ``SFTTrainer`` (prompt-completion pairs), ``DPOTrainer`` (preferences) or ``KTOTrainer`` (labelled
    completions) for ``steps`` fp32 SGD steps on a tiny dataset; return the per-step logs."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = {"sft": {"prompt": PREFERENCES["prompt"], "completion": PREFERENCES["chosen"]},
            "dpo": PREFERENCES,
            "kto": {"prompt": PREFERENCES["prompt"], "completion": PREFERENCES["chosen"],
                    "label": [True, False, True, False] * 2}}[trainer_name]
    prefix = trainer_name.upper()
    args = dict(output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                per_device_train_batch_size=4, max_steps=steps, learning_rate=0.05, optim="sgd", logging_steps=1,
                save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, max_length=16)
    args.update(overrides)
    trainer = getattr(trl, f"{prefix}Trainer")(
        model=AutoModelForCausalLM.from_pretrained(model_dir), args=getattr(trl, f"{prefix}Config")(**args),
        train_dataset=Dataset.from_dict(data), processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def train_online_dpo(model_dir, out_dir, peft_config=None, watch_model=None, **overrides):
    """Run the experimental ``OnlineDPOTrainer`` (TRL's own generation at temperature 0.9, ``reward_cats`` as its
    reward) for 4 fp32 optimizer steps; return the per-step logs. ``watch_model(model)`` runs before the trainer is
    built (e.g. to hook the LM head)."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's warning on importing trl.experimental
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    args = dict(output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                per_device_train_batch_size=4, max_steps=4, learning_rate=0.05, logging_steps=1, save_strategy="no",
                disable_tqdm=True, dataloader_num_workers=0, max_new_tokens=6, temperature=0.9)
    args.update(overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if watch_model is not None:
        watch_model(model)
    trainer = OnlineDPOTrainer(model=model, reward_funcs=reward_cats, args=OnlineDPOConfig(**args),
                               train_dataset=dataset(), processing_class=AutoTokenizer.from_pretrained(model_dir),
                               peft_config=peft_config)
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["the cat sat on", "a dog ran and", "the big red", "then a small"] * 4})


def train(model_dir, out_dir, peft_config=None, **overrides):
    """Run GRPOTrainer for 4 optimizer steps; return the per-step logs."""
    from trl import GRPOTrainer

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_cats, args=config(out_dir, **overrides),
                          train_dataset=dataset(), peft_config=peft_config)
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


# Tolerances of a run. The two runs differ only in fp32 rounding: TRL's CPU head folds the vocab in torch,
# kltriton streams it in its C++ kernel; per-token log-probs agree to ~1e-6, and Adam steps of 0.05 on a 2-layer
# model carry that to ~1e-5 relative in the weights after 4 steps. Sampling sees the same seed, and a ~1e-6 shift
# of a probability flips a sampled token with probability ~1e-6 per token, so the completions are the same.
# Loss, kl, entropy: 1e-4 relative (+1e-6 absolute). grad_norm: 1e-3 relative (a norm over ~20k parameters after
# 3 updates). policy_loss (the loss without the entropy bonus) is a sum of O(1) terms of both signs that can
# nearly cancel: 1e-5 absolute, the loss's own scale. Fractions of clipped tokens (1/24 apart) must be equal up
# to float noise, 1e-6: a single token clipped differently fails the test.
TOLERANCES = {"loss": (1e-4, 1e-6), "kl": (1e-4, 1e-6), "entropy": (1e-4, 1e-6), "grad_norm": (1e-3, 1e-6),
              "policy_loss": (1e-4, 1e-5), "vespo/phi_seq_mean": (1e-4, 1e-6), "entropy_coef": (1e-9, 1e-12)}
FRACTION_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max", "cispo_clip_ratio")


def assert_same_logs(trl_logs, kl_logs, **tolerances):
    """The two runs' logs agree (``TOLERANCES``, updated by ``tolerances``: key -> (rtol, atol))."""
    assert len(trl_logs) == len(kl_logs) == 4
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        assert set(a) == set(b), (step, set(a) ^ set(b))
        for key, (rtol, atol) in {**TOLERANCES, **tolerances}.items():
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=rtol, abs_tol=atol), (step, key, a[key], b[key])
        for key in FRACTION_KEYS:
            if key in a:
                assert (math.isnan(a[key]) and math.isnan(b[key])) or math.isclose(a[key], b[key], abs_tol=1e-6), \
                    (step, key, a[key], b[key])
        for key in ("reward", "reward_std", "num_tokens", "completions/mean_length"):  # at generation steps
            assert a.get(key) == b.get(key), (step, "completions differ", key, a.get(key), b.get(key))


def assert_logs_close(trl_logs, kl_logs, steps, exact=()):
    """Every logged metric of the two runs (``steps`` each) within 1e-4 relative (+1e-6 absolute), those in
    ``exact`` equal. The runs differ in fp32 rounding only: TRL folds the vocabulary in torch, kltriton streams it;
    per-token log-probs agree to ~1e-6 and a few SGD steps of lr 0.05 carry that to ~1e-5 relative."""
    assert len(trl_logs) == len(kl_logs) == steps, (len(trl_logs), len(kl_logs))
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        assert set(a) == set(b), (step, set(a) ^ set(b))
        for key in a:
            if key in exact:
                assert a[key] == b[key], (step, key, a[key], b[key])
            else:
                assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (step, key, a[key], b[key])


class FullLogitsWatch:
    """Called on a model, hooks its LM head module and records the shape of every ``[B, T, V]`` logits tensor the
    head's own forward returns (kltriton's scoring runs as the head's forward too, returning log-probs instead)."""

    def __init__(self):
        self.shapes = []

    def __call__(self, model):
        def record(module, args, output):
            if isinstance(output, torch.Tensor) and output.dim() == 3 and output.shape[-1] == module.out_features:
                self.shapes.append(tuple(output.shape))

        model.get_output_embeddings().register_forward_hook(record)
