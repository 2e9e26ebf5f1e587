"""Mistakes and extreme inputs a new user hits, as tests of the behaviour and of the error text: empty
batches, non-finite or out-of-range float options, unscored positions, the command line, environment
variables, a process group used before it exists, the C++ gradient cache."""
import os
import subprocess
import sys

import pytest
import torch

import kltriton
from helpers import assert_close, random_labels, random_logits

V = 61


# --- empty batches ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, V), (2, 0, V), (0, 3, V)], ids=["N0", "T0", "B0"])
def test_empty_batches_give_empty_outputs_and_zero_loss(backend, shape):
    """Empty in, empty out; ``policy_loss`` a 0 loss with zero gradients and 0 metrics (logits and
    LinearLogits, fused and two-pass routes)."""
    lead = shape[:-1]
    labels, adv = torch.zeros(lead, dtype=torch.long), torch.zeros(lead)
    for loss_type in ("ppo", "gspo"):
        x = torch.randn(shape, requires_grad=True)
        out = kltriton.policy_loss(x, labels, adv, ref=torch.zeros(lead), kl_coef=0.1, loss_type=loss_type,
                                   backend=backend)
        out.loss.backward()
        assert out.loss.item() == 0.0 and x.grad.shape == shape
        assert all(v.item() == 0.0 for v in out.metrics.values()), out.metrics
        assert out.logprobs.shape == lead and out.ratio.shape == lead
    h, w = torch.randn(*lead, 8, requires_grad=True), torch.randn(V, 8, requires_grad=True)
    out = kltriton.policy_loss(kltriton.LinearLogits(h, w), labels, adv, backend=backend)
    out.loss.backward()
    assert out.loss.item() == 0.0 and h.grad.shape == h.shape and not w.grad.any()
    assert kltriton.token_logprobs(torch.randn(shape), labels, backend=backend).shape == lead
    kl = kltriton.fused_kl_reward(torch.randn(shape), torch.randn(shape), labels, backend=backend)
    assert kl.reward.shape == lead


# --- float options -----------------------------------------------------------------------------------

def _batch():
    torch.manual_seed(0)
    return random_logits((2, 5, V), torch.float32), random_labels((2, 5), V)


def _float_options():
    """(op name, option, call(value), values that must be refused) for every float option of every op."""
    logits, labels = _batch()
    adv = torch.randn(2, 5)
    ref = logits.flip(-1)

    def loss(**kw):
        return lambda v: kltriton.policy_loss(logits, labels, adv, ref=ref, **{k: (v if x is None else x)
                                                                                for k, x in kw.items()})
    out = []
    nonfinite = (float("nan"), float("inf"), float("-inf"))
    for option, negative in (("clip_low", -0.1), ("clip_high", -0.1), ("kl_coef", None),
                             ("entropy_coef", None), ("is_cap", -1.0), ("horizon", -3.0), ("kl_clamp", -1.0)):
        bad = nonfinite + ((negative,) if negative is not None else ())
        out.append(("policy_loss", option, loss(**{option: None}), bad))
    for option, out_of_range in (("dual_clip", 0.5), ("log_ratio_clamp", 0.0)):  # +inf: off (docs/api/losses.md)
        out.append(("policy_loss", option, loss(loss_type="vanilla", **{option: None}),
                    (float("nan"), float("-inf"), out_of_range)))
    out.append(("token_kl", "kl_clamp", lambda v: kltriton.token_kl(logits, ref, labels, kl_clamp=v),
                nonfinite + (0.0, -1.0)))
    out.append(("token_logprobs", "temperature", lambda v: kltriton.token_logprobs(logits, labels, temperature=v),
                nonfinite + (0.0, -1.0)))
    for option, bad in (("coef", nonfinite), ("score_clip", nonfinite + (0.0,)), ("kl_clamp", nonfinite + (-1.0,)),
                        ("temperature", nonfinite + (0.0,))):
        out.append(("fused_kl_reward", option,
                    lambda v, option=option: kltriton.fused_kl_reward(logits, ref, labels, scores=torch.ones(2),
                                                                      **{option: v}), bad))
    h, w = torch.randn(2, 5, 4), torch.randn(V, 4)
    out.append(("LinearLogits", "logit_scale", lambda v: kltriton.LinearLogits(h, w, logit_scale=v), nonfinite))
    out.append(("LinearLogits", "softcap", lambda v: kltriton.LinearLogits(h, w, softcap=v), nonfinite + (0.0,)))
    out.append(("AdaptiveKLController", "target", lambda v: kltriton.controllers.AdaptiveKLController(0.1, v, 100),
                nonfinite + (0.0,)))
    out.append(("AdaptiveKLController", "horizon", lambda v: kltriton.controllers.AdaptiveKLController(0.1, 6.0, v),
                nonfinite + (0.0,)))
    out.append(("AdaptiveKLController", "init_kl_coef",
                lambda v: kltriton.controllers.AdaptiveKLController(v, 6.0, 100), nonfinite))
    out.append(("ConstantKLController", "kl_coef", lambda v: kltriton.controllers.ConstantKLController(v), nonfinite))
    return out


