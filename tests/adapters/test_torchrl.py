"""kltriton.adapters.torchrl against the real torchrl classes and the seed formulas.

``TestTorchrlValidation`` ports the cases of torchrl's ``test/llm/test_wrapper.py::TestKLTransforms``
(torchrl v0.13/v0.14: ``test_retrieve_kl_input_modes``, ``test_retrieve_kl_assistant_only_validation``,
``test_retrieve_kl_pad_output_consistency``, ``test_kl_computation_transform``) onto a tiny Llama with
an in-memory tokenizer instead of Qwen2.5 from the Hub, and checks the values against torchrl's too.
The tiny models and data come from ``torchrl_support.py``.
"""
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrl")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tensordict import TensorDict, lazy_stack, set_list_to_stack  # noqa: E402
from torch.nn.utils.rnn import pad_sequence  # noqa: E402
from torchrl.data.llm.utils import AdaptiveKLController as RealAdaptive  # noqa: E402
from torchrl.envs.llm.transforms import kl as real  # noqa: E402
from torchrl.modules.llm import TransformersWrapper  # noqa: E402

import kltriton.adapters.torchrl as ours  # noqa: E402
from kltriton import estimators  # noqa: E402
from torchrl_support import (  # noqa: E402
    GEN, KEYS, LENGTHS, REF, as_rows, assert_same_rows, history_data, model_pair, nested, tiny_llama,
    tiny_tokenizer, tiny_wrapper, token_data)

@pytest.fixture(autouse=True)
def _lists_stack():
    with set_list_to_stack(True), warnings.catch_warnings():
        # torchrl's own classes deprecate arguments and build nested tensors: not what is tested here
        warnings.filterwarnings("ignore", module="torchrl")
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


# ---------------------------------------------------------------------------------------------
# KLComputation
# ---------------------------------------------------------------------------------------------

def logprob_data(layout, with_reward=True):
    torch.manual_seed(0)
    gen = [-torch.rand(n) for n in LENGTHS]
    ref = [-torch.rand(n) for n in LENGTHS]
    reward = [torch.randn(n, 1) for n in LENGTHS]
    if layout == "list":
        return lazy_stack([TensorDict({GEN: g, REF: r, **({"reward": w} if with_reward else {})})
                           for g, r, w in zip(gen, ref, reward)]), gen, ref, reward
    pack = (lambda x: pad_sequence(x, batch_first=True)) if layout == "padded" else nested  # noqa: E731
    td = TensorDict({GEN: pack(gen), REF: pack(ref)}, batch_size=(2,))
    if with_reward:
        td["reward"] = pack(reward)
    return td, gen, ref, reward


@pytest.mark.parametrize("layout", ["padded", "nested", "list"])
@pytest.mark.parametrize("with_reward", [True, False])
def test_kl_computation(layout, with_reward):
    coeff = 0.3
    kwargs = dict(gen_log_probs_full_key=GEN, ref_log_probs_full_key=REF, coeff=coeff, add_to_reward=with_reward)
    td, gen, ref, reward = logprob_data(layout, with_reward)
    out = ours.KLComputation(**kwargs)(TensorDict(next=td, batch_size=td.batch_size) if layout != "list" else td)
    out = out.get("next", out)
    kl = out.get("kl_penalty", as_list=True)
    assert isinstance(kl, list) if layout == "list" else kl.is_nested == (layout == "nested")
    for i, n in enumerate(LENGTHS):  # the seed formula: kl = gen - ref, reward - coeff * kl[..., None]
        torch.testing.assert_close(as_rows(out, "kl_penalty")[i][:n], gen[i] - ref[i])
        if with_reward:
            torch.testing.assert_close(as_rows(out, "reward")[i][:n], reward[i] - coeff * (gen[i] - ref[i])[:, None])
    try:  # the real class: runs on lazily stacked lists; with torch 2.13 it raises on padded rewards and nested inputs
        expected = real.KLComputation(**kwargs)(logprob_data(layout, with_reward)[0])
    except RuntimeError:
        assert layout == "nested" or (layout == "padded" and with_reward)
        return
    assert_same_rows(out, expected, ["kl_penalty"] + (["reward"] if with_reward else []), atol=0, rtol=0)


