"""verl integration: verl's helpers run on kltriton, verl's own CPU tests pass with it, and kltriton's KL and
policy loss reproduce verl's formulas."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import verl.trainer.ppo.core_algos as core_algos  # noqa: E402
import verl.utils.torch_functional as verl_F  # noqa: E402

import kltriton  # noqa: E402
from helpers import CallCounter  # noqa: E402
from kltriton.integrations import verl as kl_verl  # noqa: E402

VERL_ORIGINALS = (verl_F.logprobs_from_logits, verl_F.entropy_from_logits, verl_F.entropy_from_logits_with_chunking)
# verl's own CPU unit tests for kl_penalty, agg_loss and the policy losses (shipped in verl's wheel as `tests`).
VERL_TESTS = ["test_core_algos_on_cpu.py", "test_loss_aggregation_on_cpu.py", "test_dynamic_policy_losses_on_cpu.py"]


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of kltriton.token_logprobs (what the integration calls)."""
    return CallCounter(monkeypatch, "token_logprobs")


def _logits(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()


def test_verl_cpu_unit_tests_pass_with_the_integration_applied():
    from importlib.metadata import distribution

    verl_dist = distribution("verl")  # verl's wheel ships these tests as a top-level `tests` package
    folder = Path(verl_dist.locate_file("tests/trainer/ppo"))
    assert all((folder / f).is_file() for f in VERL_TESTS), folder
    script = ("import sys, pytest; from kltriton.integrations import verl; verl.apply(); "
              "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(kltriton.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script, *[str(folder / f) for f in VERL_TESTS]],
                         capture_output=True, text=True, cwd=folder, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprobs_and_entropy_match_verl(dtype, counted):
    """verl's own logprobs_from_logits_v2-vs-naive test (CUDA-only upstream), run on CPU against kltriton."""
    logits = _logits((3, 37, 1031), dtype)
    labels = torch.randint(0, 1031, (3, 37), generator=torch.Generator().manual_seed(1))
    expected_lp = verl_F.logprobs_from_logits_naive(logits.double(), labels)
    expected_ent = VERL_ORIGINALS[1](logits.double())
    with kl_verl.apply():
        lp = verl_F.logprobs_from_logits(logits, labels)
        ent = verl_F.entropy_from_logits(logits)
        ent_chunked = verl_F.entropy_from_logits_with_chunking(logits.reshape(-1, 1031), chunk_size=16)
        entropy_loss = core_algos.compute_entropy_loss(logits, torch.ones(3, 37), "token-mean")
    assert counted.calls == 4
    assert lp.dtype == ent.dtype == torch.float32
    # Tolerance: what PyTorch's own log_softmax reaches at this dtype against float64.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(lp.double(), expected_lp, **tol)
    torch.testing.assert_close(ent.double(), expected_ent, **tol)
    torch.testing.assert_close(ent_chunked.double(), expected_ent.reshape(-1), **tol)
    torch.testing.assert_close(entropy_loss.double(), expected_ent.mean(), **tol)
    w = torch.randn(3, 37, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (grad,) = torch.autograd.grad((lp * w).sum() + (ent * w).sum(), logits)
    (expected,) = torch.autograd.grad((expected_lp * w).sum() + (expected_ent * w).sum(), logits)
    torch.testing.assert_close(grad.double(), expected.double(), **tol)


def test_apply_changes_nothing_until_called_and_undo_restores_everywhere():
    assert (verl_F.logprobs_from_logits, verl_F.entropy_from_logits,
            verl_F.entropy_from_logits_with_chunking) == VERL_ORIGINALS
    with kl_verl.apply() as patch:
        assert verl_F.logprobs_from_logits is kl_verl.logprobs_from_logits
        with pytest.raises(RuntimeError, match="already applied"):
            kl_verl.apply()
        # a verl module imported while applied binds kltriton's function by name, and gets verl's back on undo
        sys.modules.pop("verl.workers.rollout.naive.naive_rollout", None)
        import verl.workers.rollout.naive.naive_rollout as rollout

        assert rollout.logprobs_from_logits is kl_verl.logprobs_from_logits
    assert not patch.active
    assert rollout.logprobs_from_logits is VERL_ORIGINALS[0]
    assert (verl_F.logprobs_from_logits, verl_F.entropy_from_logits,
            verl_F.entropy_from_logits_with_chunking) == VERL_ORIGINALS


# verl kl_penalty name -> (kltriton estimator, kl_clamp). verl clamps k3 to [-10, 10] (and its log-ratio to
# [-20, 20], which never binds before the value clamp does).
KL_NAMES = {"kl": ("kl", None), "k1": ("k1", None), "abs": ("abs", None), "mse": ("mse", None), "k2": ("k2", None),
            "low_var_kl": ("low_var_kl", 10.0), "k3": ("k3", 10.0), "k1+": ("k1+", None), "kl+": ("kl+", None),
            "abs+": ("abs+", None), "k3+": ("k3+", 10.0), "low_var_kl+": ("low_var_kl+", 10.0)}


@pytest.mark.parametrize("name", list(KL_NAMES))
def test_kl_penalty_matches_kltriton_token_kl(name):
    """verl's kl_penalty on kltriton's log-probs == kltriton.token_kl with the same name: value and gradient."""
    estimator, kl_clamp = KL_NAMES[name]
    logits = _logits((4, 23, 257), torch.float32)
    labels = torch.randint(0, 257, (4, 23), generator=torch.Generator().manual_seed(3))
    ref_logp = torch.log_softmax(_logits((4, 23, 257), torch.float64, seed=4).detach(), -1)
    ref_logp = ref_logp.gather(-1, labels[..., None]).squeeze(-1).float()
    try:
        out = kltriton.token_kl(logits, ref_logp, labels, estimator=estimator, kl_clamp=kl_clamp)
    except ValueError as error:
        if "+" in name:
            pytest.skip(f"this kltriton does not accept {name!r} yet: {error}")
        raise
    with kl_verl.apply():
        expected = core_algos.kl_penalty(verl_F.logprobs_from_logits(logits, labels), ref_logp, name)
    torch.testing.assert_close(out.kl, expected, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(out.kl.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(kltriton, "policy_loss"), reason="kltriton.policy_loss has not landed yet")
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm", "token-sum"])
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "cispo"])
def test_policy_loss_matches_verl(loss_mode, aggregation):
    """kltriton.policy_loss == verl's compute_policy_loss_<mode> + agg_loss on verl's log-probs: loss and grad."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    b, t, v = 4, 19, 211
    logits = _logits((b, t, v), torch.float32)
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 12:] = 0
    mask[3, 5:] = 0
    advantages = torch.randn(b, generator=g)[:, None].expand(b, t)
    old = (verl_F.logprobs_from_logits_naive(logits.detach(), labels) + 0.3 * torch.randn(b, t, generator=g))
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                         policy_loss=PolicyLossConfig(loss_mode=loss_mode), ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    logp = verl_F.logprobs_from_logits_naive(logits, labels)
    expected, _ = core_algos.get_policy_loss_fn(loss_mode)(old, logp, advantages, mask, aggregation, config)
    out = kltriton.policy_loss(logits, labels, advantages, old_logprobs=old, loss_type=
                               {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo"}[loss_mode],
                               clip_low=0.2, clip_high=0.28, dual_clip=3.0 if loss_mode == "vanilla" else None,
                               aggregation=aggregation, mask=mask)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(out.loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


# Every name of verl's registry, with the config fields its function reads (a few set away from their defaults).
REGISTRY_CONFIGS = {
    "vanilla": {}, "gspo": {}, "cispo": {}, "gpg": {}, "geo_mean": {},
    "dppo_tv": dict(clip_ratio_low=0.05, clip_ratio_high=0.08, clip_ratio_c=1.3),
    "dppo_kl": dict(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=1.3),
    "sapo": dict(tau_pos=1.2, tau_neg=1.4),
    "clip_cov": dict(policy=dict(clip_cov_ratio=0.2, clip_cov_lb=0.05, clip_cov_ub=5.0)),
    "kl_cov": dict(policy=dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5)),
    "dro": dict(policy=dict(dro_beta=0.3)),
    "bypass_mode": dict(policy=dict(rollout_correction=dict(loss_type="ppo_clip"))),
    "bypass_mode/reinforce": dict(policy=dict(rollout_correction=dict(loss_type="reinforce", rollout_is="token",
                                                                       rollout_is_threshold=1.5))),
    "bypass_mode/icepop": dict(policy=dict(rollout_correction=dict(loss_type="reinforce", rollout_is="sequence",
                                                                    rollout_is_threshold="0.5_2.0"))),
}


def _actor_config(name, fields, **extra):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig, RolloutCorrectionConfig

    fields = dict(fields)
    policy = dict(fields.pop("policy", {}))
    if "rollout_correction" in policy:
        policy["rollout_correction"] = RolloutCorrectionConfig(**policy["rollout_correction"])
    settings = dict(dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28), **fields, **extra)
    return ActorConfig(strategy="fsdp", policy_loss=PolicyLossConfig(loss_mode=name.split("/")[0], **policy),
                       ppo_micro_batch_size_per_gpu=1, rollout_n=1, **settings)


def _registry_batch():
    b, t, v = 4, 19, 211
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).float()
    labels = torch.randint(0, v, (b, t), generator=g)
    logits[:, 2:6].scatter_add_(-1, labels[:, 2:6, None], 8.0 * torch.ones(b, 4, 1))  # likely tokens (DPPO)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 12:] = 0
    mask[3, 5:] = 0
    advantages = torch.randn(b, generator=g)[:, None].expand(b, t).contiguous()
    logp = verl_F.logprobs_from_logits_naive(logits.double(), labels)
    old = (logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).float()
    ref = (logp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)).float()
    return logits, labels, mask, advantages, old, ref


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", list(REGISTRY_CONFIGS))
def test_registry_losses_through_kltriton(name, aggregation):
    """Every policy loss of verl's registry, by its config name: verl's own function + ppo_loss's KL and entropy
    terms on float64 log-probs, against kltriton.policy_loss with policy_loss_arguments(config): loss, logits
    gradient and verl's metrics."""
    logits, labels, mask, advantages, old, ref = _registry_batch()
    config = _actor_config(name, REGISTRY_CONFIGS[name], use_kl_loss=True, kl_loss_coef=0.05,
                           kl_loss_type="low_var_kl", entropy_coeff=0.01, loss_agg_mode=aggregation)
    x64 = logits.double().requires_grad_()
    logp = verl_F.logprobs_from_logits_naive(x64, labels)
    entropy = VERL_ORIGINALS[1](x64)
    torch.manual_seed(7)  # clip_cov draws its tokens with torch.randperm
    loss, metrics = core_algos.get_policy_loss_fn(name.split("/")[0])(old.double(), logp, advantages.double(), mask,
                                                                       aggregation, config)
    loss = loss - 0.01 * core_algos.agg_loss(entropy, mask, aggregation)
    loss = loss + 0.05 * core_algos.agg_loss(core_algos.kl_penalty(logp, ref.double(), "low_var_kl"), mask,
                                              aggregation)
    (e_grad,) = torch.autograd.grad(loss, x64)
    x = logits.clone().requires_grad_()
    kwargs = kl_verl.policy_loss_arguments(config, response_length=logits.shape[1])
    old_or_rollout = dict(rollout_logprobs=old) if name.startswith("bypass") else dict(old_logprobs=old)
    torch.manual_seed(7)
    out = kltriton.policy_loss(x, labels, advantages, ref=ref, mask=mask, **old_or_rollout, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, x)
    torch.testing.assert_close(out.loss.double(), loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), e_grad, rtol=1e-4, atol=1e-6)
    ours = kl_verl.pg_metrics(out)
    for key, value in metrics.items():
        if key in ours and not name.startswith("bypass_mode/"):  # verl's reinforce logs ppo_kl against the rollout
            assert abs(float(ours[key]) - float(value)) < 1e-5, (key, float(ours[key]), float(value))


def _extreme(logits, labels, old, advantages):
    """Two scored tokens with log-ratios beyond verl's clamp of 20: +22 under a negative advantage (the dual clip
    and the clamp hold), -22 under a positive one."""
    logp = verl_F.logprobs_from_logits_naive(logits.double(), labels)
    old, advantages = old.clone(), advantages.clone()
    for (row, col), log_ratio, sign in (((0, 7), 22.0, -1.0), ((2, 3), -22.0, 1.0)):
        old[row, col] = float(logp[row, col] - log_ratio)
        advantages[row, col] = sign * (0.5 + advantages[row, col].abs())
    return old, advantages


@pytest.mark.parametrize("backend", ["reference", None], ids=["reference-fp64", "default-fp32"])
@pytest.mark.parametrize("extreme", [False, True], ids=["ordinary", "log-ratio-22"])
@pytest.mark.parametrize("name", sorted(core_algos.POLICY_LOSS_REGISTRY))
def test_a_registry_name_alone_is_verls_default_config(name, extreme, backend):
    """``kltriton.policy_loss(loss_type=name)`` with nothing else equals verl's registered function under verl's
    default configuration (``ActorConfig()`` and its ``PolicyLossConfig``: clip ratios 0.2, ``clip_ratio_c`` 3.0,
    ``loss_agg_mode`` token-mean, ...), called as verl's ``ppo_loss`` calls it: loss, logits gradient, metrics. On
    float64 logits with the reference backend, and on float32 logits with the default backend."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    logits, labels, mask, advantages, old, _ = _registry_batch()
    if extreme:
        old, advantages = _extreme(logits, labels, old, advantages)
    dtype = torch.float64 if backend == "reference" else torch.float32
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         policy_loss=PolicyLossConfig(loss_mode=name))
    x64 = logits.double().requires_grad_()
    old_or_rollout = dict(rollout_logprobs=old.to(dtype)) if name == "bypass_mode" else dict(old_logprobs=old.to(dtype))
    x = logits.to(dtype).requires_grad_()
    if name == "dro":  # PolicyLossConfig.dro_beta is None: an error in verl, and here
        with pytest.raises(ValueError, match="dro_beta"):
            core_algos.get_policy_loss_fn(name)(old.double(), verl_F.logprobs_from_logits_naive(x64, labels),
                                                advantages.double(), mask, config.loss_agg_mode, config)
        with pytest.raises(ValueError, match="dro_beta"):
            kltriton.policy_loss(x, labels, advantages.to(dtype), mask=mask, loss_type=name, backend=backend,
                                 **old_or_rollout)
        return
    torch.manual_seed(7)  # clip_cov draws its tokens with torch.randperm
    expected, metrics = core_algos.get_policy_loss_fn(name)(
        old.double(), verl_F.logprobs_from_logits_naive(x64, labels), advantages.double(), mask, config.loss_agg_mode,
        config)
    (e_grad,) = torch.autograd.grad(expected, x64)
    torch.manual_seed(7)
    out = kltriton.policy_loss(x, labels, advantages.to(dtype), mask=mask, loss_type=name, backend=backend,
                               **old_or_rollout)
    (grad,) = torch.autograd.grad(out.loss, x)
    # float64: rounding only; float32 logits: what PyTorch's own fp32 log_softmax reaches against float64.
    loss_tol, grad_tol = ((1e-10, 1e-12), (1e-10, 1e-12)) if backend == "reference" else ((1e-5, 1e-6), (1e-4, 1e-6))
    torch.testing.assert_close(out.loss.double(), expected.detach(), rtol=loss_tol[0], atol=loss_tol[1])
    torch.testing.assert_close(grad.double(), e_grad, rtol=grad_tol[0], atol=grad_tol[1])
    ours = kl_verl.pg_metrics(out)
    for key, value in metrics.items():
        if key in ours:
            assert abs(float(ours[key]) - float(value)) < 1e-5, (key, float(ours[key]), float(value))


def test_every_registry_name_has_a_mapping():
    names = set(core_algos.POLICY_LOSS_REGISTRY)
    assert names == {name.split("/")[0] for name in REGISTRY_CONFIGS}
    for name in names:
        config = _actor_config(name, REGISTRY_CONFIGS[name])
        assert kl_verl.policy_loss_arguments(config)["loss_type"] == name


def test_bypass_with_rejection_sampling_is_refused_clearly():
    config = _actor_config("bypass_mode", dict(policy=dict(rollout_correction=dict(
        loss_type="reinforce", rollout_rs="token_k1", rollout_rs_threshold=2.0))))
    with pytest.raises(NotImplementedError, match="rollout_rs"):
        kl_verl.policy_loss_arguments(config)


def _tiny_llama_classes():
    """Two subclasses of a 2-layer Llama with the same random weights: verl's backends patch the class's forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    models = []
    for name in ("TorchBackendLlama", "KltritonBackendLlama"):
        cls = type(name, (LlamaForCausalLM,), {})
        torch.manual_seed(0)
        models.append(cls(config))
    return models


def test_fused_kernels_backend_matches_verl_torch_backend(caplog):
    """use_fused_kernels=True with impl_backend="kltriton": the actor's log-probs and entropy from the hidden states
    equal verl's torch backend's, and so do the gradients of verl's policy loss on them and three SGD steps."""
    from verl.models.transformers import monkey_patch
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    torch_model, ours = _tiny_llama_classes()
    monkey_patch.patch_forward_with_backends(torch_model, use_fused_kernels=True, fused_kernels_backend="torch")
    with kl_verl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.verl"):
        monkey_patch.patch_forward_with_backends(ours, use_fused_kernels=True, fused_kernels_backend="kltriton")
    assert any("fused_kernels_backend='kltriton'" in r.getMessage() for r in caplog.records)
    assert type(ours).forward is kl_verl.forward_with_kltriton_backend
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 97, (3, 17), generator=g)
    mask = torch.ones(3, 17, dtype=torch.long)
    advantages = torch.randn(3, 1, generator=g).expand(3, 17)
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, policy_loss=PolicyLossConfig(loss_mode="vanilla"),
                         ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    # SGD: the updates stay proportional to the gradients (Adam's normalization would turn the rounding of a
    # near-zero gradient into a step of size lr).
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (torch_model, ours)]
    old = None
    for step in range(3):
        outs = []
        for model, opt in zip((torch_model, ours), optimizers):
            out = model(input_ids=input_ids, attention_mask=mask, temperature=0.8, return_dict=True)
            logp = out.log_probs
            old_logp = logp.detach() + 0.1 if old is None else old
            loss, _ = core_algos.get_policy_loss_fn("vanilla")(old_logp, logp, advantages, mask, "token-mean", config)
            loss = loss - 0.01 * out.entropy.float().mean()
            opt.zero_grad()
            loss.backward()
            outs.append((logp.detach(), out.entropy.detach().float(), loss.detach(),
                         [p.grad.clone() for p in model.parameters()]))
            opt.step()
        (lp_t, ent_t, loss_t, grads_t), (lp_k, ent_k, loss_k, grads_k) = outs
        assert lp_k.dtype == torch.float32
        torch.testing.assert_close(lp_k, lp_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_k, ent_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads_k, grads_t):  # fp32 GEMMs of two heads: 1e-4 of the gradient's size
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * b.abs().max().item())
        old = lp_t - 0.05
    for a, b in zip(ours.parameters(), torch_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_importing_the_integration_imports_no_verl():
    code = ("import sys, kltriton.integrations.verl; "
            "sys.exit(int(any(m == 'verl' or m.startswith('verl.') for m in sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(kltriton.__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]


def test_verl_autoapply_module_applies_in_a_fresh_process():
    """What verl's Ray workers do with VERL_USE_EXTERNAL_MODULES=kltriton.integrations.verl_autoapply."""
    code = "import verl.utils.torch_functional as F; print(F.logprobs_from_logits.__module__)"
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="kltriton.integrations.verl_autoapply",
               PYTHONPATH=str(Path(kltriton.__file__).parents[1]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.stdout.strip().endswith("kltriton.integrations.verl"), run.stdout + run.stderr[-2000:]
