"""policy_loss: values, metrics and logits gradients against float64 oracles that restate verl 0.9 /
TRL 1.16, the unit-upstream backward that moves no [N, V] bytes, opcheck and fullgraph compile."""
import time
from types import SimpleNamespace

import pytest
import torch

import kltriton
from helpers import MIXED_GRAD_RTOL, assert_close, random_logits
from kltriton.kernels.loss import terms
from kltriton.kernels.linear import Side
from kltriton.kernels.loss import LossInputs
from kltriton.ops._define import NeedsGrad
from kltriton.ops.loss import loss, loss_scale_

B, T, V = 3, 7, 67


def batch(dtype=torch.float32, seed=0, spread=0.3):
    """Padded [B, T] batch: a fully masked row 1, a prompt-like prefix in row 0, old / rollout
    log-probs near the policy's (ratios around 1 on both sides of the clip range)."""
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits((B, T, V), dtype, generator=gen)
    ref = (logits.float() + 0.5 * torch.randn(logits.shape, generator=gen)).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = False
    mask[1] = False
    mask[2, 5:] = False
    logp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    old = (logp + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    rollout = (old.double() + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    adv = torch.randn(B, T, generator=gen)
    return SimpleNamespace(logits=logits, ref=ref, labels=labels, mask=mask, old=old, rollout=rollout, adv=adv)


# --- the float64 oracle: verl 0.9 core_algos / TRL 1.16 GRPOTrainer written out on [B, T] -----------

def oracle(x, d, cfg):
    """``(loss, outputs, metrics)`` from float64 logits ``x`` with autograd, written from the verl / TRL source."""
    m = d.mask.double()
    lsm = torch.log_softmax(x, -1)
    logp = lsm.gather(-1, d.labels[..., None]).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    rlp = torch.log_softmax(d.ref.double(), -1).gather(-1, d.labels[..., None]).squeeze(-1)
    A = d.adv.double() if d.adv.dim() == 2 else d.adv.double()[:, None].expand(B, T)
    old = logp.detach() if cfg.get("on_policy") else d.old.double()
    low, high = 1 - cfg["clip_low"], 1 + cfg.get("clip_high", cfg["clip_low"])
    neg_kl = old - logp  # verl: negative_approx_kl = log_prob - old_log_prob; ppo_kl = mean(-it)
    if cfg["loss_type"] == "gspo":
        seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
        ratio = torch.exp(torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=10.0))
        pg1, pg2 = -A * ratio, -A * torch.clamp(ratio, low, high)
        pg, clipped, lower = torch.maximum(pg1, pg2), pg2 > pg1, torch.zeros_like(m, dtype=torch.bool)
    else:
        lr = torch.clamp(logp - old, -20, 20)
        neg_kl = -lr
        ratio = torch.exp(lr)
        if cfg["loss_type"] == "cispo":
            cr = torch.clamp(ratio, low, high)
            pg, clipped, lower = -cr.detach() * A * logp, ratio != cr, torch.zeros_like(m, dtype=torch.bool)
        else:
            pg1, pg2 = -A * ratio, -A * torch.clamp(ratio, low, high)
            c1 = torch.maximum(pg1, pg2)
            c = cfg.get("dual_clip") or float("inf")
            pg3 = -A * c
            pg = torch.where(A < 0, torch.minimum(pg3, c1), c1)
            clipped, lower = pg2 > pg1, (c1 > pg3) & (A < 0)
    # TRL vLLM importance sampling correction
    is_w = torch.ones_like(m)
    metrics_is = {}
    if cfg.get("is_mode"):
        diff = (old.detach() - d.rollout.double()) * m
        lw = diff.sum(-1, keepdim=True).expand(B, T) if cfg["is_mode"].startswith("sequence") else diff
        w = torch.exp(lw)
        cap = cfg.get("is_cap", 2.0)
        is_w = torch.clamp(w, max=cap) if cfg["is_mode"].endswith("truncate") else w.masked_fill(w > cap, 0.0)
        count = m.sum()
        metrics_is = {"is_weight_mean": (is_w * m).sum() / count, "is_masked_frac": ((w > cap) * m).sum() / count,
                      "mismatch_k3": ((torch.exp(diff) - 1 - diff) * m).sum() / count}
    # verl kl_penalty_forward (without its internal +-20 / +-10 clamps; kl_clamp is explicit here)
    est = cfg.get("kl_estimator", "k3")
    base = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}.get(est.rstrip("+"), est.rstrip("+"))
    dk = logp - rlp
    if base == "full":
        kl = (lsm.exp() * (lsm - torch.log_softmax(d.ref.double(), -1))).sum(-1)
    else:
        kl = {"k1": dk, "abs": dk.abs(), "k2": 0.5 * dk ** 2, "k3": torch.exp(-dk) + dk - 1}[base]
    if cfg.get("kl_clamp"):
        kl = kl.clamp(-cfg["kl_clamp"], cfg["kl_clamp"])
    if est.endswith("+"):
        k2 = 0.5 * dk ** 2
        kl = k2 - k2.detach() + kl.detach()

    def agg(mat):  # verl agg_loss, dp_size 1 (denominators clamped at 1 where verl divides by 0)
        mode = cfg.get("aggregation", "token-mean")
        if mode == "token-mean":  # verl's global_batch_info: a given token count replaces the local one
            return (mat * m).sum() / cfg.get("batch_num_tokens", m.sum().clamp(min=1))
        if mode == "token-sum":
            return (mat * m).sum()
        nonempty = (m.sum(-1) > 0).double()
        if mode == "seq-mean-token-mean":
            seq = (mat * m).sum(-1) / m.sum(-1).clamp(min=1)
        else:
            seq = (mat * m).sum(-1)
        loss = (seq * nonempty).sum() / nonempty.sum().clamp(min=1)
        return loss / cfg.get("horizon", T) if mode == "seq-mean-token-sum-norm" else loss

    zero = torch.zeros_like(m)
    pgm = torch.where(d.mask, pg * is_w, zero)
    klm = torch.where(d.mask, kl, zero)
    loss = agg(pgm) + cfg.get("kl_coef", 0.0) * agg(klm) - cfg.get("entropy_coef", 0.0) * agg(entropy)
    mean = lambda t: (t.double() * m).sum() / m.sum().clamp(min=1)  # noqa: E731
    metrics = {"clipfrac": mean(clipped), "clipfrac_lower": mean(lower), "ppo_kl": mean(neg_kl),
               "kl_mean": mean(kl), "entropy_mean": mean(entropy), "pg_loss": agg(pgm), "kl_loss": agg(klm),
               "entropy_loss": agg(entropy),
               "ratio_max": ratio[d.mask].max(), "ratio_min": ratio[d.mask].min(), **metrics_is}
    outputs = {"logprobs": logp * m, "ref_logprobs": rlp * m, "kl": kl * m, "entropy": entropy * m, "ratio": ratio * m}
    return loss, outputs, metrics


