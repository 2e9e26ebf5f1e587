"""Every loss type of ``policy_loss`` (verl 0.9.1's registry, TRL 1.16's ``loss_type`` x ``importance_sampling_level``)
and every loss option against float64 oracles restating the upstream code (``loss_oracles.py``): the loss, the
per-token outputs, the metrics and the logits gradient at upstream gradients 1 and 0.7, on every backend; the
token-level ones produce their gradient in the forward."""
import math
from pathlib import Path

import pytest
import torch

import kltriton
from helpers import assert_close
from kltriton.kernels.loss import terms
from kltriton.kernels.stream import cpp as stream_cpp
from loss_oracles import B, T, V, batch, oracle

# The parameters the oracle reads are the policy_loss keywords; "on_policy", "rollout_is_weights" (a flag),
# "off_policy_rollout" and "per_sequence" are the test's own switches.
CONFIGS = [
    dict(loss_type="vanilla", clip_low=0.2, clip_high=0.28, dual_clip=1.1, kl_coef=0.1, kl_estimator="k3",
         entropy_coef=0.01),
    dict(loss_type="ppo", clip_low=0.2, clip_high=0.28, delta=1.25, kl_coef=0.1, use_bias_correction_kl=True),
    dict(loss_type="grpo", clip_low=0.2, clip_high=0.28, kl_coef=0.04, use_bias_correction_kl=True),
    dict(loss_type="grpo", clip_low=0.2, importance_sampling_level="sequence", kl_coef=0.04,
         use_bias_correction_kl=True),
    dict(loss_type="bnpo", clip_low=0.2, delta=1.5, kl_coef=0.04, on_policy=True, use_bias_correction_kl=True),
    dict(loss_type="dapo", clip_low=0.2, clip_high=0.28, batch_num_tokens=40.0, is_mode="token_truncate",
         is_cap=1.3, is_min=0.8),
    dict(loss_type="dr_grpo", clip_low=0.2, kl_coef=0.04, rollout_is_weights=True),
    dict(loss_type="luspo", clip_low=0.2, importance_sampling_level="sequence", kl_coef=0.04),
    dict(loss_type="luspo", clip_low=0.2, global_batch_size=6.0),
    dict(loss_type="cispo", clip_low=1.0, clip_high=-0.72, kl_coef=0.04),  # TRL cispo, epsilon_high = 0.28
    dict(loss_type="cispo", clip_low=1.0, clip_high=4.0, importance_sampling_level="sequence"),
    dict(loss_type="sapo", kl_coef=0.04, tau_pos=1.2, tau_neg=1.4, use_bias_correction_kl=True),
    dict(loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_pos=1.0,
         sapo_temperature_neg=1.05),
    dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, kl_coef=0.1),
    dict(loss_type="gpg", kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01),
    dict(loss_type="dppo_tv", clip_low=0.05, clip_high=0.08, clip_ratio_c=1.2, kl_coef=0.1, kl_estimator="k1+"),
    dict(loss_type="dppo_kl", clip_low=0.02, clip_high=0.03, kl_coef=0.1, kl_estimator="full", kl_clamp=0.5),
    dict(loss_type="dro", dro_beta=0.3, kl_coef=0.1, kl_estimator="abs", rollout_is_weights=True),
    dict(loss_type="clip_cov", clip_low=0.2, clip_cov_ratio=0.2, clip_cov_lb=0.1, clip_cov_ub=5.0),
    dict(loss_type="kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=0.5, kl_coef=0.1),
    dict(loss_type="geo_mean", clip_low=0.2, clip_high=0.28, rollout_is_weights=True, per_sequence=True),
    dict(loss_type="vespo", kl_coef=0.04, use_bias_correction_kl=True, per_sequence=True),
    dict(loss_type="vespo", rollout_is_weights=True, vespo_k_pos=1.5, vespo_lambda_neg=2.5),
    dict(loss_type="clipped_ratio", clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01),
    dict(loss_type="bypass_mode", clip_low=0.2, dual_clip=3.0, kl_coef=0.1),
    dict(loss_type="bypass_mode", bypass_loss_type="reinforce", is_mode="sequence_truncate", is_cap=1.5),
    # the options on their own
    dict(loss_type="grpo", clip_low=0.2, token_mask_entropy_quantile=0.8, kl_coef=0.04),  # fused, two passes
    dict(loss_type="dapo", clip_low=0.2, token_mask_entropy_quantile=0.5, entropy_coef=0.05,
         entropy_aggregation="token-mean"),  # masked entropy bonus: two-pass
    dict(loss_type="sapo", token_mask_entropy_quantile=0.3, importance_sampling_level="sequence"),
    dict(loss_type="grpo", clip_low=0.2, off_policy_mask_threshold=0.05, off_policy_rollout=True,
         per_sequence=True),
    dict(loss_type="ppo", clip_low=0.2, kl_coef=0.1, kl_estimator="full", is_mode="token_mask", is_cap=1.5,
         is_min=0.7, entropy_coef=0.01, entropy_aggregation="seq-mean-token-mean"),
]


