"""Context parallel (``sequence_group=``): 2 and 3 spawned gloo ranks, each holding a contiguous slice of the
sequence dimension, against the unsplit call on the full float64 tensors (the reference backend).

Every rank builds the same full tensors and cuts its slice: ``[B, T_r]`` of a padded batch (uneven: T = 11 as 7 + 4
and 3 + 5 + 3) or ``[N_r]`` of a packed stream with the global ``cu_seqlens`` (N = 17 as 10 + 7 and 6 + 0 + 11: an
empty slice, segments crossing every boundary). Each case checks:

- per-token outputs: this rank's slice of the unsplit outputs (the next-token shift across the split included);
- losses, metrics and ``kl_per_seq``: the unsplit values, on every rank;
- gradients: the upstream gradient of every per-token output is the slice of one full random tensor and that of a
  global output the same on every rank (a function computed alike everywhere); the gradient of this rank's logits
  (hidden states) is the slice of the unsplit one, and a replicated LM-head weight's gradients summed over the ranks
  are the unsplit one (what a trainer all-reduces).

Each case runs in float32 on the default CPU backend and in float64 on the reference backend (tight: a wrong count
or shift would show far above 1e-9). A world of 4 runs the context x vocab (2 x 2) layouts. Spawning ranks costs
seconds, so one spawn per world size runs every case and the tests read its reports.
"""
import json
import os
import tempfile
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kltriton
from helpers import MIXED_GRAD_RTOL, assert_close, close_rank, exit_rank, raises_with, record, value_atol

B, T, V, N, H = 3, 11, 67, 17, 16
SPLITS = {2: (7, 4), 3: (3, 5, 3)}        # T = 11 over the ranks, uneven
PACKED = {2: (10, 7), 3: (6, 0, 11)}      # N = 17 over the ranks: an empty slice with 3
CU_SEQLENS = torch.tensor([0, 4, 9, 9, 15, 17])  # segments crossing every boundary above, an empty one
TEMPERATURE = 0.8


class Input(NamedTuple):
    value: torch.Tensor
    cut: str            # "seq": sliced along the sequence dimension; "whole": every rank has all of it
    logits: bool = False  # cast to the run's dtype (logits, hidden states, LM-head weights)
    grad: bool = False    # a leaf whose gradient is checked


class Where(NamedTuple):
    """This rank's slice: ``[start, stop)`` of the sequence dimension (``dim``, of length ``full``)."""
    start: int
    stop: int
    dim: int
    full: int = 0

    def cut(self, tensor):
        return tensor.narrow(self.dim, self.start, self.stop - self.start)