def call(x, d, cfg, backend, **extra):
    kwargs = {k: v for k, v in cfg.items() if k not in ("on_policy",)}
    if cfg.get("is_mode"):
        kwargs["rollout_logprobs"] = d.rollout
    return kltriton.policy_loss(x, d.labels, d.adv, old_logprobs=None if cfg.get("on_policy") else d.old,
                                ref=d.ref, mask=d.mask, backend=backend, **kwargs, **extra)


CONFIGS = [
    dict(loss_type="ppo", clip_low=0.2, kl_coef=0.1, kl_estimator="k3"),  # GRPO (bnpo)
    dict(loss_type="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation="seq-mean-token-mean",
         kl_coef=0.05, kl_estimator="k1", entropy_coef=0.01),
    dict(loss_type="ppo", clip_low=0.1, aggregation="seq-mean-token-sum-norm", horizon=11, kl_coef=0.2,
         kl_estimator="abs", is_mode="token_truncate"),
    dict(loss_type="ppo", clip_low=0.2, aggregation="token-sum", kl_coef=0.3, kl_estimator="k2", kl_clamp=0.05,
         is_mode="token_mask", is_cap=1.3),
    dict(loss_type="ppo", clip_low=0.2, aggregation="seq-mean-token-sum", kl_coef=0.1, kl_estimator="full",
         entropy_coef=0.02, is_mode="sequence_truncate", is_cap=1.5),
    dict(loss_type="ppo", clip_low=0.2, dual_clip=2.0, kl_coef=0.1, kl_estimator="k3+", is_mode="sequence_mask"),
    dict(loss_type="ppo", clip_low=0.2, on_policy=True, kl_coef=0.1, kl_estimator="low_var_kl", entropy_coef=0.05),
    dict(loss_type="cispo", clip_low=0.2, clip_high=0.5, kl_coef=0.1, kl_estimator="k1+", is_mode="token_truncate"),
    dict(loss_type="cispo", clip_low=0.3, aggregation="seq-mean-token-mean", on_policy=True),
    dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean", kl_coef=0.1),
    dict(loss_type="gspo", clip_low=0.2, kl_coef=0.1, kl_estimator="full", is_mode="token_truncate",
         entropy_coef=0.01),
    dict(loss_type="ppo", clip_low=0.2, on_policy=True, is_mode="sequence_truncate", is_cap=1.2),
    # the one-op route (no rollout IS): the given denominators reach the layout kernel's row weights
    dict(loss_type="ppo", clip_low=0.2, aggregation="seq-mean-token-sum-norm", horizon=5, kl_coef=0.1),
    dict(loss_type="ppo", clip_low=0.2, batch_num_tokens=23.0, kl_coef=0.1, entropy_coef=0.01),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_matches_oracle(backend, device, cfg):
    d = batch()
    to = lambda t: t.to(device)  # noqa: E731
    dd = SimpleNamespace(**{k: to(v) for k, v in vars(d).items()})
    x64 = d.logits.double().requires_grad_()
    e_loss, e_out, e_metrics = oracle(x64, d, cfg)
    e_grad, = torch.autograd.grad(e_loss, x64)
    for upstream in (1.0, 0.7):
        x = to(d.logits).clone().requires_grad_()
        out = call(x, dd, cfg, backend)
        (out.loss * upstream if upstream != 1.0 else out.loss).backward()
        assert out.loss.dim() == 0
        assert_close(out.loss, e_loss, 1e-5, 1e-5, what="loss")
        for name, expected in e_out.items():
            assert_close(getattr(out, name), expected, 1e-5, 1e-5, what=name)
        assert set(out.metrics) == set(e_metrics)
        for name, expected in e_metrics.items():
            assert out.metrics[name].dim() == 0
            assert_close(out.metrics[name], expected, 1e-5, 1e-5, what=name)
        assert_close(x.grad, upstream * e_grad, 2e-6, 1e-4, what=f"grad (upstream {upstream})")


def test_dtypes_against_float64(backend, dtype, device):
    """Half-precision logits: fp32 statistics, the gradient rounded once to the logits dtype."""
    d = batch(dtype)
    cfg = dict(loss_type="ppo", clip_low=0.2, dual_clip=3.0, kl_coef=0.1, kl_estimator="full", entropy_coef=0.01)
    x64 = d.logits.double().requires_grad_()
    e_loss, _, _ = oracle(x64, d, cfg)
    e_grad, = torch.autograd.grad(e_loss, x64)
    x = d.logits.to(device).clone().requires_grad_()
    dd = SimpleNamespace(**{k: v.to(device) for k, v in vars(d).items()})
    out = call(x, dd, cfg, backend)
    out.loss.backward()
    assert x.grad.dtype == dtype
    assert_close(out.loss, e_loss, 1e-5, 1e-5, what="loss")
    # The gradient has the entropy and full-KL terms: the policy's tolerance for mixed gradients.
    assert_close(x.grad, e_grad, 1e-6 if dtype == torch.float32 else 1e-4, MIXED_GRAD_RTOL[dtype], what="grad")


def test_clip_boundaries_and_dual_clip(backend, device):
    """Ratios just inside and just outside [1 - eps, 1 + eps] from both sides, positive and negative
    advantages, and a ratio above the dual clip with a negative advantage (zero gradient there)."""
    d = batch()
    logp = torch.log_softmax(d.logits.double(), -1).gather(-1, d.labels[..., None]).squeeze(-1)
    ratios = torch.tensor([0.7, 0.79, 0.81, 1.0, 1.19, 1.21, 1.5, 4.0, 2.5, 0.5, 1.1, 1.25, 0.9, 3.5])
    signs = torch.tensor([1, -1, 1, -1, 1, -1, 1, -1, -1, -1, 1, 1, -1, 1], dtype=torch.float32)
    idx = torch.tensor([[2, t] for t in range(5)] + [[0, t] for t in range(2, 7)] + [[2, 5], [2, 6], [0, 0], [0, 1]])
    mask = d.mask.clone()
    mask[2, 5:] = True
    mask[0, :2] = True
    old = d.old.clone()
    adv = d.adv.abs() + 0.5
    for (b, t), r, s in zip(idx.tolist(), ratios, signs):
        old[b, t] = float(logp[b, t] - torch.log(r.double()))
        adv[b, t] *= s
    d = SimpleNamespace(**dict(vars(d), old=old, adv=adv, mask=mask))
    cfg = dict(loss_type="ppo", clip_low=0.2, dual_clip=3.0)
    x64 = d.logits.double().requires_grad_()
    e_loss, _, e_metrics = oracle(x64, d, cfg)
    e_grad, = torch.autograd.grad(e_loss, x64)
    x = d.logits.to(device).clone().requires_grad_()
    dd = SimpleNamespace(**{k: v.to(device) for k, v in vars(d).items()})
    out = call(x, dd, cfg, backend)
    out.loss.backward()
    assert_close(out.loss, e_loss, 1e-5, 1e-5, what="loss")
    assert_close(x.grad, e_grad, 2e-6, 1e-4, what="grad")
    assert 0 < e_metrics["clipfrac"] < 1 and e_metrics["clipfrac_lower"] > 0
    assert_close(out.metrics["clipfrac_lower"], e_metrics["clipfrac_lower"], 1e-6, what="clipfrac_lower")
    assert x.grad.cpu()[0, 1].abs().max() == 0  # ratio 4 > dual clip 3, advantage < 0: held constant


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_equals_padded_and_per_sequence_advantages(aggregation):
    d = batch()
    lengths = [T, 4, 6]
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    adv_seq = torch.randn(B)
    padded = kltriton.policy_loss(d.logits, d.labels, adv_seq, old_logprobs=d.old, ref=d.ref, mask=mask, kl_coef=0.1,
                                  aggregation=aggregation, rollout_logprobs=d.rollout, is_mode="sequence_truncate")
    per_token = kltriton.policy_loss(d.logits, d.labels, adv_seq[:, None].expand(B, T), old_logprobs=d.old, ref=d.ref,
                                     mask=mask, kl_coef=0.1, aggregation=aggregation, rollout_logprobs=d.rollout,
                                     is_mode="sequence_truncate")
    torch.testing.assert_close(padded.loss, per_token.loss)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist())
    pack = lambda t: torch.cat([t[b, :n] for b, n in enumerate(lengths)])  # noqa: E731
    packed = kltriton.policy_loss(pack(d.logits), pack(d.labels), adv_seq, old_logprobs=pack(d.old), ref=pack(d.ref),
                                  cu_seqlens=cu, kl_coef=0.1, aggregation=aggregation, horizon=T,
                                  rollout_logprobs=pack(d.rollout), is_mode="sequence_truncate")
    torch.testing.assert_close(packed.loss, padded.loss)
    for name in ("clipfrac", "ppo_kl", "kl_mean", "is_weight_mean", "ratio_max"):
        torch.testing.assert_close(packed.metrics[name], padded.metrics[name])
    torch.testing.assert_close(packed.logprobs, pack(padded.logprobs))


