"""TRL's `GRPOTrainer` with kltriton: one call, `kltriton.integrations.trl.apply()`, before the trainer is built,
and TRL scores its log-probs, entropy and KL and computes its loss with kltriton, from the hidden states.

A tiny Llama and a word-level tokenizer built from a config (random weights, nothing downloaded) are trained for a
few GRPO steps on a toy reward (say "cat"), once with TRL's own code and once with kltriton, from the same seed.
The script prints both runs' logged metrics per step and checks that they agree.

    pip install "trl==1.16.0"                # or pip install -e ".[trl]" in the clone
    python examples/trl_grpo.py              # under a minute on 2 CPU cores: two training runs
"""
import math
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from kltriton.integrations import trl as kltriton_trl

WORDS = ["[PAD]", "[UNK]", "[EOS]", "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "big", "red", "and", "then"]
METRICS = {"loss": "loss", "kl": "kl", "entropy": "entropy", "grad_norm": "grad_norm",
           "clip_ratio/region_mean": "clipped", "reward": "reward"}  # logged name: column


def save_tiny_model(path):
    """A 2-layer Llama with random weights and a word-level tokenizer, saved where ``GRPOTrainer`` loads it."""
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                                        unk_token="[UNK]")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=2, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def reward_cats(completions, **kwargs):
    """The toy reward: how often a completion says "cat", minus a little per word."""
    return [float(c.split().count("cat")) - 0.1 * len(c.split()) for c in completions]


def train(model_dir, out_dir):
    """Four GRPO optimizer steps; the logged metrics of each."""
    args = GRPOConfig(output_dir=out_dir, report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=4,
                      num_iterations=2,    # the second pass over a generation batch is off-policy: ratios move
                      learning_rate=0.05, epsilon=0.1, beta=0.1, temperature=0.9, logging_steps=1,
                      save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    prompts = Dataset.from_dict({"prompt": ["the cat sat on", "a dog ran and", "the big red", "then a"] * 4})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_cats, args=args, train_dataset=prompts)
    trainer.remove_callback(PrinterCallback)  # the table below shows the logs of both runs
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


with tempfile.TemporaryDirectory() as tmp:
    save_tiny_model(f"{tmp}/model")
    trl_logs = train(f"{tmp}/model", f"{tmp}/trl")
    with kltriton_trl.apply():  # before GRPOTrainer is built; undone when the block ends
        kltriton_logs = train(f"{tmp}/model", f"{tmp}/kltriton")

print("\nGRPOTrainer, 4 steps on a tiny Llama: TRL's own code, then with kltriton.integrations.trl.apply()")
print(f"{'step':>4} {'run':<9}" + "".join(f"{column:>13}" for column in METRICS.values()))
for step, logs in enumerate(zip(trl_logs, kltriton_logs), start=1):
    for run, log in zip(("TRL", "kltriton"), logs):  # the reward is logged at generation steps only
        print(f"{step:>4} {run:<9}" + "".join(f"{log[name]:>13.7g}" if name in log else f"{'-':>13}"
                                              for name in METRICS))
# The runs differ only in fp32 rounding (TRL's head folds the vocabulary in torch, kltriton streams it), which four
# Adam steps carry to ~1e-5 relative: 1e-4 relative on the loss, KL and entropy, 1e-3 on the gradient norm.
tolerances = {"loss": 1e-4, "kl": 1e-4, "entropy": 1e-4, "grad_norm": 1e-3}
ok = len(trl_logs) == len(kltriton_logs) == 4 and all(
    math.isclose(a[name], b[name], rel_tol=rtol, abs_tol=1e-6)
    for a, b in zip(trl_logs, kltriton_logs) for name, rtol in tolerances.items())
print(f"the two runs' metrics agree: {'OK' if ok else 'MISMATCH'}")
raise SystemExit(0 if ok else 1)