def _ids(cfg):
    return "-".join(f"{k}={v}" for k, v in cfg.items() if k != "clip_low")


def call(x, d, cfg, backend, **extra):
    """``kltriton.policy_loss`` with ``cfg``'s keywords (the test's own switches turned into tensors)."""
    own = ("on_policy", "rollout_is_weights", "off_policy_rollout", "per_sequence")
    kwargs = {k: v for k, v in cfg.items() if k not in own}
    if cfg.get("is_mode") or cfg.get("off_policy_rollout") or cfg.get("loss_type") == "bypass_mode":
        kwargs["rollout_logprobs"] = d.rollout
    if cfg.get("rollout_is_weights"):
        kwargs["rollout_is_weights"] = d.is_weights
    old = None if cfg.get("on_policy") or cfg.get("loss_type") == "bypass_mode" else d.old
    return kltriton.policy_loss(x, d.labels, d.adv, old_logprobs=old, ref=d.ref, mask=d.mask, backend=backend,
                                **kwargs, **extra)


def check(out, e_loss, e_out, e_metrics, what=""):
    assert out.loss.dim() == 0
    assert_close(out.loss, e_loss, 1e-5, 1e-5, what=f"{what} loss")
    for name, expected in e_out.items():
        assert_close(getattr(out, name), expected, 1e-5, 1e-5, what=f"{what} {name}")
    assert set(out.metrics) == set(e_metrics), set(out.metrics) ^ set(e_metrics)
    for name, expected in e_metrics.items():
        assert out.metrics[name].dim() == 0
        assert_close(out.metrics[name], expected, 1e-5, 1e-5, what=f"{what} {name}")


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_matches_oracle(backend, cfg):
    d = batch(per_sequence_advantages=cfg.get("per_sequence", False))
    x64 = d.logits.double().requires_grad_()
    torch.manual_seed(5)  # clip_cov draws with torch.randperm, as verl: the oracle and the op draw alike
    e_loss, e_out, e_metrics = oracle(x64, d, cfg)
    e_grad, = torch.autograd.grad(e_loss, x64)
    assert e_grad.abs().max() > 0
    for upstream in (1.0, 0.7):
        x = d.logits.clone().requires_grad_()
        torch.manual_seed(5)
        out = call(x, d, cfg, backend)
        (out.loss * upstream if upstream != 1.0 else out.loss).backward()
        check(out, e_loss, e_out, e_metrics, what=backend)
        assert_close(x.grad, upstream * e_grad, 2e-6, 1e-4, what=f"grad (upstream {upstream})")


def _first(**match):
    return next(cfg for cfg in CONFIGS if all(cfg.get(k) == v for k, v in match.items()))