def _logits(shape, seed, scale=3.0):
    """Fresh random logits with a ``-inf`` and a ``finfo.min`` entry."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * scale
    flat = x.view(-1, shape[-1])
    flat[0, 5] = float("-inf")
    flat[3, -3] = torch.finfo(torch.float32).min
    return x


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _padded_inputs(seed, ref=True):
    gen = _gen(seed)
    full = _logits((B, T, V), seed)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False     # a prompt
    mask[1, 8:] = False     # a short response
    mask[2, 6] = False      # a hole at a boundary (3 + 5 + 3 and 7 + 4 both split near it)
    inputs = {"logits": Input(full, "seq", logits=True, grad=True), "ids": Input(ids, "seq"),
              "mask": Input(mask, "seq")}
    if ref:
        inputs["ref"] = Input(full + torch.randn(full.shape, generator=gen), "seq", logits=True)
    return inputs


def _loss_rows(seed):
    """Old / rollout log-probs near the policy's (ratios on both sides of the clip range), advantages."""
    gen = _gen(seed)
    full = _logits((B, T, V), seed)
    ids = torch.randint(0, V, (B, T), generator=_gen(seed))
    shifted = torch.roll(ids, -1, 1)
    logp = torch.log_softmax(full.double() / TEMPERATURE, -1).gather(-1, shifted[..., None]).squeeze(-1)
    old = (logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    rollout = (old.double() + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    return {"old": Input(old, "seq"), "rollout": Input(rollout, "seq"),
            "adv_token": Input(torch.randn(B, T, generator=gen), "seq"),
            "adv_seq": Input(torch.randn(B, generator=gen), "whole"),
            "is_weights": Input(torch.exp(0.2 * torch.randn(B, T, generator=gen)), "seq"),
            "ref_logp": Input(-torch.rand(B, T, generator=gen) * 4, "seq")}


# --- the cases: (inputs(seed), call(tensors, keywords) -> {name: (tensor, "token" or "global")}) -----------------

def _logprobs_padded():
    def call(t, kw):
        logp, entropy = kltriton.token_logprobs(t["logits"], t["ids"], mask=t["mask"], shift_labels=True,
                                                return_entropy=True, temperature=TEMPERATURE, **kw)
        return {"logp": (logp, "token"), "entropy": (entropy, "token")}
    return lambda seed: _padded_inputs(seed, ref=False), call


def _kl_padded():
    def call(t, kw):
        out = kltriton.token_kl(t["logits"], t["ref"], t["ids"], estimator="k3", mask=t["mask"], shift_labels=True,
                                temperature=TEMPERATURE, **kw)
        return {name: (value, "token") for name, value in out._asdict().items()}
    return _padded_inputs, call


def _reward_padded():
    def inputs(seed):
        out = _padded_inputs(seed)
        gen = _gen(seed + 1)
        out.update(scores=Input(torch.randn(B, generator=gen) * 3, "whole"),
                   rewards=Input(torch.randn(B, T, generator=gen), "seq"))
        return out

    def call(t, kw):
        out = kltriton.fused_kl_reward(t["logits"], t["ref"], t["ids"], coef=0.2, estimator="k2", mask=t["mask"],
                                       shift_labels=True, scores=t["scores"], rewards=t["rewards"], score_clip=2.0,
                                       temperature=TEMPERATURE, **kw)
        return {"reward": (out.reward, "token"), "kl": (out.kl, "token"), "logprobs": (out.logprobs, "token"),
                "kl_per_seq": (out.kl_per_seq, "global")}
    return inputs, call


def _packed_inputs(seed):
    gen = _gen(seed)
    ids = torch.randint(0, V, (N,), generator=gen)
    ids[7] = -100
    return {"logits": Input(_logits((N, V), seed), "seq", logits=True, grad=True), "ids": Input(ids, "seq"),
            "cu": Input(CU_SEQLENS, "whole"), "ref_logp": Input(-torch.rand(N, generator=gen) * 4, "seq"),
            "scores": Input(torch.randn(5, generator=gen), "whole"), "adv": Input(torch.randn(5, generator=gen),
                                                                                   "whole"),
            "old": Input(-torch.rand(N, generator=gen) * 4, "seq")}


def _reward_packed():
    def call(t, kw):
        out = kltriton.fused_kl_reward(t["logits"], t["ref_logp"], t["ids"], coef=0.1, cu_seqlens=t["cu"],
                                       shift_labels=True, scores=t["scores"], temperature=TEMPERATURE, **kw)
        logp, entropy = kltriton.token_logprobs(t["logits"], t["ids"], cu_seqlens=t["cu"], shift_labels=True,
                                                return_entropy=True, **kw)
        return {"reward": (out.reward, "token"), "kl": (out.kl, "token"), "kl_per_seq": (out.kl_per_seq, "global"),
                "logp": (logp, "token"), "entropy": (entropy, "token")}
    return _packed_inputs, call


def _divergence():
    def call(t, kw):
        per_token = kltriton.token_divergence(t["logits"], t["ref"], t["ids"], divergence="jsd", beta=0.3,
                                              mask=t["mask"], shift_labels=True, **kw)
        loss = kltriton.token_divergence(t["logits"], t["ref"], t["ids"], divergence="reverse_kl",
                                         reduction="batchmean", mask=t["mask"], shift_labels=True, **kw)
        return {"jsd": (per_token, "token"), "batchmean": (loss, "global")}
    return _padded_inputs, call


def _policy(**options):
    """``policy_loss`` on the padded batch: every output and metric; ``adv``: ``"adv_token"`` or ``"adv_seq"``;
    ``with_old`` / ``with_rollout`` / ``with_is`` / ``with_ref`` pick the inputs."""
    adv = options.pop("adv", "adv_token")
    with_old, with_rollout = options.pop("with_old", True), options.pop("with_rollout", False)
    with_is, with_ref = options.pop("with_is", False), options.pop("with_ref", True)

    def inputs(seed):
        out = _padded_inputs(seed)
        out.update(_loss_rows(seed))
        return out

    def call(t, kw):
        extra = dict(options)
        if with_old:
            extra["old_logprobs"] = t["old"]
        if with_rollout:
            extra["rollout_logprobs"] = t["rollout"]
        if with_is:
            extra["rollout_is_weights"] = t["is_weights"]
        if with_ref:
            extra.update(ref=t["ref"], kl_coef=0.05)
        out = kltriton.policy_loss(t["logits"], t["ids"], t[adv], mask=t["mask"], shift_labels=True,
                                   temperature=TEMPERATURE, **extra, **kw)
        result = {"loss": (out.loss, "global")}
        result.update({name: (getattr(out, name), "token") for name in ("logprobs", "entropy", "kl", "ratio")})
        result.update({f"metrics.{name}": (value, "global") for name, value in out.metrics.items()})
        return result
    return inputs, call


def _policy_packed():
    def call(t, kw):
        out = kltriton.policy_loss(t["logits"], t["ids"], t["adv"], old_logprobs=t["old"], loss_type="gspo",
                                   cu_seqlens=t["cu"], shift_labels=True, aggregation="seq-mean-token-mean", **kw)
        result = {"loss": (out.loss, "global"), "ratio": (out.ratio, "token")}
        result.update({f"metrics.{name}": (value, "global") for name, value in out.metrics.items()})
        return result
    return _packed_inputs, call


def _policy_linear():
    """A ``LinearLogits`` policy: hidden states sliced, the LM-head weight replicated (its gradient summed)."""
    def inputs(seed):
        gen = _gen(seed)
        out = _padded_inputs(seed, ref=False)
        out.update(_loss_rows(seed))
        out["logits"] = Input(torch.randn(B, T, H, generator=gen), "seq", logits=True, grad=True)
        out["weight"] = Input(torch.randn(V, H, generator=gen) / 2, "whole", logits=True, grad=True)
        return out

    def call(t, kw):
        out = kltriton.policy_loss(kltriton.LinearLogits(t["logits"], t["weight"]), t["ids"], t["adv_seq"],
                                   old_logprobs=t["old"], loss_type="grpo", mask=t["mask"], shift_labels=True,
                                   entropy_coef=0.01, **kw)
        return {"loss": (out.loss, "global"), "logprobs": (out.logprobs, "token"),
                "metrics.clipfrac": (out.metrics["clipfrac"], "global")}
    return inputs, call


CASES = {
    "logprobs_padded": _logprobs_padded(),
    "kl_padded": _kl_padded(),
    "reward_padded": _reward_padded(),
    "packed": _reward_packed(),
    "divergence": _divergence(),
    "ppo_token_mean": _policy(entropy_coef=0.01),
    "grpo_seq_mean_token_mean": _policy(loss_type="grpo", adv="adv_seq"),
    "seq_mean_token_sum": _policy(aggregation="seq-mean-token-sum"),
    "seq_mean_token_sum_norm": _policy(aggregation="seq-mean-token-sum-norm"),
    "gspo": _policy(loss_type="gspo", adv="adv_seq"),
    "geo_mean": _policy(loss_type="geo_mean", with_is=True),
    "vespo_token": _policy(loss_type="vespo", with_is=True),
    "vespo_sequence": _policy(loss_type="vespo", adv="adv_seq"),
    "sequence_ratio": _policy(loss_type="grpo", importance_sampling_level="sequence", adv="adv_seq"),
    "sequence_is": _policy(with_rollout=True, is_mode="sequence_truncate", is_cap=1.5),
    "on_policy_is": _policy(with_old=False, with_rollout=True, is_mode="sequence_mask", is_cap=3.0, is_min=0.3),
    "off_policy_mask": _policy(loss_type="grpo", with_rollout=True, off_policy_mask_threshold=0.05),
    "entropy_quantile": _policy(loss_type="dapo", token_mask_entropy_quantile=0.3, entropy_coef=0.02,
                                entropy_aggregation="token-mean", with_ref=False),
    "entropy_quantile_no_bonus": _policy(token_mask_entropy_quantile=0.6),
    "policy_packed": _policy_packed(),
    "policy_linear": _policy_linear(),
}


# --- running a case -------------------------------------------------------------------------------------------

def _prepare(inputs, where, dtype, split):
    """The tensors of one run: the full ones (``split`` False) or this rank's slices; logits-like ones cast to
    ``dtype``; leaves requiring grad."""
    tensors, leaves = {}, {}
    for name, item in inputs.items():
        value = where.cut(item.value) if split and item.cut == "seq" else item.value
        if item.logits:
            value = value.to(dtype)
        value = value.clone()
        if item.grad:
            value.requires_grad_()
            leaves[name] = value
        tensors[name] = value
    return tensors, leaves


def _upstream(outputs, where, split, seed=99):
    """The same random upstream gradient in both runs: a token output's is the slice of one full tensor."""
    gen = _gen(seed)
    total = 0.0
    for name in sorted(outputs):
        value, kind = outputs[name]
        if not value.requires_grad:
            continue
        full_shape = list(value.shape)
        if kind == "token" and split:
            full_shape[where.dim] = where.full
        weight = torch.randn(full_shape, generator=gen, dtype=torch.float64)
        if kind == "token" and split:
            weight = where.cut(weight)
        total = total + (value * weight.to(value.dtype)).sum()
    return total


def _tolerances(inputs, dtype):
    """``(value atol, value rtol, grad rtol)``. float64 against float64: rounding only (1e-10). float32: the
    vocab-parallel and single-process policies (``helpers``): a few ulps of ``|x| / T`` (``value_atol``), and for
    gradients with entropy terms ``MIXED_GRAD_RTOL``."""
    if dtype == torch.float64:
        return 1e-10, 1e-10, 1e-10
    tol = 8 * value_atol(inputs["logits"].value, TEMPERATURE)
    return tol, tol, MIXED_GRAD_RTOL[torch.float32]


def run_case(name, world, rank, group, dtype, backend):
    make, call = CASES[name]
    inputs = make(3)
    packed = inputs["logits"].value.dim() == 2 and "cu" in inputs
    sizes = PACKED[world] if packed else SPLITS[world]
    start = sum(sizes[:rank])
    place = Where(start, start + sizes[rank], 0 if packed else 1, N if packed else T)
    full, full_leaves = _prepare(inputs, place, torch.float64, split=False)
    full_out = call(full, {"backend": "reference"})
    mine, leaves = _prepare(inputs, place, dtype, split=True)
    out = call(mine, {"backend": backend, "sequence_group": group})
    _upstream(full_out, place, False).backward()
    _upstream(out, place, True).backward()
    atol, rtol, grad_rtol = _tolerances(inputs, dtype)
    assert set(out) == set(full_out), set(out) ^ set(full_out)
    for key, (value, kind) in out.items():
        expected = full_out[key][0].detach()
        if kind == "token":
            expected = place.cut(expected)
        scale = 1.0 + (expected[torch.isfinite(expected)].abs().max().item() if expected.numel() else 0.0)
        if key.startswith("metrics."):  # fp32 sums of fp32 values (as policy_loss computes its metrics)
            value_atol_, value_rtol = max(atol, 1e-6), max(rtol, 1e-6)
        else:
            value_atol_, value_rtol = atol, rtol
        assert_close(value.detach(), expected, atol=value_atol_ * scale, rtol=value_rtol, what=f"{name} {key}")
    for key, leaf in leaves.items():
        expected = full_leaves[key].grad
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        if inputs[key].cut == "seq":
            expected = place.cut(expected)
        else:  # a replicated parameter: the ranks' gradients summed are the unsplit one
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        size = expected[torch.isfinite(expected)].abs().max().item() if expected.numel() else 0.0
        assert_close(grad, expected.to(grad.dtype), atol=(atol + grad_rtol / 8) * size, rtol=grad_rtol,
                     what=f"{name} d_{key}")


# --- DTensor: Shard(1) logits -------------------------------------------------------------------------------------

def run_dtensor(world, rank, group, dtype, backend):
    """``Shard(1)`` DTensor logits, labels and per-token inputs on a 1-D mesh: bitwise the ``sequence_group=`` call
    on the local tensors (``torch.chunk``'s slices), and the unsplit float64 values and gradients."""
    import torch.distributed.tensor as dt
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    inputs = _padded_inputs(5)
    inputs.update(_loss_rows(5))
    chunk = -(-T // world)
    start, stop = min(rank * chunk, T), min((rank + 1) * chunk, T)
    where = Where(start, stop, 1)

    def calls(t, kw):
        logp = kltriton.token_logprobs(t["logits"], t["ids"], mask=t["mask"], shift_labels=True, **kw)
        out = kltriton.policy_loss(t["logits"], t["ids"], t["adv_seq"], old_logprobs=t["old"], ref=t["ref"],
                                   kl_coef=0.1, loss_type="gspo", mask=t["mask"], shift_labels=True, **kw)
        return logp, out.loss, out.ratio, out.metrics["clipfrac"]

    full = {k: v.value.double() if v.logits else v.value for k, v in inputs.items()}
    full["logits"].requires_grad_()
    expected = calls(full, {"backend": "reference"})
    as_dtensor = {k: (dt.distribute_tensor(v.value.to(dtype) if v.logits else v.value, mesh,
                                           [dt.Shard(1) if v.cut == "seq" else dt.Replicate()]))
                  for k, v in inputs.items()}
    as_dtensor["logits"].requires_grad_()
    got = calls(as_dtensor, {"backend": backend})
    local = {k: where.cut(v.value.to(dtype) if v.logits else v.value).clone() if v.cut == "seq" else v.value
             for k, v in inputs.items()}
    local["logits"].requires_grad_()
    by_group = calls(local, {"backend": backend, "sequence_group": group})
    for outputs, split in ((expected, False), (got, True), (by_group, True)):
        gen = _gen(3)
        upstream = torch.randn(B, T, generator=gen, dtype=torch.float64)
        upstream = where.cut(upstream) if split else upstream
        (outputs[0] * upstream.to(outputs[0].dtype)).sum().add(outputs[1] * 0.7).backward()
    assert type(as_dtensor["logits"].grad).__name__ == "DTensor"
    assert tuple(as_dtensor["logits"].grad.placements) == (dt.Shard(1),)
    grad = as_dtensor["logits"].grad.to_local()
    assert torch.equal(grad, local["logits"].grad), "DTensor gradient not bitwise the sequence_group= call's"
    atol, rtol, grad_rtol = _tolerances(inputs, dtype)
    for i, (a, b, e) in enumerate(zip(got, by_group, expected)):
        assert type(a) is torch.Tensor, f"output {i} is a {type(a).__name__}"
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"output {i} not bitwise the sequence_group= call's"
        e = e.detach() if e.dim() == 0 else where.cut(e.detach())
        assert_close(a.detach(), e, atol=atol * (1 + e.abs().max().item()), rtol=rtol, what=f"dtensor output {i}")
    expected_grad = where.cut(full["logits"].grad)
    size = expected_grad[torch.isfinite(expected_grad)].abs().max().item()
    assert_close(grad, expected_grad.to(grad.dtype), atol=(atol + grad_rtol / 8) * size, rtol=grad_rtol,
                 what="dtensor gradient")


# --- errors -------------------------------------------------------------------------------------------------------

def run_errors(world, rank, group, dtype, backend):
    """Every rank raises the same clear error, before or at the same collective (none hangs)."""
    logits = torch.randn(2, 3, V)
    labels = torch.randint(0, V, (2, 3))
    raises_with(lambda: kltriton.policy_loss(logits, labels, torch.randn(2), loss_type="clip_cov", sequence_group=group),
           "sequence_group")
    rows = 2 if rank == 0 else 3  # rank 0 holds other sequences than the rest: refused on every rank
    raises_with(lambda: kltriton.token_logprobs(torch.randn(rows, 3, V), torch.randint(0, V, (rows, 3)),
                                           sequence_group=group), "same sequences")
    raises_with(lambda: kltriton.token_logprobs(torch.randn(5, V), torch.randint(0, V, (5,)), sequence_group=group,
                                           cu_seqlens=torch.tensor([0, 5])), "every rank's packed tokens")
    raises_with(lambda: kltriton.token_logprobs(logits, labels, sequence_group="cp"), "ProcessGroup")


# --- context x vocab parallel (4 ranks: 2 x 2) ------------------------------------------------------------------

def run_context_and_vocab(world, rank, group, dtype, backend):
    """Ranks ``(c, v)`` of a ``(2, 2)`` mesh: the sequence split over ``c`` (``sequence_group``) and the vocabulary
    over ``v`` (``process_group``), or the same as a DTensor ``[Shard(1), Shard(2)]``: the unsplit values; each
    rank's gradient is the unsplit gradient's block."""
    import torch.distributed.tensor as dt
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp, tp = mesh.get_group(0), mesh.get_group(1)
    c, v = mesh.get_local_rank(0), mesh.get_local_rank(1)
    inputs = _padded_inputs(9)
    inputs.update(_loss_rows(9))
    seq = Where(*((0, 6) if c == 0 else (6, T)), 1)  # torch.chunk of 11 over 2: 6 + 5
    cols = slice(0, 34) if v == 0 else slice(34, V)  # torch.chunk of 67 over 2: 34 + 33

    def calls(t, kw):
        out = kltriton.policy_loss(t["logits"], t["ids"], t["adv_token"], old_logprobs=t["old"], ref=t["ref"],
                                   kl_coef=0.1, entropy_coef=0.01, loss_type="grpo", mask=t["mask"],
                                   shift_labels=True, temperature=TEMPERATURE, **kw)
        return out.loss, out.logprobs, out.metrics["entropy_mean"]

    full = {k: (v_.value.double() if v_.logits else v_.value) for k, v_ in inputs.items()}
    full["logits"].requires_grad_()
    expected = calls(full, {"backend": "reference"})
    local = {k: (seq.cut(v_.value.to(dtype) if v_.logits else v_.value) if v_.cut == "seq" else v_.value)
             for k, v_ in inputs.items()}
    local["logits"] = local["logits"][..., cols].clone().requires_grad_()
    local["ref"] = local["ref"][..., cols]
    by_groups = calls(local, {"backend": backend, "sequence_group": cp, "process_group": tp})
    placements = {"seq": [dt.Shard(1), dt.Replicate()], "whole": [dt.Replicate(), dt.Replicate()]}
    as_dtensor = {k: dt.distribute_tensor(v_.value.to(dtype) if v_.logits else v_.value, mesh,
                                          [dt.Shard(1), dt.Shard(2)] if v_.logits else placements[v_.cut])
                  for k, v_ in inputs.items()}
    as_dtensor["logits"].requires_grad_()
    got = calls(as_dtensor, {"backend": backend})
    for outputs, split in ((expected, False), (by_groups, True), (got, True)):
        upstream = torch.randn(B, T, generator=_gen(4), dtype=torch.float64)
        upstream = seq.cut(upstream) if split else upstream
        (outputs[1] * upstream.to(outputs[1].dtype)).sum().add(outputs[0] * 0.9).backward()
    atol, rtol, grad_rtol = _tolerances(inputs, dtype)
    for i, (a, b, e) in enumerate(zip(got, by_groups, expected)):
        assert torch.equal(a, b), f"output {i}: the DTensor call is not bitwise the process groups' call"
        e = e.detach() if e.dim() == 0 else seq.cut(e.detach())
        assert_close(a.detach(), e, atol=atol * (1 + e.abs().max().item()), rtol=rtol, what=f"2x2 output {i}")
    expected_grad = seq.cut(full["logits"].grad)[..., cols]
    assert torch.equal(as_dtensor["logits"].grad.to_local(), local["logits"].grad)
    size = expected_grad[torch.isfinite(expected_grad)].abs().max().item()
    assert_close(local["logits"].grad, expected_grad.to(dtype), atol=(atol + grad_rtol / 8) * size, rtol=grad_rtol,
                 what="2x2 gradient")

    # A tensor-parallel LM head (weight Shard(0) over tp) on hidden states split over cp (Shard(1), Replicate).
    gen = _gen(12)
    hidden_full, weight_full = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) / 2
    hidden64, weight64 = hidden_full.double().requires_grad_(), weight_full.double().requires_grad_()
    hidden = dt.distribute_tensor(hidden_full.to(dtype), mesh, [dt.Shard(1), dt.Replicate()]).requires_grad_()
    weight = dt.distribute_tensor(weight_full.to(dtype), mesh, [dt.Replicate(), dt.Shard(0)]).requires_grad_()
    head = {"logits": kltriton.LinearLogits(hidden, weight), "ids": as_dtensor["ids"], "mask": as_dtensor["mask"],
            "adv_token": as_dtensor["adv_token"], "old": as_dtensor["old"], "ref": None}
    head_full = dict(full, logits=kltriton.LinearLogits(hidden64, weight64), ref=None)

    def head_calls(t, kw):
        out = kltriton.policy_loss(t["logits"], t["ids"], t["adv_token"], old_logprobs=t["old"], loss_type="gspo",
                                   mask=t["mask"], shift_labels=True, **kw)
        return out.loss, out.ratio

    expected, got = head_calls(head_full, {"backend": "reference"}), head_calls(head, {"backend": backend})
    for outputs, split in ((expected, False), (got, True)):
        upstream = torch.randn(B, T, generator=_gen(5), dtype=torch.float64)
        upstream = seq.cut(upstream) if split else upstream
        (outputs[1] * upstream.to(outputs[1].dtype)).sum().add(outputs[0] * 0.9).backward()
    assert_close(got[0].detach(), expected[0].detach(), atol=atol * 10, rtol=rtol, what="2x2 head loss")
    assert_close(got[1], seq.cut(expected[1]), atol=atol * 10, rtol=rtol, what="2x2 head ratio")
    assert tuple(weight.grad.placements) == (dt.Replicate(), dt.Shard(0))
    # the weight gradient: this rank's vocabulary rows, summed over the sequence group (what a trainer reduces)
    weight_grad = weight.grad.to_local().clone()
    dist.all_reduce(weight_grad, group=cp)
    hidden_grad = hidden.grad.to_local()
    for got_grad, expected_grad, what in ((weight_grad, weight64.grad[cols], "weight"),
                                          (hidden_grad, seq.cut(hidden64.grad), "hidden")):
        size = expected_grad.abs().max().item()
        assert_close(got_grad, expected_grad.to(got_grad.dtype), atol=(atol + grad_rtol / 8) * size * 10,
                     rtol=grad_rtol, what=f"2x2 head d_{what}")


# --- the spawned worlds -------------------------------------------------------------------------------------------

def _runs(world):
    """``(key, function)`` of every case a world runs, in the same order on every rank."""
    runs = []
    if world == 4:
        runs.append(("context_and_vocab", run_context_and_vocab))
    else:
        runs += [(f"case-{name}", lambda w, r, g, d, b, name=name: run_case(name, w, r, g, d, b)) for name in CASES]
        runs += [("dtensor", run_dtensor), ("errors", run_errors)]
    return runs


def _worker(rank, world, init_file, report_dir, backend):
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD
    report = {}
    try:
        for key, run in _runs(world):
            for dtype, name in ((torch.float32, backend), (torch.float64, "reference")):
                record(report, f"{key}-{str(dtype)[6:]}", run, world, rank, group, dtype, name)
    finally:
        close_rank(report_dir, rank, report)
    exit_rank()  # every case ran


_REPORTS = {}


def _reports(world):
    if world not in _REPORTS:
        from kltriton import dispatch

        backend = "cpp" if dispatch.availability("cpp", "stream")[0] else "reference"
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, backend), nprocs=world)
            reports = []
            for rank in range(world):
                with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                    reports.append(json.load(f))
        _REPORTS[world] = reports
    return _REPORTS[world]


def _check(world, key):
    reports = _reports(world)
    keys = [k for k in reports[0] if k.rsplit("-", 1)[0] == key]
    assert keys, f"{key} did not run on {world} ranks"
    failures = [f"rank {r} {k}:\n{rep.get(k)}" for r, rep in enumerate(reports) for k in keys if rep.get(k) != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("key", [f"case-{name}" for name in CASES] + ["dtensor", "errors"])
def test_context_parallel_equals_unsplit(world, key):
    _check(world, key)


def test_context_and_vocab_parallel_together():
    _check(4, "context_and_vocab")
