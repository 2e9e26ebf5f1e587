"""The route table: how a public op's logits reach a kernel family. The one module that decides it.

Statistics (``token_logprobs``, ``token_kl``, ``fused_kl_reward``, ``policy_loss``'s two-pass route):

| logits (policy or reference)         | vocab-sharded | route                                            |
|--------------------------------------|---------------|--------------------------------------------------|
| tensors                              | no            | ``ops.stream.stream_forward`` (family ``stream``)  |
| tensors                              | yes           | ``parallel.shard_stream``                        |
| a ``LinearLogits`` on either side    | no            | ``ops.linear.linear_forward`` (family ``linear``)  |
| a ``LinearLogits`` on either side    | yes           | ``parallel.shard_linear``                        |

``policy_loss`` (``loss_route``): ``"fused"`` (the ``loss`` family: the gradient written in the forward,
``ops.loss.loss_forward`` for tensors, ``ops.loss.linear_loss_forward`` for a ``LinearLogits`` policy) unless
the loss needs whole sequences before any row's derivative (a sequence-level loss type, or on-policy rollout
importance sampling), the logits are vocab-sharded (the derivative needs the global statistics first), or the
policy is a tensor with a ``LinearLogits`` reference; then ``"two-pass"``: the statistics route above, the
formulas in PyTorch, and autograd (the logits are read again in the backward).

Truncated statistics (``truncation=``, the policy side; ``truncated_statistics``):

| truncation | logits           | vocab-sharded | route                                                          |
|------------|------------------|---------------|----------------------------------------------------------------|
| recompute  | tensors          | no            | ``ops.truncation.truncated_forward`` (floor and statistics per row) |
| recompute  | tensors          | yes           | ``parallel.shard_truncated`` (floor by all-reduced counts / masses) |
| recompute  | ``LinearLogits`` | either        | ``kernels.truncation.linear``: tiles of rows, each the tensor route |
| replay     | tensors          | either        | ``kernels.truncation.replay``: a K-column gather (summed over ranks) |
| replay     | ``LinearLogits`` | either        | ``kernels.truncation.replay``: only the K columns projected      |

A ``policy_loss`` with a truncation is two-pass.

``token_divergence`` (distillation), by teacher:

| teacher                              | divergence        | route                                                      |
|--------------------------------------|-------------------|------------------------------------------------------------|
| logits / ``LinearLogits``            | forward / reverse | the statistics route (``forward_kl`` / ``full_kl``)        |
| logits / ``LinearLogits``            | JSD               | the statistics route for both ``lse``, then the JSD pass:  |
|                                      |                   | ``ops.divergence.(linear_)jsd_forward`` / ``parallel.shard_jsd`` |
| ``TopK``                             | any               | the student's ``lse`` (statistics route), then its ``K`` columns: |
|                                      |                   | ``ops.divergence.(linear_)column_logprobs`` / ``parallel.shard_columns`` |

With a reduction (``divergence_route``), a dense teacher and no vocab sharding, the loss is ``"fused"``:
``ops.divergence.(linear_)divergence_loss`` writes its gradient in the forward (the policy-loss rule: not for a
tensor student with a ``LinearLogits`` teacher); otherwise ``"two-pass"``: the routes above and autograd.

``parallel`` (vocab-parallel) is imported here only.
"""
from typing import Optional

import torch

from kltriton import dispatch, parallel
from kltriton.front_door import Call
from kltriton.kernels import OUT_OF_RANGE
from kltriton.kernels import statistics as stats_table
from kltriton.kernels.divergence import KINDS, composed
from kltriton.kernels.linear import Side
from kltriton.kernels.loss import terms
from kltriton.kernels.statistics import StreamStats
from kltriton.kernels.truncation import linear as truncation_linear
from kltriton.kernels.truncation import replay
from kltriton.ops import divergence as divergence_ops
from kltriton.ops import linear, loss, stream
from kltriton.ops import truncation as truncation_ops

NO_SIDE = Side(None, None, None, None, None)


def family(call: Call) -> str:
    """The kernel family of the call's statistics: ``linear`` when a side is an LM head, else ``stream``."""
    return "linear" if call.projected else "stream"


def backend(call: Call, family_name: Optional[str] = None) -> str:
    """The backend that runs ``family_name`` (default: ``family(call)``) on the call's device."""
    return dispatch.resolve(call.backend, family_name or family(call), call.device.type, call.dtype == torch.float64)


def _with_grad(side: Side):
    """Which of the side's hidden states (or logits), weight and bias autograd wants a gradient for."""
    return [torch.is_grad_enabled() and t is not None and t.requires_grad for t in side[:3]]