def test_the_oracle_cases_are_not_trivial():
    """The configurations exercise what they name: clips, trust regions, masks and selections are hit."""
    d = batch()
    x = d.logits.double()
    for cfg, metric in ((_first(loss_type="vanilla"), "clipfrac"), (_first(loss_type="vanilla"), "clipfrac_lower"),
                        (_first(loss_type="dppo_tv"), "clipfrac"), (_first(loss_type="dppo_kl"), "clipfrac"),
                        (_first(loss_type="clip_cov"), "clipfrac"), (_first(loss_type="clipped_ratio"), "clipfrac"),
                        (_first(loss_type="dapo", is_mode="token_truncate"), "is_masked_frac")):
        torch.manual_seed(5)
        value = oracle(x, d, cfg)[2][metric]
        assert 0 < value < 1, (cfg["loss_type"], metric, value)
    kept = oracle(x, d, _first(token_mask_entropy_quantile=0.8))[2]["entropy_threshold"]
    assert 0 < kept


FUSED_NAMES = [name for name, spec in terms.LOSS_TYPES.items() if spec.formula in terms.FUSED]


@pytest.mark.parametrize("name", FUSED_NAMES + ["bypass_mode"])
def test_token_level_losses_produce_the_gradient_in_the_forward(name, monkeypatch):
    """A token-level loss (with TRL's bias-corrected KL and the entropy mask too) never runs a stream backward: its
    logits gradient is written in the forward (the C++ loss kernel), and equals the oracle's."""
    if not kltriton.dispatch.availability("cpp", "loss")[0]:
        pytest.skip("needs the C++ backend")
    calls = []
    original = stream_cpp.backward
    monkeypatch.setattr(stream_cpp, "backward", lambda *a: calls.append(1) or original(*a))
    d = batch()
    params = {"dro": dict(dro_beta=0.2), "sapo": dict(tau_pos=1.1), "dppo_tv": dict(clip_ratio_c=1.2),
              "ppo": dict(delta=1.3)}.get(terms.LOSS_TYPES[name].formula, {})
    for extra in (dict(kl_coef=0.05, use_bias_correction_kl=True), dict(token_mask_entropy_quantile=0.7)):
        cfg = dict(loss_type=name, clip_low=0.2, **params, **extra)
        x64 = d.logits.double().requires_grad_()
        e_loss, _, _ = oracle(x64, d, cfg)
        e_grad, = torch.autograd.grad(e_loss, x64)
        x = d.logits.clone().requires_grad_()
        out = call(x, d, cfg, "cpp")
        out.loss.backward()
        assert calls == [], (name, extra)
        assert_close(x.grad, e_grad, 2e-6, 1e-4, what=f"{name} {extra} grad")


def test_entropy_mask_reads_only_the_kept_rows_twice(monkeypatch):
    """The fused entropy mask's last pass adds the policy term's gradient on the kept rows only (those whose
    policy term has a nonzero derivative: a clipped token is not read again)."""
    from kltriton.kernels.loss import reference as loss_reference
    from kltriton.kernels.stream import reference as stream_reference

    rows = []
    original = stream_reference.backward
    monkeypatch.setattr(stream_reference, "backward", lambda logits, *a: rows.append(logits.numel() // V) or
                        original(logits, *a))
    monkeypatch.setattr(loss_reference, "stream", stream_reference)
    d = batch()
    cfg = dict(loss_type="grpo", token_mask_entropy_quantile=0.75)
    x = d.logits.clone().requires_grad_()
    out = call(x, d, cfg, "reference")
    kept = int((out.entropy >= out.metrics["entropy_threshold"]).logical_and(d.mask).sum())
    assert 0 < kept < int(d.mask.sum())
    assert len(rows) == 2 and rows[0] == B * T and 0 < rows[1] <= kept, rows


def test_loss_parameters_are_checked():
    d = batch()
    with pytest.raises(TypeError, match="unexpected keyword argument 'tau_pos'.*loss_type='ppo' takes delta"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, tau_pos=1.0)
    with pytest.raises(ValueError, match="dro_beta"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, loss_type="dro")
    with pytest.raises(ValueError, match="tau_neg must be > 0"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, loss_type="sapo", tau_neg=-1.0)
    with pytest.raises(TypeError, match="twice"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, loss_type="sapo", tau_pos=1.0, sapo_temperature_pos=1.0)
    with pytest.raises(ValueError, match="bypass_loss_type"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, loss_type="bypass_mode", rollout_logprobs=d.rollout,
                             bypass_loss_type="a2c")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, loss_type="gpg", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="token_mask_entropy_quantile"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, token_mask_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="compute_entropy"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, compute_entropy=False, entropy_coef=0.1)