@pytest.mark.parametrize("op, option, call, bad", _float_options(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_float_option_is_checked_finite_and_in_range(op, option, call, bad):
    """A NaN passes every ``<`` / ``>`` range check: each option is refused by name for NaN, +-inf and an
    out-of-range value (the NaN loss it would give is never returned)."""
    for value in bad:
        with pytest.raises(ValueError, match=option):
            call(value)


def test_checked_options_are_kept_by_value_and_type():
    """``policy_loss`` keeps the checked options of each set of python values (a training loop passes the same every
    step): a value equal to a kept one but of another type (``False == 0.0``, ``True == 1``) is checked again and
    refused by name, and a loss type's own parameter is part of the key."""
    logits, labels, adv = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5)), torch.randn(2)
    for kept, again in ((dict(kl_coef=0.0), dict(kl_coef=False)), (dict(clip_low=1), dict(clip_low=True))):
        kltriton.policy_loss(logits, labels, adv, **kept)
        with pytest.raises(TypeError, match=next(iter(again))):
            kltriton.policy_loss(logits, labels, adv, **again)
    tau = [kltriton.policy_loss(logits, labels, adv, old_logprobs=-torch.rand(2, 5), loss_type="sapo",
                                tau_pos=value).loss for value in (1.0, 3.0)]
    assert not torch.equal(tau[0], tau[1])


def test_given_reference_logprobs_are_zero_where_not_scored(backend):
    """``ref_logprobs`` is 0 at unscored positions, like every per-token output, also when ``ref`` is given
    as log-probs (the given values are not passed through)."""
    logits, labels = _batch()
    given = -torch.rand(2, 5) - 0.5
    mask = torch.rand(2, 5) > 0.4
    out = kltriton.policy_loss(logits, labels, torch.randn(2, 5), ref=given, kl_coef=0.1, mask=mask, backend=backend)
    scored = mask & (labels != -100)
    assert torch.equal(out.ref_logprobs[~scored], torch.zeros(int((~scored).sum())))
    assert torch.equal(out.ref_logprobs[scored], given[scored])
    assert (out.kl[~scored] == 0).all()


# --- the first hour: command line, environment, process groups, the gradient cache ----------------

def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kltriton", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


def test_bare_command_prints_plain_usage():
    done = _cli()
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m kltriton {info,demo}") and "``" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only torch")
def test_demo_on_cuda_without_cuda_is_one_line():
    done = _cli("demo", "--device", "cuda")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("sees no CUDA device; use --device cpu (python -m kltriton "
                                                          "info shows what runs here)")


@pytest.mark.parametrize("name, value, message", [
    ("KLTRITON_LINEAR_TILE", "1e6", "KLTRITON_LINEAR_TILE='1e6' is not an integer"),
    ("KLTRITON_LINEAR_TILE", "0", "KLTRITON_LINEAR_TILE must be >= 1"),
    ("KLTRITON_BACKEND", "gpu", "KLTRITON_BACKEND must be one of"),
])
def test_unparsable_environment_variables_name_themselves(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    h, w = torch.randn(3, 4), torch.randn(7, 4)
    with pytest.raises(ValueError, match=message):
        kltriton.token_logprobs(kltriton.LinearLogits(h, w), torch.tensor([0, 1, 2]),
                                backend=None if name == "KLTRITON_BACKEND" else "cpp")


def test_an_unparsable_library_flag_names_itself_when_the_library_loads():
    """The C++ library's flags are read once, when it loads (its first call in a process): a typo is an error then."""
    code = "import torch, kltriton; kltriton.token_logprobs(torch.randn(3, 7), torch.tensor([0, 1, 2]), backend='cpp')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, KLTRITON_CPU_GRAD_CACHE="maybe"))
    assert done.returncode != 0 and "KLTRITON_CPU_GRAD_CACHE='maybe' is not a flag" in done.stderr


def test_process_group_before_init_in_a_distributed_launch(monkeypatch):
    """``dist.group.WORLD`` is None before ``init_process_group``: under torchrun (``WORLD_SIZE`` > 1) a None
    group is that mistake, not a single-process call."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    logits, labels = _batch()
    with pytest.raises(ValueError, match="before torch.distributed.init_process_group"):
        kltriton.token_logprobs(logits, labels, process_group=torch.distributed.group.WORLD)
    monkeypatch.setenv("WORLD_SIZE", "1")
    kltriton.token_logprobs(logits, labels)


def test_empty_cache_returns_the_cached_gradient_block():
    """``kltriton.empty_cache()`` gives the C++ backend's cached gradient block back (its size in bytes),
    then there is none; a gradient still in use is untouched."""
    if not kltriton.dispatch.availability("cpp")[0]:
        pytest.skip("C++ backend unavailable")
    kltriton.empty_cache()
    x = torch.randn(64, 100_000, requires_grad=True)
    labels = torch.randint(0, 100_000, (64,))
    kltriton.token_logprobs(x, labels, backend="cpp").sum().backward()
    kept = x.grad.clone()
    x.grad = None  # the 25.6 MB gradient goes back to the cache
    assert kltriton.empty_cache() >= 64 * 100_000 * 4
    assert kltriton.empty_cache() == 0
    y = x.detach().requires_grad_()
    kltriton.token_logprobs(y, labels, backend="cpp").sum().backward()
    kltriton.empty_cache()  # nothing cached: the live gradient's block stays with it
    other = torch.full((64, 100_000), 7.0)  # would reuse freed memory
    assert_close(y.grad, kept, 0.0, what="a live gradient is not released")
    assert other[0, 0] == 7.0
