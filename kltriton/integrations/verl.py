"""verl (tested with 0.9.1): its log-prob and entropy helpers run on kltriton's fused kernels.

``apply()`` replaces, in ``verl.utils.torch_functional`` and in every loaded verl module that imported
them by name (and in those imported later):

- ``logprobs_from_logits(logits, labels, inplace_backward=True)``: ``kltriton.token_logprobs``.
  ``inplace_backward`` (flash-attn's option to write the gradient into the logits) is accepted and
  ignored: kltriton never writes into its inputs.
- ``entropy_from_logits(logits)`` and ``entropy_from_logits_with_chunking(logits, chunk_size)``: the
  entropy from the same streaming pass (no ``[N, V]`` softmax, so no chunking is needed).

Both return fp32 whatever the logits' dtype (verl returns the logits' dtype for bf16 logits).

What stays verl's, and why: ``core_algos.kl_penalty``, ``agg_loss`` and the registered policy losses
receive log-probs, never logits, so there is no vocab pass left for kltriton to fuse; they run on the
log-probs kltriton produced, and their gradient flows back through kltriton's backward. The tests check
that kltriton's ``token_kl`` (every verl KL name) and ``policy_loss`` give verl's values and gradients.

Distillation (``verl/trainer/distillation``):

- ``fsdp.losses.compute_forward_kl_topk``, the ``forward_kl_topk`` loss's logits processor: the per-token loss by
  ``kltriton.token_divergence`` with a ``kltriton.TopK`` teacher (``tail="none"``: verl's sum over the top-k ids
  without a tail, ``min_logprob`` its ``log_prob_min_clamp``), i.e. the student's streamed log-sum-exp and a
  ``K``-column gather instead of a ``[N, V]`` ``log_softmax``; the diagnostics (student / teacher top-k mass,
  overlap) from the student's logits without gradient, as verl does. verl's own with Ulysses sequence parallelism
  (its slicing), with a log line. Megatron's vocab-parallel version is not patched (it needs Megatron's groups).
- the estimator losses registered under ``kl``, ``k1``, ``abs``, ``mse``, ``k2``, ``low_var_kl``, ``k3``
  (``register_distillation_loss``): ``get_distillation_loss_fn`` returns kltriton's, which scores the student's
  log-probs against the teacher's with ``kltriton.estimators`` (verl's ``kl_penalty`` names and clamp). They
  receive log-probs, so there is no vocab pass to fuse: the log-probs come from kltriton's
  ``logprobs_from_logits`` above.

``undo()`` (or leaving ``with apply():``) restores verl's functions everywhere.
"""
import logging

import torch

import kltriton
from kltriton import dropins, estimators
from kltriton.integrations._patch import Integration, Patch

logger = logging.getLogger(__name__)



def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl's ``logprobs_from_logits`` on kltriton: fp32 log-prob of ``labels`` (every position scored)."""
    return dropins.logprobs_of_labels(logits, labels)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits`` on kltriton: fp32 entropy of ``softmax(logits)``, differentiable."""
    return dropins.entropy_from_logits(logits)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl's chunked entropy on kltriton; ``chunk_size`` is accepted and not needed."""
    return dropins.entropy_from_logits(logits)


def _install(patch: Patch) -> None:
    """Make verl compute log-probs and entropy with kltriton."""
    import verl.utils.torch_functional as verl_F

    patch.swap("verl", patch.resolve(verl_F, "logprobs_from_logits"), logprobs_from_logits)
    patch.swap("verl", patch.resolve(verl_F, "entropy_from_logits"), entropy_from_logits)
    patch.swap("verl", patch.resolve(verl_F, "entropy_from_logits_with_chunking"), entropy_from_logits_with_chunking)
    _install_distillation(patch)


# ---------------------------------------------------------------------------------------------- distillation
ESTIMATOR_LOSSES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
K3_CLAMP = 10.0  # verl's kl_penalty clamps k3 to [-10, 10] (and its log-ratio to [-20, 20], which never binds first)
DIAGNOSTIC_CHUNK = 1 << 22  # logits per chunk of the no-gradient diagnostics