def test_compute_entropy_false_skips_the_entropy(backend):
    d = batch()
    x = d.logits.clone().requires_grad_()
    out = call(x, d, dict(loss_type="grpo", kl_coef=0.1), backend, compute_entropy=False)
    out.loss.backward()
    full = call(d.logits.clone().requires_grad_(), d, dict(loss_type="grpo", kl_coef=0.1), backend)
    assert_close(out.loss, full.loss.detach(), 1e-6, 1e-6, what="loss")
    assert out.entropy.abs().max() == 0 and out.metrics["entropy_mean"] == 0


def test_every_registered_name_is_accepted():
    """Each verl 0.9.1 registry name and each TRL 1.16 loss type is a loss_type (the installed libraries' own
    lists, where installed)."""
    names = set(terms.LOSS_TYPES)
    try:
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    except ImportError:
        pass
    else:
        assert set(POLICY_LOSS_REGISTRY) <= names, set(POLICY_LOSS_REGISTRY) - names
    assert {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"} <= names
    d = batch()
    for name in names:
        params = {"dro": dict(dro_beta=0.1)}.get(name, {})
        kw = dict(rollout_logprobs=d.rollout) if name == "bypass_mode" else dict(old_logprobs=d.old)
        out = kltriton.policy_loss(d.logits, d.labels, d.adv, mask=d.mask, loss_type=name, **kw, **params)
        assert torch.isfinite(out.loss), name


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "cispo"])
def test_linear_logits_entropy_mask_equals_dense(loss_type):
    """From hidden states the fused entropy mask (a second GEMM pass over the kept rows) gives the loss and the
    gradients of the dense logits."""
    gen = torch.Generator().manual_seed(3)
    n, h, v = 29, 16, 67
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=gen)
    adv, old = torch.randn(n, generator=gen, dtype=torch.float64), -torch.rand(n, generator=gen, dtype=torch.float64) * 5
    kw = dict(loss_type=loss_type, old_logprobs=old, token_mask_entropy_quantile=0.6, backend="reference")
    xs = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    got = kltriton.policy_loss(kltriton.LinearLogits(*xs), labels, adv, **kw)
    got.loss.backward()
    ys = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    want = kltriton.policy_loss(ys[0] @ ys[1].T, labels, adv, **kw)
    want.loss.backward()
    torch.testing.assert_close(got.loss, want.loss)
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad)


def test_frozen_lm_head_gets_no_weight_gradient(monkeypatch):
    """A ``LinearLogits`` policy whose weight does not require grad computes no weight gradient, on the fused and
    the two-pass route: the hidden states' gradient is the same, and no GEMM into a weight gradient runs."""
    from kltriton.kernels.linear import tiles

    products = []  # the shapes of the GEMMs' results: (v, h) is a weight gradient's
    add_mm, mm = tiles._add_mm, tiles._mm  # the tiled route's accumulating GEMM, the one-tile route's
    monkeypatch.setattr(tiles, "_add_mm", lambda out, a, b: products.append(tuple(out.shape)) or add_mm(out, a, b))
    monkeypatch.setattr(tiles, "_mm", lambda a, b, acc, out=None: products.append((a.shape[0], b.shape[1]))
                        or mm(a, b, acc, out))
    gen = torch.Generator().manual_seed(4)
    n, h, v = 23, 16, 61
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    adv, old = torch.randn(n, generator=gen), -torch.rand(n, generator=gen) * 5
    for loss_type in ("grpo", "gspo"):  # fused, two-pass
        grads = []
        for trainable in (True, False):
            products.clear()
            x = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_(trainable)
            out = kltriton.policy_loss(kltriton.LinearLogits(x, w), labels, adv, old_logprobs=old, loss_type=loss_type,
                                       backend="reference")
            out.loss.backward()
            grads.append(x.grad)
            assert (w.grad is not None) == trainable
            assert ((v, h) in products) == trainable, (loss_type, trainable, products)
        torch.testing.assert_close(grads[0], grads[1])