def test_all_masked_gives_zero_loss_and_gradient(backend):
    d = batch()
    x = d.logits.clone().requires_grad_()
    out = kltriton.policy_loss(x, d.labels, d.adv, old_logprobs=d.old, mask=torch.zeros(B, T, dtype=torch.bool),
                               aggregation="seq-mean-token-mean", backend=backend)
    out.loss.backward()
    assert out.loss.item() == 0 and x.grad.abs().max().item() == 0
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("loss_type", ["ppo", "cispo"])
def test_parity_with_verl(loss_type):
    """verl's own compute_policy_loss_vanilla / _cispo + agg_loss on float64 log-probs."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config import ActorConfig

    d = batch()
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                         ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    fn = core_algos.compute_policy_loss_vanilla if loss_type == "ppo" else core_algos.compute_policy_loss_cispo
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        x64 = d.logits.double().requires_grad_()
        logp = torch.log_softmax(x64, -1).gather(-1, d.labels[..., None]).squeeze(-1)
        keep = d.mask.clone()
        keep[1, 0] = True  # verl divides by zero for a batch with an empty sequence in some modes
        loss, metrics = fn(d.old.double(), logp, d.adv.double(), keep.double(), loss_agg_mode=mode, config=config)
        e_grad, = torch.autograd.grad(loss, x64)
        x = d.logits.clone().requires_grad_()
        out = kltriton.policy_loss(x, d.labels, d.adv, old_logprobs=d.old, mask=keep, loss_type=loss_type,
                                   clip_low=0.2, clip_high=0.28, dual_clip=3.0 if loss_type == "ppo" else None,
                                   aggregation=mode)
        out.loss.backward()
        assert_close(out.loss, loss.detach(), 1e-5, 1e-5, what=f"{mode} loss")
        assert_close(x.grad, e_grad, 2e-6, 1e-4, what=f"{mode} grad")
        assert abs(out.metrics["clipfrac"].item() - metrics["actor/pg_clipfrac"]) < 1e-6
        assert abs(out.metrics["ppo_kl"].item() - metrics["actor/ppo_kl"]) < 1e-5
        assert abs(out.metrics["clipfrac_lower"].item() - metrics["actor/pg_clipfrac_lower"]) < 1e-6


def test_unit_upstream_backward_moves_no_logits_bytes():
    """The backward of ``loss.backward()`` hands the gradient written in the forward to autograd: no
    [N, V] op runs (profiler), the buffer is the one the forward wrote, and it takes a small fraction
    of the forward's time. An upstream gradient of 0.5 scales it in one pass."""
    if not kltriton.dispatch.availability("cpp", "loss")[0]:
        pytest.skip("needs the C++ backend")
    n, vocab = 512, 32000
    logits = torch.randn(n, vocab)
    labels, adv, old = torch.randint(0, vocab, (n,)), torch.randn(n), torch.randn(n) - 10
    x = logits.clone().requires_grad_()
    out = kltriton.policy_loss(x, labels, adv, old_logprobs=old, backend="cpp")
    with torch.profiler.profile(record_shapes=True) as prof:
        out.loss.backward()
    metadata = ("aten::view", "aten::detach", "aten::alias", "aten::as_strided", "aten::reshape")
    big = [e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in metadata
           and any(len(s) and torch.Size(s).numel() >= n * vocab for s in e.input_shapes)]
    assert not big, f"[N, V] work in the backward: {big}"
    times = []  # without the profiler: the backward is autograd's bookkeeping, not an [N, V] pass
    for _ in range(5):
        x = logits.clone().requires_grad_()
        start = time.perf_counter()
        out = kltriton.policy_loss(x, labels, adv, old_logprobs=old, backend="cpp")
        mid = time.perf_counter()
        out.loss.backward()
        times.append((mid - start, time.perf_counter() - mid))
    assert min(b for _, b in times) < 0.1 * min(f for f, _ in times), times
    x = logits.clone().requires_grad_()
    out = kltriton.policy_loss(x, labels, adv, old_logprobs=old, backend="cpp")
    unit, = torch.autograd.grad(out.loss, x, retain_graph=False)
    x = logits.clone().requires_grad_()
    out = kltriton.policy_loss(x, labels, adv, old_logprobs=old, backend="cpp")
    (out.loss * 0.5).backward()
    torch.testing.assert_close(x.grad, 0.5 * unit)