def _install_distillation(patch: Patch) -> None:
    import verl.trainer.distillation.fsdp.losses as fsdp_losses
    import verl.trainer.distillation.losses as losses
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

    _logged.clear()  # each apply() logs each route once
    verl_get_fn = patch.resolve(losses, "get_distillation_loss_fn")
    verl_topk = patch.resolve(fsdp_losses, "compute_forward_kl_topk")

    def get_distillation_loss_fn(loss_name):
        if loss_name in ESTIMATOR_LOSSES:
            return estimator_distillation_loss
        return verl_get_fn(loss_name)

    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        if get_ulysses_sequence_parallel_world_size() > 1:
            _log_once("forward_kl_topk: verl's own, because Ulysses sequence parallelism slices the teacher's top-k")
            return verl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        _log_once("forward_kl_topk: kltriton.token_divergence with a TopK teacher")
        return forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids,
                               config.distillation_loss.log_prob_min_clamp)

    patch.swap("verl", verl_get_fn, get_distillation_loss_fn)
    patch.set(fsdp_losses, "compute_forward_kl_topk", compute_forward_kl_topk)


_logged = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("kltriton: %s", message)


def estimator_distillation_loss(config, distillation_config, model_output, data):
    """verl's ``compute_distillation_loss_reverse_kl_estimator`` on ``kltriton.estimators``: ``(losses [B, T],
    metrics)`` of the student's log-probs against the teacher's, with verl's metric."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    student = no_padding_2_padding(model_output["log_probs"], data)
    teacher = no_padding_2_padding(data["teacher_logprobs"], data).squeeze(-1)
    mask = data["response_mask"]
    mask = (mask.bool().to_padded_tensor(False) if mask.is_nested else mask.bool())
    name = distillation_config.distillation_loss.loss_mode
    estimator = estimators.parse(name, ref_logits=False)
    losses = estimator.value(student, teacher, kl_clamp=K3_CLAMP if estimator.base == "k3" else None)
    return losses, {"distillation/abs_loss": Metric(AggregationType.MEAN, losses[mask].abs().mean())}


def forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp):
    """verl's ``fsdp.losses.compute_forward_kl_topk`` by ``kltriton.token_divergence``: the same dict of ``[1, nnz]``
    tensors (``distillation_losses`` differentiable w.r.t. ``student_logits``, the diagnostics without gradient)."""
    teacher_lp = teacher_topk_log_probs.values().unsqueeze(0) if teacher_topk_log_probs.is_nested         else teacher_topk_log_probs
    ids = teacher_topk_ids.values().unsqueeze(0) if teacher_topk_ids.is_nested else teacher_topk_ids
    scored = torch.zeros(student_logits.shape[:-1], dtype=torch.long, device=student_logits.device)
    teacher = kltriton.TopK(ids.long(), teacher_lp, min_logprob=log_prob_min_clamp)
    losses = kltriton.token_divergence(student_logits, teacher, scored, divergence="forward_kl", tail="none")
    with torch.no_grad():
        student_lp, student_ids = _topk_diagnostics(student_logits, ids.long())
        clamped_student, clamped_teacher = student_lp, teacher_lp.float()
        if log_prob_min_clamp is not None:
            clamped_student = clamped_student.clamp_min(log_prob_min_clamp)
            clamped_teacher = clamped_teacher.clamp_min(log_prob_min_clamp)
        overlap = (ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(-1)
        overlap_count = overlap.sum(-1)
        token_kl = clamped_teacher.exp() * (clamped_teacher - clamped_student)
        advantage = (-token_kl * overlap).sum(-1) / overlap_count.clamp_min(1)
        return {
            "distillation_losses": losses,
            "student_mass": student_lp.exp().sum(-1),
            "teacher_mass": teacher_lp.float().exp().sum(-1),
            "overlap_count": overlap_count,
            "overlap_token_advantage": torch.where(overlap_count > 0, advantage, torch.zeros_like(advantage)),
        }


def _topk_diagnostics(student_logits, ids):
    """``(log-probs at ids, the student's own top-k ids)`` ``[..., K]`` without gradient, in row chunks (no ``[N, V]``
    fp32 temporary)."""
    vocab, k = student_logits.shape[-1], ids.shape[-1]
    rows, flat_ids = student_logits.detach().reshape(-1, vocab), ids.reshape(-1, k)
    logp = torch.empty(flat_ids.shape, dtype=torch.float32, device=rows.device)
    own = torch.empty_like(flat_ids)
    step = max(1, DIAGNOSTIC_CHUNK // vocab)
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step].float()
        logp[start:start + step] = chunk.gather(-1, flat_ids[start:start + step]) - chunk.logsumexp(-1, keepdim=True)
        own[start:start + step] = torch.topk(chunk, k, dim=-1).indices
    return logp.view(ids.shape), own.view(ids.shape)


_integration = Integration("verl", _install, package="verl", extra="verl", tested="0.9.1")
apply = _integration.apply
undo = _integration.undo