def test_sequence_level_equals_verl_gspo_gradient():
    """TRL's sequence-level GRPO and verl's GSPO (its stop-gradient token ratio) have the same gradient with one
    advantage per sequence (with per-token advantages TRL's sequence ratio couples the tokens, GSPO's does not)."""
    d = batch(per_sequence_advantages=True)
    grads = []
    for cfg in (dict(loss_type="grpo", importance_sampling_level="sequence", global_batch_size=float(B - 1)),
                dict(loss_type="gspo", aggregation="seq-mean-token-mean")):
        x = d.logits.clone().requires_grad_()
        out = call(x, d, dict(cfg, clip_low=0.2), None)
        out.loss.backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_per_sequence_weights_shapes():
    """``rollout_is_weights`` and advantages of TRL's ``[B, 1]`` shape broadcast over the sequence."""
    d = batch()
    w = torch.rand(B, 1) + 0.5
    a = kltriton.policy_loss(d.logits, d.labels, d.adv, old_logprobs=d.old, mask=d.mask, rollout_is_weights=w)
    b = kltriton.policy_loss(d.logits, d.labels, d.adv, old_logprobs=d.old, mask=d.mask,
                             rollout_is_weights=w.expand(B, T).contiguous())
    c = kltriton.policy_loss(d.logits, d.labels, d.adv, old_logprobs=d.old, mask=d.mask, rollout_is_weights=w[:, 0])
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.loss, c.loss)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        kltriton.policy_loss(d.logits, d.labels, d.adv, rollout_is_weights=torch.rand(T))


def _extreme_batch():
    """``batch()`` with log-ratios of +22 under a negative advantage and -22 under a positive one (beyond verl's
    clamp of 20; TRL and torchrl do not clamp), in the old and the rollout log-probs."""
    d = batch()
    logp = torch.log_softmax(d.logits.double(), -1).gather(-1, d.labels[..., None]).squeeze(-1)
    for (row, col), log_ratio, sign in (((0, 4), 22.0, -1.0), ((3, 6), -22.0, 1.0)):
        assert d.mask[row, col]
        for old in (d.old, d.rollout):
            old[row, col] = float(logp[row, col] - log_ratio)
        d.adv[row, col] = sign * (0.5 + d.adv[row, col].abs())
    return d


@pytest.mark.parametrize("extreme", [False, True], ids=["ordinary", "log-ratio-22"])
@pytest.mark.parametrize("name", [name for name in terms.LOSS_TYPES if name != "dro"])
def test_a_name_alone_takes_its_trainers_defaults(backend, name, extreme):
    """``policy_loss(loss_type=name)`` and nothing else equals the oracle under the trainer's defaults (verl's
    ActorConfig: dual clip 3.0, DPPO's truncation 3.0, the log-ratio clamped at 20; TRL's GRPOConfig: no dual clip,
    no clamp, dr_grpo's horizon 512; ``loss_oracles``), at ordinary log-ratios and at +-22."""
    d = _extreme_batch() if extreme else batch()
    cfg = {"loss_type": name}
    x64 = d.logits.double().requires_grad_()
    torch.manual_seed(5)
    e_loss, e_out, e_metrics = oracle(x64, d, cfg)
    e_grad, = torch.autograd.grad(e_loss, x64)
    x = d.logits.clone().requires_grad_()
    torch.manual_seed(5)
    out = call(x, d, cfg, backend)
    out.loss.backward()
    check(out, e_loss, e_out, e_metrics, what=f"{backend} {name}")
    assert_close(x.grad, e_grad, 2e-6, 1e-4, what=f"{backend} {name} grad")