def test_triton_runs_the_fused_kernel(monkeypatch):
    """With a gradient the Triton backend launches its fused kernel once (never the composed stream
    kernels); without one it runs the stream forward alone."""
    from kltriton.kernels.loss import composed
    from kltriton.kernels.loss import triton as tl_loss

    launches, composed_calls = [], []

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    kernel = tl_loss._loss_forward_kernel
    original = composed.forward
    monkeypatch.setattr(tl_loss, "_loss_forward_kernel", Counted())
    monkeypatch.setattr(composed, "forward", lambda *args: composed_calls.append(1) or original(*args))
    d = batch()
    x = d.logits.clone().requires_grad_()
    cfg = dict(loss_type="ppo", clip_low=0.2, kl_coef=0.1, kl_estimator="full", entropy_coef=0.01)
    out = call(x, d, cfg, "triton")
    out.loss.backward()
    assert launches == [(B * T,)] and composed_calls == []
    x64 = d.logits.double().requires_grad_()
    e_grad, = torch.autograd.grad(oracle(x64, d, cfg)[0], x64)
    assert_close(x.grad, e_grad, 2e-6, 1e-4, what="grad")
    with torch.no_grad():
        call(x, d, cfg, "triton")
    assert len(launches) == 1 and composed_calls == [1]


