"""Float64 oracles of every policy loss ``kltriton.policy_loss`` accepts, restated on padded ``[B, T]`` tensors from
verl 0.9.1's ``core_algos`` and TRL 1.16's ``GRPOTrainer._compute_loss`` (written from their source, not from
kltriton's ``terms.py``), differentiated by autograd. Shared by the loss-type tests."""
import math
from types import SimpleNamespace

import torch

from helpers import random_logits

B, T, V = 4, 9, 67
TRL_NAMES = ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")
# The seq-mean of these divides by every sequence (TRL's .mean(), verl geo_mean's torch.mean); verl's agg_loss by
# the non-empty ones.
ALL_SEQUENCES = ("grpo", "dr_grpo", "luspo", "geo_mean")
DEFAULT_AGGREGATION = {"grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm",
                       "luspo": "seq-mean-token-sum", "sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
# The trainers' defaults of a name alone. verl (ActorConfig): clip_ratio_c = 3.0, the dual clip of vanilla (and of
# bypass_mode's ppo_clip) and DPPO's truncation; the log-ratio clamped to +-20 (core_algos). TRL (GRPOConfig,
# _compute_loss) and torchrl: no dual clip, no log-ratio clamp; dr_grpo divides by max_completion_length = 512.
# kltriton's own "ppo": verl's clamp, no dual clip.
UNCLAMPED = TRL_NAMES + ("vespo", "clipped_ratio")
DEFAULT_DUAL_CLIP = {"vanilla": 3.0, "bypass_mode": 3.0}
DEFAULT_HORIZON = {"dr_grpo": 512.0}


def batch(dtype=torch.float32, seed=0, spread=0.3, per_sequence_advantages=False):
    """Padded ``[B, T]`` batch: a fully masked row 1, a prompt-like prefix in row 0, old / rollout log-probs
    near the policy's (ratios around 1 on both sides of the clip ranges), a few likely tokens (DPPO's
    divergences), reference logits and IS weights."""
    gen = torch.Generator().manual_seed(seed)
    logits = random_logits((B, T, V), dtype, generator=gen)
    labels = torch.randint(0, V, (B, T), generator=gen)
    # a few tokens the policy finds likely, so that DPPO's probability differences are large
    logits = logits.clone()
    logits[:, 3:7].scatter_add_(-1, labels[:, 3:7, None], 4.0 + 4.0 * torch.rand(B, 4, 1, generator=gen))
    ref = (logits.float() + 0.5 * torch.randn(logits.shape, generator=gen)).to(dtype)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = False
    mask[1] = False
    mask[2, 5:] = False
    logp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    old = (logp + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    rollout = (old.double() + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    adv = torch.randn(B, generator=gen) if per_sequence_advantages else torch.randn(B, T, generator=gen)
    is_weights = (0.5 + torch.rand(B, T, generator=gen)).float()
    return SimpleNamespace(logits=logits, ref=ref, labels=labels, mask=mask, old=old, rollout=rollout, adv=adv,
                           is_weights=is_weights)


def _masked_mean(x, m):
    return (x * m).sum() / m.sum().clamp(min=1)


def aggregate(mat, m, mode, all_sequences, horizon=T, num_tokens=None, num_seqs=None):
    """verl ``agg_loss`` (dp_size 1, with ``batch_num_tokens`` / ``global_batch_size``); ``all_sequences``: the
    seq-mean divides by every sequence (TRL)."""
    if mode == "token-mean":
        return (mat * m).sum() / (m.sum().clamp(min=1) if num_tokens is None else num_tokens)
    if mode == "token-sum":
        return (mat * m).sum()
    if mode == "seq-mean-token-mean":
        seq = (mat * m).sum(-1) / m.sum(-1).clamp(min=1)
    else:
        seq = (mat * m).sum(-1)
    count = num_seqs if num_seqs is not None else (float(m.shape[0]) if all_sequences else (m.sum(-1) > 0).sum())
    loss = seq.sum() / count if num_seqs is not None or all_sequences else seq.sum() / torch.clamp(count, min=1)
    return loss / horizon if mode == "seq-mean-token-sum-norm" else loss


def _is_weights(cfg, old, rollout, m):
    """TRL's vLLM IS weights (on the old or, on-policy, the new log-probs; 1 without ``is_mode``), and their
    metrics."""
    mode = cfg.get("is_mode") or ""
    diff = (old.detach() - rollout) * m
    lw = diff.sum(-1, keepdim=True).expand_as(diff) if mode.startswith("sequence") else diff
    w = torch.exp(lw)
    cap, low = cfg.get("is_cap", 2.0), cfg.get("is_min")
    hi, lo = (math.inf if cap is None else cap), (-math.inf if low is None else low)
    if mode.endswith("truncate"):
        weights = torch.clamp(w, min=low, max=cap)
    elif mode.endswith("mask"):
        weights = w.masked_fill((w > hi) | (w < lo), 0.0)
    else:
        weights = torch.ones_like(w)
    metrics = {"is_weight_mean": _masked_mean(weights, m), "is_masked_frac": _masked_mean(((w > hi) | (w < lo)).double(), m),
               "mismatch_k3": _masked_mean(torch.exp(diff) - 1 - diff, m)}
    return weights, metrics


def _kl(cfg, logp, rlp, lsm, ref_lsm):
    """verl ``kl_penalty`` without its internal clamps (``kl_clamp`` explicit), TRL's k3."""
    est = cfg.get("kl_estimator", "k3")
    base = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}.get(est.rstrip("+"), est.rstrip("+"))
    dk = logp - rlp
    if base == "full":
        kl = (lsm.exp() * (lsm - ref_lsm)).sum(-1)
    else:
        kl = {"k1": dk, "abs": dk.abs(), "k2": 0.5 * dk ** 2, "k3": torch.exp(-dk) + dk - 1}[base]
    if cfg.get("kl_clamp"):
        kl = kl.clamp(-cfg["kl_clamp"], cfg["kl_clamp"])
    if est.endswith("+"):
        k2 = 0.5 * dk ** 2
        kl = k2 - k2.detach() + kl.detach()
    return kl


def policy_term(lt, cfg, logp, old, A, m, is_log):
    """``(pg [B, T] or [B, 1], ratio [B, T], clipped, lower, neg_kl (for ppo_kl), extra metrics)`` of loss type
    ``lt``, restated from verl / TRL."""
    low, high = cfg.get("clip_low", 0.2), cfg.get("clip_high", cfg.get("clip_low", 0.2))
    zero = torch.zeros_like(m, dtype=torch.bool)
    level = cfg.get("importance_sampling_level", "token")
    name = cfg.get("loss_type", "ppo")
    clamp = cfg.get("log_ratio_clamp", math.inf if name in UNCLAMPED else 20.0)
    if level == "sequence":  # TRL: one ratio per sequence (its mean log-ratio)
        seq = ((logp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        lr_seq = torch.clamp(seq, -clamp, clamp)
    lr = torch.clamp(logp - old, -clamp, clamp)
    ratio = torch.exp(lr) if level == "token" else torch.exp(lr_seq).expand_as(lr)
    if lt in ("ppo", "vanilla") + TRL_NAMES:
        # verl vanilla: max(-A r, -A clip(r)), dual clip; TRL: -min(min(r, delta) A, clip(r) A)
        r1 = torch.clamp(ratio, max=cfg["delta"]) if cfg.get("delta") else ratio
        pg1, pg2 = -A * r1, -A * torch.clamp(ratio, 1 - low, 1 + high)
        c1 = torch.maximum(pg1, pg2)
        c = cfg.get("dual_clip", DEFAULT_DUAL_CLIP.get(name, math.inf))
        pg3 = -A * c
        pg = torch.where(A < 0, torch.minimum(pg3, c1), c1)
        return pg, ratio, pg2 > pg1, (c1 > pg3) & (A < 0), -lr, {}
    if lt == "cispo":
        cr = torch.clamp(ratio, 1 - low, 1 + high)
        return -cr.detach() * A * logp, ratio, ratio != cr, zero, -lr, {}
    if lt == "clipped_ratio":  # torchrl CISPOLoss: -exp(clamp(log r, log(1 - low), log(1 + high))) A
        lw = logp - old
        clipped_lw = lw.clamp(math.log1p(-low), math.log1p(high))
        return -clipped_lw.exp() * A, ratio, clipped_lw != lw, zero, -lr, {}
    if lt == "sapo":
        tau = torch.where(A > 0, cfg.get("tau_pos", 1.0), cfg.get("tau_neg", 1.05))
        return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * A, ratio, zero, zero, -lr, {}
    if lt == "gpg":
        return -logp * A, ratio, zero, zero, -lr, {}
    if lt in ("dppo_tv", "dppo_kl"):
        cap = cfg.get("clip_ratio_c", 3.0)
        trunc = torch.clamp(ratio, max=cap).detach()
        prob, old_prob = torch.exp(logp), torch.exp(old)
        if lt == "dppo_tv":
            valid = torch.where(A > 0, (prob - old_prob) <= high, (prob - old_prob) >= -low)
        else:
            bkl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            valid = torch.where(A > 0, (bkl <= high) | (prob <= old_prob), (bkl <= low) | (prob >= old_prob))
        valid = valid.detach().double()
        return -A * trunc * logp * valid, ratio, valid == 0, (ratio > cap) & (valid == 1), -lr, {}
    if lt == "dro":
        d = logp - old
        return -(logp * A - 0.5 * cfg["dro_beta"] * d.square()), ratio, zero, zero, -d, {}
    if lt == "gspo":
        seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
        sr = torch.exp(torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=10.0))
        pg1, pg2 = -A * sr, -A * torch.clamp(sr, 1 - low, 1 + high)
        return torch.maximum(pg1, pg2), sr, pg2 > pg1, zero, -(logp - old), {}
    if lt == "geo_mean":
        nk = logp - old
        nkc = torch.clamp(nk, -low, high)
        sgn = torch.sign(A)
        nkmin = sgn * torch.min(sgn * nk, sgn * nkc)
        count = m.sum(-1)
        r = torch.exp((nkmin * m).sum(-1) / count.clamp(min=1))
        adv = (A * m).sum(-1) / count.clamp(min=1)
        moved = nk != nkc
        return (-adv * r)[:, None], r[:, None].expand_as(nk), moved & (A > 0), moved & (A < 0), -nk, {}
    if lt == "clip_cov":  # verl: cov selection with torch.randperm (the caller seeds the global generator)
        nk = logp - old
        r = torch.exp(nk)
        pg1, pg2 = -A * r, -A * torch.clamp(r, 1 - low, 1 + high)
        clip_by_origin = (pg2 > pg1) & (m > 0)
        cov = (A - _masked_mean(A, m)) * (logp - _masked_mean(logp.detach(), m))
        cov = cov.detach().masked_fill(m == 0, -math.inf).masked_fill(clip_by_origin, -math.inf)
        clip_num = max(int(cfg.get("clip_cov_ratio", 2e-4) * m.sum().item()), 1)
        idx = torch.nonzero((cov < cfg.get("clip_cov_ub", 5.0)) & (cov > cfg.get("clip_cov_lb", 1.0)) & (m > 0))
        corr = torch.ones_like(A)
        if len(idx):
            idx = idx[torch.randperm(len(idx))[:min(clip_num, len(idx))]]
            corr[idx[:, 0], idx[:, 1]] = 0
        return torch.maximum(pg1, pg2) * corr, r, corr == 0, zero, -nk, {}
    if lt == "kl_cov":
        nk = logp - old
        r = torch.exp(nk)
        pg = -A * r
        valid = m > 0
        adv_v, lp_v = A[valid].detach(), logp[valid].detach()
        cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
        k = max(1, int(len(cov) * cfg.get("kl_cov_ratio", 2e-4)))
        top = torch.nonzero(valid.reshape(-1)).squeeze(-1)[torch.topk(cov, k, largest=True).indices]
        pen = torch.zeros(m.numel(), dtype=torch.bool)
        pen[top] = True
        pg = torch.where(pen.view_as(pg), pg + cfg.get("ppo_kl_coef", 0.1) * nk.abs(), pg)
        return pg, r, zero, zero, nk.abs(), {}
    if lt == "vespo":  # TRL get_gamma_weights (no grad), -phi A logp
        with torch.no_grad():
            seq_lr = (torch.clamp(logp - old, -20, 20) * m).sum(-1, keepdim=True)
            if is_log is not None:
                seq_lr = seq_lr + (torch.clamp(is_log, math.log(1e-8), 20.0) * m).sum(-1, keepdim=True)
            log_w = torch.clamp(seq_lr, math.log(1e-8), 20.0)
            nonneg = A >= 0
            k = torch.where(nonneg, cfg.get("vespo_k_pos", 2.0), cfg.get("vespo_k_neg", 3.0))
            lam = torch.where(nonneg, cfg.get("vespo_lambda_pos", 3.0), cfg.get("vespo_lambda_neg", 2.0)).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        # TRL logs phi per sequence for per-sequence advantages ((B, 1)); phi is then constant along a row
        phi_mean = phi[:, 0].mean() if cfg.get("per_sequence") else _masked_mean(phi, m)
        return -phi * A * logp, ratio, zero, zero, -lr, {"vespo_phi_mean": phi_mean}
    raise ValueError(lt)


def oracle(x, d, cfg):
    """``(loss, outputs, metrics)`` of ``kltriton.policy_loss(**cfg)`` on ``d`` from float64 logits ``x``."""
    m = d.mask.double()
    lsm = torch.log_softmax(x, -1)
    logp = lsm.gather(-1, d.labels[..., None]).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    ref_lsm = torch.log_softmax(d.ref.double(), -1)
    rlp = ref_lsm.gather(-1, d.labels[..., None]).squeeze(-1)
    A = d.adv.double() if d.adv.dim() == 2 else d.adv.double()[:, None].expand(B, T)
    lt = cfg.get("loss_type", "ppo")
    sub = cfg.get("bypass_loss_type", "ppo_clip")
    old = logp.detach() if cfg.get("on_policy") else d.old.double()
    rollout_on_policy = False
    if lt == "bypass_mode":  # verl: old = rollout; ppo_clip is vanilla on it; reinforce is -A logp w
        if sub == "ppo_clip":
            old, lt = d.rollout.double(), "vanilla"
        else:
            old, lt, rollout_on_policy = logp.detach(), "gpg", True
    given = d.is_weights.double() if cfg.get("rollout_is_weights") else None
    pg, ratio, clipped, lower, neg_kl, extra = policy_term(lt, cfg, logp, old, A, m,
                                                            torch.log(given) if lt == "vespo" and given is not None
                                                            else None)
    metrics_is = {}
    weight = torch.ones_like(m)
    if cfg.get("is_mode") or cfg.get("off_policy_rollout") or cfg.get("loss_type") == "bypass_mode" and sub != "ppo_clip":
        weight, metrics_is = _is_weights(cfg, old if not rollout_on_policy else logp, d.rollout.double(), m)
    if given is not None and lt != "vespo":
        if lt == "geo_mean":  # verl: the token weights' geometric mean per sequence
            given = torch.exp((torch.log(given + 1e-10) * m).sum(-1) / m.sum(-1).clamp(min=1))[:, None].expand(B, T)
        weight = weight * given
    if cfg.get("off_policy_mask_threshold") is not None:  # TRL get_off_policy_mask
        sampling = d.rollout.double() if cfg.get("is_mode") or cfg.get("off_policy_rollout") else old
        kl_div = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
        avg = (kl_div * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
        weight = weight * ((A >= 0) | (avg <= cfg["off_policy_mask_threshold"])).double()
    keep = None
    metrics_mask = {}
    if cfg.get("token_mask_entropy_quantile") is not None:  # TRL get_high_entropy_mask
        threshold = torch.quantile(entropy.detach()[d.mask].float(), cfg["token_mask_entropy_quantile"])
        # fp32 entropies, as TRL's: the threshold is one of them whenever q (n - 1) is an integer
        keep = ((entropy.detach().float() * m.float() >= threshold) & d.mask).double()
        weight = weight * keep
        metrics_mask = {"entropy_threshold": threshold}
    kl = _kl(cfg, logp, rlp, lsm, ref_lsm)
    if cfg.get("use_bias_correction_kl"):
        kl = kl * ratio
    mode = cfg.get("aggregation") or DEFAULT_AGGREGATION.get(cfg.get("loss_type", "ppo"), "token-mean")
    all_seqs = cfg.get("loss_type", "ppo") in ALL_SEQUENCES
    horizon = cfg.get("horizon", DEFAULT_HORIZON.get(cfg.get("loss_type", "ppo"), T))
    agg = lambda mat: aggregate(mat.expand(B, T), m, mode, all_seqs, horizon,  # noqa: E731
                                cfg.get("batch_num_tokens"), cfg.get("global_batch_size"))
    ent_mask = m if keep is None else m * keep
    if cfg.get("entropy_aggregation"):
        ent_term = aggregate(entropy, ent_mask, cfg["entropy_aggregation"], False)
    else:
        ent_term = aggregate(entropy, ent_mask, mode, all_seqs, horizon, cfg.get("batch_num_tokens"),
                             cfg.get("global_batch_size")) if keep is not None else agg(entropy)
    pg_term = agg(pg * weight)
    kl_term = agg(kl)
    loss = pg_term + cfg.get("kl_coef", 0.0) * kl_term - cfg.get("entropy_coef", 0.0) * ent_term
    mean = lambda t: _masked_mean(t.double(), m)  # noqa: E731
    metrics = {"clipfrac": mean(clipped), "clipfrac_lower": mean(lower), "ppo_kl": mean(neg_kl),
               "kl_mean": mean(kl), "entropy_mean": mean(entropy), "ratio_max": ratio[d.mask].max(),
               "ratio_min": ratio[d.mask].min(), "pg_loss": pg_term, "kl_loss": kl_term,
               "entropy_loss": ent_term, **metrics_is, **metrics_mask,
               **extra}
    outputs = {"logprobs": logp * m, "ref_logprobs": rlp * m, "kl": kl * m, "entropy": entropy * m, "ratio": ratio * m}
    return loss, outputs, metrics