def test_dro_alone_needs_its_beta_as_verl():
    """verl's PolicyLossConfig.dro_beta is None: DRO with verl's defaults is an error there, and here."""
    d = batch()
    with pytest.raises(ValueError, match="dro_beta"):
        call(d.logits, d, {"loss_type": "dro"}, None)


def test_the_defaults_differ_where_the_trainers_do():
    """The defaults the table changes are live: verl's dual clip and clamp hold at +22 under a negative advantage,
    TRL's names see the unclamped ratio, and an explicit keyword wins."""
    d = _extreme_batch()
    loss = {cfg: call(d.logits, d, dict(cfg), "reference").loss for cfg in (
        (("loss_type", "vanilla"),), (("loss_type", "ppo"),), (("loss_type", "bnpo"),),
        (("loss_type", "vanilla"), ("dual_clip", math.inf)), (("loss_type", "ppo"), ("dual_clip", 3.0)),
        (("loss_type", "bnpo"), ("log_ratio_clamp", 20.0)), (("loss_type", "vanilla"), ("dual_clip", math.inf),
                                                             ("log_ratio_clamp", math.inf)))}
    vanilla, ppo, bnpo, vanilla_no_dual, ppo_dual, bnpo_clamped, vanilla_free = loss.values()
    assert vanilla < 100 < ppo < bnpo  # 3 |A| vs exp(20) |A| vs exp(22) |A|, spread over the tokens
    torch.testing.assert_close(vanilla_no_dual, ppo)
    torch.testing.assert_close(ppo_dual, vanilla)
    torch.testing.assert_close(bnpo_clamped, ppo)
    torch.testing.assert_close(vanilla_free, bnpo)


def test_default_keywords_are_checked():
    d = batch()
    with pytest.raises(ValueError, match="dual_clip applies to the loss types .*'vanilla'.*not loss_type='gspo'"):
        call(d.logits, d, dict(loss_type="gspo", dual_clip=3.0), None)
    with pytest.raises(ValueError, match="log_ratio_clamp applies to .*not loss_type='geo_mean'"):
        call(d.logits, d, dict(loss_type="geo_mean", log_ratio_clamp=20.0), None)
    for value, error in ((0.5, "dual_clip must be > 1.0"), (math.nan, "dual_clip must be finite"),
                         (-math.inf, "dual_clip must be finite"), ("3", "dual_clip must be a python float")):
        with pytest.raises((ValueError, TypeError), match=error):
            call(d.logits, d, dict(loss_type="vanilla", dual_clip=value), None)
    with pytest.raises(ValueError, match="log_ratio_clamp must be > 0.0"):
        call(d.logits, d, dict(loss_type="grpo", log_ratio_clamp=0.0), None)


def _docs_defaults():
    """``(loss_type, keyword) -> (default, source)`` from the defaults table of ``docs/api/losses.md``."""
    text = (Path(__file__).parents[2] / "docs" / "api" / "losses.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`") and cells[2].startswith("`") and cells[0] != "`loss_type`":
            for name in cells[0].split(", "):
                rows[(name.strip("`"), cells[1].strip("`"))] = (cells[2].strip("`"), cells[3])
    return rows


def test_docs_table_lists_every_default_with_its_source():
    def shown(value):
        return "inf" if value == math.inf else str(value)

    table = {(name, key): (shown(entry.value), entry.source) for name, row in terms.DEFAULTS.items()
             for key, entry in row.items()}
    assert _docs_defaults() == table