def test_no_grad_writes_no_gradient(backend):
    d = batch()
    with torch.no_grad():
        out = kltriton.policy_loss(d.logits.requires_grad_(), d.labels, d.adv, old_logprobs=d.old, backend=backend)
    assert not out.loss.requires_grad


def fused_args(backend, with_grad=True, quantile=None):
    d = batch()
    target = torch.where(d.mask, d.labels, -1).reshape(-1)
    n = target.numel()
    w = torch.rand(n)
    hp = terms.hyperparameters("cpu", ratio_low=0.8, ratio_high=1.28, dual_clip=3.0)
    q = None if quantile is None else torch.tensor(quantile, dtype=torch.float64)
    inputs = LossInputs(d.old.reshape(-1), d.adv.reshape(-1), w, 0.1 * w, (-0.01 if q is None else 0.0) * w, None)
    return loss.flatten(Side(d.logits.clone().requires_grad_(), None, None, None, None),
                        Side(d.ref, None, None, None, None), target, torch.tensor(1.0, dtype=torch.float64), inputs, hp,
                        "ppo", "k3", q is None, NeedsGrad(with_grad, False, False), True, q, 0, backend)


@pytest.mark.parametrize("quantile", [None, 0.6])
@pytest.mark.parametrize("backend_name", ["reference", "cpp", "triton"])
def test_opcheck(backend_name, quantile):
    usable, why = kltriton.dispatch.availability(backend_name, "loss")
    if not usable:
        pytest.skip(why)
    # test_aot_dispatch_dynamic is left out by design: the eager backward scales the op's output
    # `grad` in place (no copy), which that test sees as an output that differs from the compiled
    # one. Under torch.compile the backward scales out of place; test_compile_fullgraph_matches_eager
    # checks its values and gradients.
    torch.library.opcheck(loss.overload, fused_args(backend_name, quantile=quantile),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch.library.opcheck(loss_scale_.overload, loss_scale_.flatten(torch.randn(5, 7), torch.tensor(0.5), backend_name))


def loss_fn(logits, ref, labels, adv, old, mask, kl_coef):
    out = kltriton.policy_loss(logits, labels, adv, old_logprobs=old, ref=ref, mask=mask, kl_coef=kl_coef,
                               dual_clip=3.0, entropy_coef=0.01)
    return out.loss * 0.5 + out.metrics["clipfrac"]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(compiler):
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend=compiler, fullgraph=True)
    d = batch()
    for kl_coef in (0.1, 0.2):
        x = d.logits.clone().requires_grad_()
        expected = loss_fn(x, d.ref, d.labels, d.adv, d.old, d.mask, kl_coef)
        e_grad, = torch.autograd.grad(expected, x)
        x = d.logits.clone().requires_grad_()
        got = compiled(x, d.ref, d.labels, d.adv, d.old, d.mask, kl_coef)
        grad, = torch.autograd.grad(got, x)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(grad, e_grad)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(loss_type="bogus"), ValueError, "loss_type"),
    (dict(aggregation="mean"), ValueError, "aggregation"),
    (dict(is_mode="token_truncate"), ValueError, "rollout_logprobs"),
    (dict(is_mode="bogus"), ValueError, "is_mode"),
    (dict(kl_coef=0.1), ValueError, "ref"),
    (dict(dual_clip=0.5), ValueError, "dual_clip"),
    (dict(dual_clip=3.0, loss_type="cispo"), ValueError, "dual_clip"),
    (dict(clip_low="0.2"), TypeError, "clip_low"),
    (dict(horizon=0), ValueError, "horizon"),
])
def test_bad_arguments(kwargs, error, match):
    d = batch()
    with pytest.raises(error, match=match):
        kltriton.policy_loss(d.logits, d.labels, d.adv, **kwargs)


