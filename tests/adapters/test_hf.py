"""kltriton.adapters.hf.causal_lm_logprobs on tiny random-weight GPT-2 and Llama models."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kltriton.adapters.hf import causal_lm_logprobs  # noqa: E402

V = 97
LENGTHS = [5, 9, 3]


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def batch(padding_side):
    """The same sequences padded ``[B, T]`` (with attention mask) and packed ``[N]`` (with cu_seqlens)."""
    seqs = [torch.randint(0, V, (n,)) for n in LENGTHS]
    T = max(LENGTHS)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(T - len(s), T) if padding_side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    return seqs, ids, mask, torch.cat(seqs), cu


def eager_logprobs(model, seq):
    """float64 ``log_softmax(model(seq).logits)`` gathered at the next tokens: ``[L - 1]``."""
    model64 = model.double()
    try:
        logits = model64(seq[None]).logits[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0]
    finally:
        model.float()


def rows(values, mask, cu, i, padded):
    """Scored positions of sequence ``i`` (all but its last token)."""
    if padded:
        return values[i][mask[i].bool()][:-1]
    return values[cu[i]:cu[i + 1] - 1]


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_padded_packed_and_eager_agree(make, padding_side):
    torch.manual_seed(0)
    model, ref = make(), make()
    seqs, ids, mask, packed, cu = batch(padding_side)
    padded_out = causal_lm_logprobs(model, ids, mask, ref_model=ref)
    packed_out = causal_lm_logprobs(model, packed, cu_seqlens=cu, ref_model=ref)
    pos_out = causal_lm_logprobs(model, packed[None], position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None])
    assert padded_out.logprobs.shape == ids.shape and packed_out.logprobs.shape == packed.shape
    for i, seq in enumerate(seqs):
        want = eager_logprobs(model, seq).float()
        want_ref = eager_logprobs(ref, seq).float()
        for out, is_padded in ((padded_out, True), (packed_out, False)):
            torch.testing.assert_close(rows(out.logprobs, mask, cu, i, is_padded), want, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(rows(out.ref_logprobs, mask, cu, i, is_padded), want_ref, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(rows(out.kl, mask, cu, i, is_padded), want - want_ref, atol=4e-5, rtol=1e-5)
        torch.testing.assert_close(rows(pos_out.logprobs[0], mask, cu, i, False), want, atol=2e-5, rtol=1e-5)
    # unscored positions (padding, last token of every sequence) are exactly 0
    assert padded_out.logprobs[~mask.bool()].eq(0).all()
    assert packed_out.logprobs[cu[1:] - 1].eq(0).all() and packed_out.kl[cu[1:] - 1].eq(0).all()


def test_response_mask_temperature_and_gradient():
    torch.manual_seed(1)
    model = llama()
    seqs, ids, mask, packed, cu = batch("left")
    response = torch.zeros_like(ids, dtype=torch.bool)
    response[:, -2:] = True  # score only the last two tokens of every row
    out = causal_lm_logprobs(model, ids, mask, response_mask=response, temperature=0.7)
    for i, seq in enumerate(seqs):
        logits = model.double()(seq[None]).logits[0, :-1] / 0.7
        model.float()
        want = torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0].float()
        torch.testing.assert_close(out.logprobs[i, -3:-1], want[-2:], atol=2e-5, rtol=1e-5)
        assert out.logprobs[i, :-3].eq(0).all() and out.logprobs[i, -1] == 0
    out.logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch, transformers
    from kltriton.adapters.hf import causal_lm_logprobs
    mode = sys.argv[1]
    torch.manual_seed(0)
    B, T, V, R = 4, 256, 32000, 32
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=T,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, V, (B, T))
    response = torch.zeros(B, T, dtype=torch.bool)
    response[:, -R:] = True
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    with torch.no_grad():
        before = rss_mb()
        if mode == "eager":
            logp = torch.log_softmax(model(ids).logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            logp = logp * response[:, 1:]
        else:
            logp = causal_lm_logprobs(model, ids, response_mask=response).logprobs
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"mode": mode, "extra_peak_mb": peak - before, "logits_mb": B * T * V * 4 / 2**20}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and ru_maxrss in KiB")
def test_peak_memory_below_eager(tmp_path):
    """Peak RSS growth of one call, each mode in a fresh process: eager builds [B, T, V] logits and
    their log_softmax; the adapter only the [B * R, V] logits of the R response tokens per row."""
    script = tmp_path / "memory.py"
    script.write_text(MEMORY_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    results = {}
    for mode in ("eager", "adapter"):
        run = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env,
                             timeout=120, check=True)
        results[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    eager, adapter = results["eager"]["extra_peak_mb"], results["adapter"]["extra_peak_mb"]
    print(f"B=4 T=256 V=32000 R=32: logits {results['eager']['logits_mb']:.0f} MB; extra peak RSS "
          f"eager {eager:.0f} MB, adapter {adapter:.0f} MB")
    assert eager > results["eager"]["logits_mb"]  # the full logits were materialized
    assert adapter < eager / 2


def gemma2_softcap():
    cfg = transformers.Gemma2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, vocab_size=V, max_position_embeddings=64,
                                    final_logit_softcapping=2.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # logits well beyond the cap, so the tanh matters
    return model


def granite_scaled():
    cfg = transformers.GraniteConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=V, max_position_embeddings=64,
                                     logits_scaling=0.25, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GraniteForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [gemma2_softcap, granite_scaled], ids=["gemma2-softcap", "granite-scaling"])
def test_head_scaling_from_config_and_no_logits(make):
    """Softcap / logit scaling read from the config match the model's own logits; no logits are built (the LM head
    module's forward runs the scoring, as ``kltriton.heads`` does, and returns the ``[B, T]`` log-probs); the head's
    weight gets its gradient."""
    torch.manual_seed(2)
    model = make()
    outputs = []
    model.lm_head.register_forward_hook(lambda module, args, output: outputs.append(tuple(output.shape)))
    seqs, ids, mask, packed, cu = batch("right")
    out = causal_lm_logprobs(model, ids, mask)
    assert outputs == [tuple(ids.shape)], outputs
    model.lm_head.weight.grad = None
    out.logprobs.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    for i, seq in enumerate(seqs):
        want = eager_logprobs(model, seq).float()
        torch.testing.assert_close(rows(out.logprobs, mask, cu, i, True), want, atol=2e-5, rtol=1e-5)


def _ddp_worker(rank, init_file, report_file):
    """One gloo rank: the adapter on a DDP-wrapped Llama (``find_unused_parameters=True``, what transformers' Trainer
    sets without gradient checkpointing) equals the plain model, values and every parameter's gradient."""
    import torch.distributed as dist

    report = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
        torch.manual_seed(3)
        model, ref = llama(), llama()
        twin = llama()
        twin.load_state_dict(model.state_dict())
        wrapped = torch.nn.parallel.DistributedDataParallel(twin, find_unused_parameters=True)
        seqs, ids, mask, packed, cu = batch("left")
        outs = [causal_lm_logprobs(m, ids, mask, ref_model=ref, estimator="k3") for m in (model, wrapped)]
        for out in outs:
            (out.logprobs.sum() + out.kl.sum()).backward()
        for a, b in zip(outs[0], outs[1]):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, atol=1e-7, rtol=1e-6, msg=name)
        report["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        report["error"] = traceback.format_exc()
    finally:
        with open(report_file, "w") as f:
            json.dump(report, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_under_ddp_find_unused_parameters(tmp_path):
    """The adapter scores inside the wrapped model's forward and its LM head's (``kltriton.heads``): under DDP with
    ``find_unused_parameters=True`` (a head used after the forward is "marked ready twice") it equals the plain
    model."""
    import torch.multiprocessing as mp

    report_file = tmp_path / "report.json"
    mp.spawn(_ddp_worker, args=(str(tmp_path / "init"), str(report_file)), nprocs=1)
    report = json.loads(report_file.read_text())
    assert report == {"ok": True}, report.get("error")