@pytest.mark.parametrize("estimator", ["k2", "k3", "abs"])
def test_kl_computation_estimator_and_clamp(estimator):
    td, gen, ref, _ = logprob_data("list", with_reward=False)
    out = ours.KLComputation(GEN, REF, add_to_reward=False, estimator=estimator, kl_clamp=0.1)(td)
    for i in range(len(LENGTHS)):
        d = gen[i] - ref[i]
        value = {"k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1, "abs": d.abs()}[estimator]
        torch.testing.assert_close(as_rows(out, "kl_penalty")[i], value.clamp(-0.1, 0.1))


def _table_value(name, d):
    """The estimator table on ``d = logp - ref_logp`` (float64; a ``+`` name has the base's value)."""
    base = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(name.rstrip("+"), name.rstrip("+"))
    return {"k1": d, "abs": d.abs(), "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[base]


LOGPROB_NAMES = [n for n in sorted(estimators.BY_NAME) if n != "full"]


@pytest.mark.parametrize("name", LOGPROB_NAMES)
def test_every_estimator_name_on_the_logprob_paths(name):
    """Every accepted name (aliases and verl's straight-through ``+`` names: the base's value) through
    ``KLComputation`` and ``KLRewardTransform``'s log-prob paths, against the table in float64."""
    td, gen, ref, _ = logprob_data("list", with_reward=False)
    out = ours.KLComputation(GEN, REF, add_to_reward=False, estimator=name)(td)
    for i in range(len(LENGTHS)):
        want = _table_value(name, gen[i].double() - ref[i].double())
        torch.testing.assert_close(as_rows(out, "kl_penalty")[i].double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["k3+", "low_var_kl+", "abs", "mse", "kl"])
def test_retrieve_kl_every_path_takes_the_name(name):
    """RetrieveKL's logits path (one token_kl kernel) and its log-prob path give the named estimator."""
    gen, ref = model_pair("tokens", True)
    logits_path = ours.RetrieveKL(gen, ref, assistant_only=False, estimator=name)(token_data(True))["next"]
    logprob_path = ours.RetrieveKL(gen, ref, assistant_only=False, estimator=name, fused=False)(token_data(True))
    for out in (logits_path, logprob_path["next"]):
        for gen_row, ref_row, kl_row in zip(*(as_rows(out, key) for key in (GEN, REF, "kl_penalty"))):
            d = gen_row.double() - ref_row.double()
            want = _table_value(name, d) * (gen_row != 0)
            torch.testing.assert_close(kl_row.double(), want, atol=3e-6, rtol=1e-5)


def test_kl_computation_errors():
    with pytest.raises(ValueError, match="needs both models' logits"):
        ours.KLComputation(estimator="full")
    with pytest.raises(ValueError, match="estimator must be one of"):
        ours.KLComputation(estimator="k4")
    with pytest.raises(TypeError, match="kl_clamp"):
        ours.KLComputation(kl_clamp="1")
    with pytest.raises(ValueError, match="kl_clamp"):
        ours.KLComputation(kl_clamp=0.0)
    with pytest.raises(ValueError, match="padding_side"):
        ours.KLComputation(padding_side="top")
    td = TensorDict({GEN: torch.zeros(2, 4), REF: torch.zeros(2, 5)}, batch_size=(2,))
    with pytest.raises(ValueError, match="Sample 0 has different shapes"):
        ours.KLComputation(GEN, REF, add_to_reward=False)(td)
    td = TensorDict({GEN: torch.zeros(2, 4), REF: torch.zeros(2, 4), "reward": torch.zeros(2, 4)}, batch_size=(2,))
    with pytest.raises(ValueError, match="one more"):
        ours.KLComputation(GEN, REF)(td)


# ---------------------------------------------------------------------------------------------
# RetrieveKL
# ---------------------------------------------------------------------------------------------



@pytest.mark.parametrize("pad_output", [False, True])
def test_retrieve_kl_tokens_matches_torchrl(pad_output):
    """input_mode='tokens': the logits path (one token_kl kernel) equals torchrl's RetrieveKL and the
    models' own log-probs path, and uses no private torchrl API (no warning, layout kept)."""
    gen, ref = model_pair("tokens", pad_output)
    data = token_data(pad_output)
    before = data.clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*models' log-probs")  # the logits path must not fall back
        fused = ours.RetrieveKL(gen, ref, assistant_only=False, coeff=0.5)(data)
    assert (data.exclude("next") == before.exclude("next")).all()  # the caller's inputs are untouched
    unfused = ours.RetrieveKL(gen, ref, assistant_only=False, coeff=0.5, fused=False)(token_data(pad_output))
    assert_same_rows(fused["next"], unfused["next"], KEYS)
    # torch 2.13 makes torchrl's KLComputation fail on padded rewards: compare those where it runs
    expected = real.RetrieveKL(gen, ref, assistant_only=False, coeff=0.5)(token_data(pad_output, reward=not pad_output))
    assert_same_rows(fused["next"], expected.get("next", expected), KEYS[:3] if pad_output else KEYS)
    if pad_output:
        assert not fused["next"].get("kl_penalty").is_nested
    assert not any(row.requires_grad for row in as_rows(fused["next"], GEN))  # detach=True


@pytest.mark.parametrize("pad_output", [False, True])
@pytest.mark.parametrize("assistant_only", [False, True])
def test_retrieve_kl_history_matches_torchrl(pad_output, assistant_only):
    """input_mode='history': the models tokenize themselves, so their log-probs are used (one warning)."""
    gen, ref = model_pair("history", pad_output)
    transform = ours.RetrieveKL(gen, ref, assistant_only=assistant_only, coeff=0.5)
    with pytest.warns(UserWarning, match="using the models' log-probs"):
        out = transform(history_data(pad_output))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*models' log-probs")  # once per transform
        transform(history_data(pad_output))
    expected = real.RetrieveKL(gen, ref, assistant_only=assistant_only, coeff=0.5)(
        history_data(pad_output, reward=not pad_output))  # see test_retrieve_kl_tokens_matches_torchrl
    assert_same_rows(out["next"], expected.get("next", expected), KEYS[:3] if pad_output else KEYS)
    if assistant_only:  # the first tokens are the system prompt: never scored
        assert all(row[:4].eq(0).all() for row in as_rows(out["next"], "kl_penalty"))


def test_retrieve_kl_estimator_clamp_and_full():
    gen, ref = model_pair("tokens", True)
    base = ours.RetrieveKL(gen, ref, assistant_only=False)(token_data(True))["next"]
    out = ours.RetrieveKL(gen, ref, assistant_only=False, estimator="k3", kl_clamp=0.05)(token_data(True))["next"]
    d = base.get(GEN) - base.get(REF)
    mask = base.get(GEN) != 0
    torch.testing.assert_close(out.get("kl_penalty"), ((torch.exp(-d) + d - 1) * mask).clamp(-0.05, 0.05),
                               atol=2e-6, rtol=1e-5)
    full = ours.RetrieveKL(gen, ref, assistant_only=False, estimator="full")(token_data(True))["next"]
    assert (full.get("kl_penalty")[mask] > 0).all() and full.get("kl_penalty")[~mask].eq(0).all()


def test_retrieve_kl_arguments_are_used_or_rejected():
    gen, ref = model_pair("tokens", True)
    with pytest.raises(ValueError, match="history_key"):
        ours.RetrieveKL(gen, ref, assistant_only=False, history_key="chat")
    with pytest.raises(ValueError, match="tokenizer_kwargs"):
        ours.RetrieveKL(gen, ref, assistant_only=False, tokenizer_kwargs={"padding": True})
    other = tiny_tokenizer()
    ours.RetrieveKL(gen, ref, assistant_only=False, tokenizer=other)  # same vocabulary: the models' tokenizer
    other.add_tokens(["extra"])
    with pytest.raises(ValueError, match="tokenizer differs"):
        ours.RetrieveKL(gen, ref, assistant_only=False, tokenizer=other)
    with pytest.raises(ValueError, match="padding_side"):
        ours.RetrieveKL(gen, ref, assistant_only=False, padding_side="middle")
    with pytest.raises(TypeError, match="fused"):
        ours.RetrieveKL(gen, ref, assistant_only=False, fused=1)
    with pytest.raises(TypeError, match="unexpected keyword"):  # torchrl forwards unknown kwargs to RetrieveLogProb
        ours.RetrieveKL(gen, ref, assistant_only=False, not_an_argument=1)
    with pytest.raises(ValueError, match="Cannot provide both 'ref_model' and 'ref_model_factory'"):
        ours.RetrieveKL(gen, ref, ref_model_factory=lambda: ref, assistant_only=False)
    with pytest.raises(ValueError, match="different `log_prob_key`"):
        ours.RetrieveKL(gen, gen, assistant_only=False)
    with pytest.raises(ValueError, match="gen_model cannot be None"):
        ours.RetrieveKL(None, ref, assistant_only=False)


def test_retrieve_kl_model_factories():
    gen, ref = model_pair("tokens", True)
    out = ours.RetrieveKL(gen_model_factory=lambda: gen, ref_model_factory=lambda: ref,
                          assistant_only=False)(token_data(True))
    expected = ours.RetrieveKL(gen, ref, assistant_only=False)(token_data(True))
    assert_same_rows(out["next"], expected["next"], KEYS, atol=0, rtol=0)


class TestTorchrlValidation:
    """Ported from torchrl's test/llm/test_wrapper.py::TestKLTransforms (see the module docstring)."""

    @pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
    @pytest.mark.parametrize("assistant_only", [True, False], ids=["assistant_only", "all_tokens"])
    @pytest.mark.parametrize("input_mode", ["history", "text", "tokens"])
    def test_retrieve_kl_input_modes(self, pad_output, assistant_only, input_mode):
        if assistant_only and input_mode != "history":
            pytest.skip("assistant_only=True requires input_mode='history'")
        if input_mode == "history":
            data = history_data(True, reward=False)
        elif input_mode == "text":
            data = TensorDict(text={"full": ["w1 w2 w3", "w4 w5 w6 w7 w8"]}, batch_size=(2,))
        else:
            data = token_data(True, reward=False).exclude(("masks", "all_assistant_mask"))
        gen = tiny_wrapper(0, "gen_log_probs", input_mode, pad_output)
        ref = tiny_wrapper(1, "ref_log_probs", input_mode, pad_output)
        kwargs = dict(gen_model=gen, ref_model=ref, assistant_only=assistant_only, tokenizer=gen.tokenizer,
                      gen_log_probs_full_key=("gen_log_probs", "full"), ref_log_probs_full_key=REF)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the log-probs path for history/text models
            result = ours.RetrieveKL(**kwargs)(data.to_lazystack(0))
        assert ("gen_log_probs", "full") in result and REF in result and "kl_penalty" in result
        if pad_output:
            kl = result.get("kl_penalty")
            assert isinstance(kl, torch.Tensor) and kl.shape[0] == 2
        else:
            kl = result.get("kl_penalty", as_list=True)
            assert isinstance(kl, list) and len(kl) == 2
        expected = real.RetrieveKL(**kwargs)(data.to_lazystack(0))
        assert_same_rows(result, expected, [("gen_log_probs", "full"), REF, "kl_penalty"])

    @pytest.mark.parametrize("transform", [ours.RetrieveKL, real.RetrieveKL])
    def test_retrieve_kl_assistant_only_validation(self, transform):
        gen = tiny_wrapper(0, "gen_log_probs", "text", True)
        ref = tiny_wrapper(1, "ref_log_probs", "text", True)
        with pytest.raises(ValueError, match="The model must have `input_mode='history'` when"):
            transform(gen_model=gen, ref_model=ref, assistant_only=True, tokenizer=gen.tokenizer)

    @pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
    @pytest.mark.parametrize("transform", [ours.RetrieveKL, real.RetrieveKL])
    def test_retrieve_kl_pad_output_consistency(self, pad_output, transform):
        gen = tiny_wrapper(0, "gen_log_probs", "history", pad_output)
        ref = tiny_wrapper(1, "ref_log_probs", "history", not pad_output)
        with pytest.raises(ValueError, match="pad_output mismatch: gen_model.pad_output="):
            transform(gen_model=gen, ref_model=ref, assistant_only=False, tokenizer=gen.tokenizer)

    @pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
    def test_kl_computation_transform(self, pad_output):
        gen = tiny_wrapper(0, "gen_log_probs", "history", pad_output)
        ref = tiny_wrapper(1, "ref_log_probs", "history", pad_output)
        data = history_data(pad_output, reward=False).to_lazystack(0)

        def run(transform_class):
            gen_result, ref_result = gen(data.copy()), ref(data.copy())
            next_td = TensorDict(batch_size=(2,)).to_lazystack(0)
            next_td.update(gen_result, keys_to_update=[("gen_log_probs", "full")])
            next_td.update(ref_result, keys_to_update=[REF])
            next_td.update({"reward": torch.arange(2.0).view(2, 1, 1)})
            transform = transform_class(gen_log_probs_full_key=("gen_log_probs", "full"), ref_log_probs_full_key=REF,
                                        kl_key="kl", add_to_reward=True, coeff=1.0)
            return transform(data.copy().set("next", next_td))["next"]

        result = run(ours.KLComputation)
        assert "kl" in result and "reward" in result
        kl = result.get("kl", as_list=True)
        assert isinstance(kl, list) and len(kl) == 2
        assert_same_rows(result, run(real.KLComputation), ["kl", "reward"])


# ---------------------------------------------------------------------------------------------
# from_collector
# ---------------------------------------------------------------------------------------------

def test_retrieve_kl_from_collector():
    """``gen_model="from_collector"``: built on first use from a torchrl collector's policy (a tiny Llama
    generating in a tokens-mode ChatEnv), then equal to a RetrieveKL given that model directly."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.transforms import DataLoadingPrimer

    tokenizer = tiny_tokenizer()
    ref = tiny_wrapper(1, "ref_log_probs", "tokens", True)
    policy = TransformersWrapper(tiny_llama(0), tokenizer=tokenizer, input_mode="tokens", generate=True,
                                 return_log_probs=True, pad_output=True,
                                 generate_kwargs={"max_new_tokens": 3, "do_sample": False})
    env = ChatEnv(batch_size=(1,), input_mode="tokens", tokenizer=tokenizer, system_prompt="w1 w2")
    env = env.append_transform(DataLoadingPrimer(dataloader=iter([{"query": ["w3 w4"]}] * 8), batch_size=(1,)))
    transform = ours.RetrieveKL("from_collector", ref, assistant_only=False)
    env = env.append_transform(transform)
    assert transform.gen_model is None
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = next(iter(collector))
    gen = transform.gen_model
    assert gen.generate is False and gen.model is policy.model
    batch = batch.reshape(-1)
    direct = ours.RetrieveKL(gen, ref, assistant_only=False)(batch.exclude("next").copy())
    assert_same_rows(batch["next"], direct, [GEN, REF, "kl_penalty"])
    assert as_rows(batch["next"], "kl_penalty")[0].abs().sum() > 0
    collector.shutdown()


def test_from_collector_needs_a_collector():
    ref = tiny_wrapper(1, "ref_log_probs", "tokens", True)
    with pytest.raises(ValueError, match="container is not set"):
        ours.RetrieveKL("from_collector", ref, assistant_only=False)(token_data(True))


# ---------------------------------------------------------------------------------------------
# KLRewardTransform
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pad_output", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_kl_reward_transform(pad_output, fused):
    gen, ref = model_pair("tokens", pad_output)
    data = gen(token_data(pad_output))  # the current log-probs at ("log_probs", "full")
    before = data.clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*models' log-probs")  # no fallback from the logits path
        out = ours.KLRewardTransform(ref, coef=0.2, assistant_only=True, fused=fused)(data.copy())
    assert (data.exclude("next") == before.exclude("next")).all()
    ref_lp = ref(token_data(pad_output)).get(REF, as_list=True)
    gen_lp = data.get(GEN, as_list=True)
    assistant = data.get(("masks", "all_assistant_mask"), as_list=True)
    for i, n in enumerate(LENGTHS):  # the seed formula on assistant tokens
        cut = (lambda x: x[-n:]) if pad_output else (lambda x: x)  # noqa: E731
        kl = ((cut(gen_lp[i]) - cut(ref_lp[i])) * cut(assistant[i])).detach()
        torch.testing.assert_close(cut(as_rows(out["next"], "kl_penalty")[i])[:, 0], kl, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(cut(as_rows(out["next"], "reward")[i])[:, 0], 1 - 0.2 * kl, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(cut(as_rows(out["next"], "ref_log_probs")[i])[:, 0],
                                   (cut(ref_lp[i]) * cut(assistant[i])).detach(), atol=2e-6, rtol=1e-5)
    layout = out["next"].get("kl_penalty", as_list=True)
    assert isinstance(layout, list) or layout.is_nested != pad_output


def test_kl_reward_transform_prompt_mask_and_clamp():
    """Without an assistant mask, torchrl scores the tokens after ("tokens", "prompt"); kl_clamp clamps."""
    gen, ref = model_pair("tokens", True)
    data = gen(token_data(True)).exclude(("masks", "all_assistant_mask"))
    data["tokens", "prompt"] = data["tokens", "full"][:, :5]
    out = ours.KLRewardTransform(ref, coef=0.2)(data.copy())["next"]
    kl = (data.get(GEN) - ref(data.copy()).get(REF)).detach()
    kl[:, :5] = 0
    torch.testing.assert_close(out.get("kl_penalty")[..., 0], kl, atol=2e-6, rtol=1e-5)
    clamped = ours.KLRewardTransform(ref, coef=0.2, kl_clamp=1e-3)(data.copy())["next"]
    torch.testing.assert_close(clamped.get("kl_penalty"), out.get("kl_penalty").clamp(-1e-3, 1e-3))
    torch.testing.assert_close(clamped.get("reward"), 1 - 0.2 * clamped.get("kl_penalty"))


def test_kl_reward_transform_errors():
    ref = tiny_wrapper(1, "ref_log_probs", "history", True)
    for transform in (ours.KLRewardTransform, real.KLRewardTransform):
        with pytest.raises(ValueError, match="configured to use tokens as input"):
            transform(ref)
        with pytest.raises(ValueError, match="Must provide exactly one of"):
            transform()
    ref = tiny_wrapper(1, "ref_log_probs", "tokens", True)
    with pytest.raises(ValueError, match="Only one in_key/out_key"):
        ours.KLRewardTransform(ref, in_keys=["a", "b"])
    with pytest.raises(ValueError, match="estimator='full'"):
        ours.KLRewardTransform(ref, estimator="full")
    with pytest.raises(TypeError, match="kl_clamp"):
        ours.KLRewardTransform(ref, kl_clamp=[1.0])
    with pytest.raises(RuntimeError, match="not found"):
        ours.KLRewardTransform(ref)(TensorDict(next=TensorDict(batch_size=(2,)), batch_size=(2,)))


# ---------------------------------------------------------------------------------------------
# No per-call warning from PyTorch's nested tensors
# ---------------------------------------------------------------------------------------------

def test_no_nested_tensor_prototype_warning():
    """PyTorch warns once per process: check a fresh one, where torchrl's own call does warn."""
    code = (
        "import warnings, torch\n"
        "from tensordict import TensorDict, lazy_stack\n"
        "import kltriton.adapters.torchrl as ours\n"
        "gen = [-torch.rand(n) for n in (3, 5)]\n"
        "td = lazy_stack([TensorDict({('a', 'full'): g, ('b', 'full'): g / 2, 'reward': torch.ones(len(g), 1)}) "
        "for g in gen])\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    out = ours.KLComputation(('a', 'full'), ('b', 'full'))(td)\n"
        "assert out.get('kl_penalty', as_list=True)[1].shape == (5,)\n"
        "print(sum('prototype stage' in str(w.message) for w in caught))\n"
    )
    result = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "0"


# ---------------------------------------------------------------------------------------------
# Controllers
# ---------------------------------------------------------------------------------------------

def test_adaptive_kl_controller_matches_torchrl():
    class Holder:
        kl_coef = None
    a, b = Holder(), Holder()
    mine = ours.AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000, model=a)
    theirs = RealAdaptive(init_kl_coef=0.2, target=6.0, horizon=10000, model=b)
    for values in ([-0.5, -2.0, -1.0], [-3.0] * 64, [-0.01] * 8):
        assert mine.update(values) == pytest.approx(float(theirs.update(values)), rel=1e-6)
        assert a.kl_coef == pytest.approx(float(b.kl_coef), rel=1e-6) and mine.value == mine.coef
    assert ours.ConstantKLController(kl_coef=0.1).update([1.0]) == 0.1