def test_bad_advantages_shape():
    d = batch()
    with pytest.raises(ValueError, match="advantages"):
        kltriton.policy_loss(d.logits, d.labels, torch.randn(5))


@pytest.mark.parametrize("ref_form", ["logits", "logprobs"])
@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "cispo"])
def test_linear_logits_equal_dense_logits(loss_type, ref_form):
    """From hidden states: the same loss and the same gradients w.r.t. hidden, weight and bias as
    policy_loss on the logits ``hidden @ weight.T + bias`` (float64, so any difference is a bug)."""
    gen = torch.Generator().manual_seed(3)
    b, t, h, v = 3, 7, 16, 101
    hidden = torch.randn(b, t, h, dtype=torch.float64, generator=gen).requires_grad_()
    weight = torch.randn(v, h, dtype=torch.float64, generator=gen).requires_grad_()
    bias = torch.randn(v, dtype=torch.float64, generator=gen).requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=gen)
    advantages = torch.randn(b, t, dtype=torch.float64, generator=gen)
    old = torch.randn(b, t, dtype=torch.float64, generator=gen) * 0.1 - 4.0
    ref = torch.randn(b, t, v, dtype=torch.float64, generator=gen)
    if ref_form == "logprobs":
        ref = torch.log_softmax(ref, -1).gather(-1, labels[..., None]).squeeze(-1)
    mask = torch.rand(b, t, generator=gen) < 0.8
    kwargs = dict(old_logprobs=old, ref=ref, kl_coef=0.1, loss_type=loss_type, mask=mask, entropy_coef=0.01)
    lin = kltriton.policy_loss(kltriton.LinearLogits(hidden, weight, bias), labels, advantages, **kwargs)
    dense = kltriton.policy_loss(hidden @ weight.T + bias, labels, advantages, **kwargs)
    assert_close(lin.loss, dense.loss, 1e-12, what="loss")
    for got, want, name in zip(torch.autograd.grad(lin.loss, (hidden, weight, bias)),
                               torch.autograd.grad(dense.loss, (hidden, weight, bias)), ("hidden", "weight", "bias")):
        assert_close(got, want, 1e-12, what=name)