def statistics(call: Call, wanted: int) -> StreamStats:
    """``StreamStats`` (``[N]``) of the call's policy (and reference, no gradient) at its targets, differentiable
    w.r.t. the policy's logits or hidden states, weight and bias. With a truncation, of the policy's truncated
    distribution (``truncated_statistics``; the reference is then scored by ``reference_statistics``)."""
    if call.truncation is not None:
        return truncated_statistics(call._replace(ref=None), wanted)
    name, target, temperature, shard = backend(call), call.layout.target, call.temperature, call.shard
    if call.projected:
        ref = call.ref if call.ref is not None else NO_SIDE
        if shard is not None:
            return parallel.shard_linear(call.policy, ref, target, temperature, wanted, call.tile_elements, name,
                                         shard)
        return StreamStats(*linear.linear_forward(*call.policy, *ref, target, temperature, wanted, call.tile_elements,
                                                  name))
    logits, ref_logits = call.policy.x, None if call.ref is None else call.ref.x
    if shard is not None:
        return parallel.shard_stream(logits, ref_logits, target, temperature, wanted, name, shard)
    return StreamStats(*stream.stream_forward(logits, ref_logits, target, temperature, wanted, name))


def reference_statistics(call: Call, wanted: int) -> StreamStats:
    """``statistics`` of the reference side alone (its own pass, no gradient)."""
    with torch.no_grad():
        return statistics(call._replace(policy=call.ref, ref=None, truncation=None), wanted)


def loss_route(call: Call, loss_type: str, whole_sequences: bool) -> str:
    """``"fused"`` or ``"two-pass"`` for ``policy_loss`` (see the module docstring). ``whole_sequences``: the
    loss's per-row inputs need the whole sequences' new log-probs (on-policy rollout importance sampling)."""
    fused = (loss_type in terms.FUSED and not whole_sequences and call.shard is None and call.truncation is None
             and (call.policy.weight is not None or call.ref is None or call.ref.weight is None))
    return "fused" if fused else "two-pass"


def fused_loss(call: Call, inputs, hp, loss_type, estimator: str, entropy_grad: bool, with_entropy: bool = True,
               entropy_quantile: Optional[float] = None):
    """``(loss, StreamStats, threshold)`` of the ``loss`` family, the gradient written in the forward: tensors
    through ``ops.loss.loss_forward``, a ``LinearLogits`` policy through ``ops.loss.linear_loss_forward`` (only
    what requires grad gets a gradient). ``entropy_quantile``: TRL's entropy mask (``threshold`` its quantile,
    else NaN)."""
    target, temperature = call.layout.target, call.temperature
    quantile = None if entropy_quantile is None else torch.ones((), dtype=torch.float64,
                                                                device=target.device) * entropy_quantile
    if call.policy.weight is not None:
        ref = call.ref if call.ref is not None else NO_SIDE
        out = loss.linear_loss_forward(*call.policy, *ref, target, temperature, *inputs, hp, loss_type, estimator,
                                       entropy_grad, *_with_grad(call.policy), call.tile_elements, with_entropy,
                                       quantile, backend(call))
        return out[0], StreamStats(*out[1:-4]), out[-4]
    logits = call.policy.x
    out = loss.loss_forward(logits, None if call.ref is None else call.ref.x, target, temperature, *inputs, hp,
                            loss_type, estimator, entropy_grad, _with_grad(call.policy)[0], with_entropy, quantile,
                            backend(call, "loss"))
    return out[0], StreamStats(*out[1:-2]), out[-2]


