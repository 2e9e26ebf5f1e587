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