def linear_batch(dtype, seed=4):
    """hidden ``[B, T, H]``, an LM head with bias, a reference head, labels, mask, old log-probs."""
    gen = torch.Generator().manual_seed(seed)
    h, v = 24, 151
    hidden = torch.randn(B, T, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / 2).to(dtype)
    bias = torch.randn(v, generator=gen).to(dtype)
    ref_weight = (weight.float() + 0.1 * torch.randn(v, h, generator=gen)).to(dtype)
    labels = torch.randint(0, v, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.8
    mask[1] = False
    old = torch.randn(B, T, generator=gen) * 0.2 - 5.0
    adv = torch.randn(B, T, generator=gen)
    return SimpleNamespace(hidden=hidden, weight=weight, bias=bias, ref_weight=ref_weight, labels=labels, mask=mask,
                           old=old, adv=adv)


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_linear_logits_gradient_in_forward(backend, dtype, estimator, monkeypatch):
    """A LinearLogits policy (logit scale, softcap) takes the fused route (the linear family's backward
    never runs) and its hidden / weight / bias gradients, with an upstream gradient of 0.7, match
    float64 autograd through the dense logits. Tolerances: the logits tile is fp32 from exact products of the dtype's values;
    the gradients are fp32 sums over V (or N) rounded to the dtype once (MIXED_GRAD_RTOL of the
    largest gradient entry, and relative)."""
    if backend == "triton" and dtype != torch.float32:
        pytest.skip("the interpreter is slow: one dtype")
    d = linear_batch(dtype)
    linear = kltriton.dispatch.implementation("linear", backend)
    calls = []
    monkeypatch.setattr(linear, "backward", lambda *a: calls.append(a))

    def run(h, w, b, rw, backend_name):
        if h.dtype == torch.float64:  # the oracle: dense float64 logits, differentiated by autograd
            lin = 3.0 * torch.tanh(0.8 * (h @ w.T + b) / 3.0)
            ref = 3.0 * torch.tanh(h.detach() @ rw.T / 3.0)
        else:
            lin = kltriton.LinearLogits(h, w, b, logit_scale=0.8, softcap=3.0)
            ref = kltriton.LinearLogits(d.hidden, rw, softcap=3.0)
        out = kltriton.policy_loss(lin, d.labels, d.adv, old_logprobs=d.old, ref=ref, kl_coef=0.1,
                                   kl_estimator=estimator, entropy_coef=0.01, dual_clip=3.0, mask=d.mask,
                                   temperature=0.9, backend=backend_name)
        return out.loss, torch.autograd.grad(out.loss * 0.7, (h, w, b))

    params = [t.detach().requires_grad_() for t in (d.hidden, d.weight, d.bias)]
    loss, grads = run(*params, d.ref_weight, backend)
    assert not calls, "the linear family's backward ran: not the fused route"
    oracle_params = [t.detach().double().requires_grad_() for t in (d.hidden, d.weight, d.bias)]
    e_loss, e_grads = run(*oracle_params, d.ref_weight.double(), "reference")
    assert_close(loss, e_loss, atol=1e-5 * (1 + e_loss.abs().item()), rtol=1e-4, what="loss")
    for got, want, name in zip(grads, e_grads, ("hidden", "weight", "bias")):
        assert got.dtype == dtype
        size = want.abs().max().item()
        rtol = MIXED_GRAD_RTOL[dtype]
        assert_close(got, want, atol=rtol * size / 4, rtol=rtol, what=name)


def linear_fused_args(backend):
    d = linear_batch(torch.float32)
    target = torch.where(d.mask, d.labels, -1).reshape(-1)
    w = torch.rand(target.numel())
    hp = terms.hyperparameters("cpu", ratio_low=0.8, ratio_high=1.28, dual_clip=3.0)
    scalar = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    inputs = LossInputs(d.old.reshape(-1), d.adv.reshape(-1), w, 0.1 * w, -0.01 * w, None)
    return (Side(d.hidden.clone().requires_grad_(), d.weight.clone().requires_grad_(), d.bias, scalar(0.5),
                 scalar(20.0)), Side(d.hidden, d.ref_weight, None, None, None), target, scalar(1.0), inputs, hp,
            "ppo", "full", True, NeedsGrad(True, True, False), True, None, 40 * 151, backend)


@pytest.mark.parametrize("backend_name", ["reference", "cpp"])
def test_linear_opcheck(backend_name):
    usable, why = kltriton.dispatch.availability(backend_name, "linear")
    if not usable:
        pytest.skip(why)
    args = linear_fused_args(backend_name)
    torch.library.opcheck(loss.overload, loss.flatten(*args),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    masked = list(args)
    masked[4] = masked[4]._replace(w_ent=0.0 * masked[4].w_ent)
    masked[8], masked[11] = False, torch.tensor(0.5, dtype=torch.float64)
    torch.library.opcheck(loss.overload, loss.flatten(*masked),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_linear_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    d = linear_batch(torch.float32)

    def fn(h, w):
        out = kltriton.policy_loss(kltriton.LinearLogits(h, w, softcap=30.0), d.labels, d.adv, old_logprobs=d.old,
                                   mask=d.mask, entropy_coef=0.01)
        return out.loss * 0.5

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        h, w = d.hidden.clone().requires_grad_(), d.weight.clone().requires_grad_()
        loss = f(h, w)
        results.append((loss, *torch.autograd.grad(loss, (h, w))))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)