def truncated_statistics(call: Call, wanted: int) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``wanted`` asks) of the truncated distribution of the
    call's policy (a tensor or an LM head, local or a vocab shard) at its targets. Differentiable like
    ``statistics``."""
    layout, device, shard, side = call.layout, call.device, call.shard, call.policy
    target, temperature, vocab = layout.target, call.temperature, call.vocab
    group = None if shard is None else shard.group
    truncation = call.truncation
    if truncation.replay:
        kept = replay.support(truncation.support_rows(layout.shape, device, vocab))
        ids, own = kept.ids, kept.valid
        if shard is not None:
            local = ids - shard.start
            own = own & (local >= 0) & (local < shard.size)
            ids = torch.where(own, local, torch.zeros_like(local))
        if side.weight is not None:
            if group is not None:
                side = side._replace(x=parallel.replicated(side.x, group))
            values = replay.project(side, ids, call.tile_elements)
        else:
            values = replay.gather(side.x, ids)
        if group is not None:
            values = parallel.sum_over_ranks(torch.where(own, values, torch.zeros_like(values)), group)
        here, column = replay.label_in(kept, target)
        label_value = values.gather(1, column[:, None]).squeeze(1)
        return replay.statistics_of(values, kept.valid, here, label_value, target, temperature, wanted)
    knobs = truncation.row_knobs(layout.shape, layout.num_seqs, layout.seq_index, device, vocab)
    name = backend(call, "truncation")

    def dense(rows, row_target, row_temperature, row_knobs):
        if shard is not None:
            return parallel.shard_truncated(rows, row_target, row_temperature, row_knobs, wanted, name, shard)
        return truncation_ops.truncated_forward(rows, row_target, row_temperature, row_knobs, None, wanted, name)[1]

    if side.weight is None:
        return dense(side.x, target, temperature, knobs)
    if group is not None:
        side = side._replace(x=parallel.replicated(side.x, group))

    def tile(rows, start, stop):
        row_temperature = temperature if temperature.dim() == 0 else temperature[start:stop]
        return dense(rows, target[start:stop], row_temperature, type(knobs)(*(k[start:stop] for k in knobs)))

    # Every rank must cut the rows into the same tiles (their floors take collectives): the widest shard decides.
    local_width = side.weight.shape[0]
    width = local_width if group is None else parallel.widest_shard(local_width, device, group)
    tile_rows = max(1, call.tile_elements // width)
    return truncation_linear.statistics(side, tile, tile_rows)


# --- distillation -----------------------------------------------------------------------------------------------

def divergence_route(call: Call, reduction: str) -> str:
    """``"fused"`` or ``"two-pass"`` for ``token_divergence`` (see the module docstring)."""
    fused = (reduction != "none" and call.topk is None and call.shard is None
             and (call.policy.weight is not None or call.ref.weight is None))
    return "fused" if fused else "two-pass"


def divergence(call: Call, kind: str, beta, entropy: bool):
    """``(divergence [N], entropy)`` of a dense teacher (logits or an LM head), differentiable w.r.t. the
    student; ``entropy`` the student's (``[0]`` unless asked for). ``kind``: a name of ``kernels.divergence.KINDS``."""
    stat = KINDS[kind]
    stats = statistics(call, composed.wanted(kind, entropy))
    if stat is not None:
        return getattr(stats, stat), stats.entropy
    lse, ref_lse = stats.lse.detach(), stats.ref_lse.detach()
    target, temperature, shard, name = call.layout.target, call.temperature, call.shard, backend(call)
    if shard is not None:  # a label that no shard holds: NaN, as the statistics give it
        target = torch.where((target >= 0) & torch.isnan(stats.logp.detach()), OUT_OF_RANGE, target)
    if call.projected:
        if shard is not None:
            jsd, _ = parallel.shard_jsd(call.policy, call.ref, target, temperature, lse, ref_lse, beta,
                                        call.tile_elements, name, shard)
        else:
            jsd, _ = divergence_ops.linear_jsd_forward(*call.policy, *call.ref, target, temperature, lse, ref_lse,
                                                       beta, call.tile_elements, name)
    elif shard is not None:
        jsd, _ = parallel.shard_jsd(call.policy.x, call.ref.x, target, temperature, lse, ref_lse, beta, None, name,
                                    shard)
    else:
        jsd, _ = divergence_ops.jsd_forward(call.policy.x, call.ref.x, target, temperature, lse, ref_lse, beta, name)
    return jsd, stats.entropy


def divergence_loss(call: Call, kind: str, beta, weight, entropy: bool):
    """``(loss, divergence [N], entropy)`` of the ``"fused"`` route: ``sum weight * divergence`` with the student's
    gradient written in the forward (only what requires grad gets one)."""
    target, temperature = call.layout.target, call.temperature
    if call.policy.weight is not None:
        out = divergence_ops.linear_divergence_loss(*call.policy, *call.ref, target, temperature, weight, kind, beta,
                                                    entropy, *_with_grad(call.policy), call.tile_elements,
                                                    backend(call))
        return out[:3]
    out = divergence_ops.divergence_loss(call.policy.x, call.ref.x, target, temperature, weight, kind, beta, entropy,
                                         _with_grad(call.policy)[0], backend(call, "divergence"))
    return out[:3]


def columns(call: Call, ids, entropy: bool):
    """``(column log-probs [N, K], entropy)``: ``log softmax(student / T)`` at ``ids [N, K]`` (global ids, ``-1``
    padding: ``-inf``; 0 on unscored rows), differentiable w.r.t. the student, from its ``lse`` and its logits at
    the ids; ``entropy`` the student's (``[0]`` unless asked for). An LM head: one pass over the GEMM tiles
    gathers the columns (vocab-sharded: the statistics route, then a ``K``-column gather of the LM head rows);
    logits: the statistics route, then a ``K``-column gather."""
    target, temperature, shard, name = call.layout.target, call.temperature, call.shard, backend(call)
    side = call.policy
    if side.weight is not None and shard is None:
        logp, _, student_entropy = divergence_ops.linear_column_logprobs(*side, ids, target, temperature, entropy,
                                                                         call.tile_elements, name)
        return logp, student_entropy
    stats = statistics(call, stats_table.request(entropy=entropy))
    lse = stats.lse.detach()
    if shard is not None:
        return parallel.shard_columns(side, ids, target, temperature, lse, call.tile_elements, name, shard), \
            stats.entropy
    return divergence_ops.column_logprobs(side.x, ids, target, temperature, lse, call.tile_elements, name), \
        stats.entropy
