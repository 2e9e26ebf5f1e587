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
from typing import Optional, Tuple

import torch

from kltriton import dispatch, parallel
from kltriton.kernels import OUT_OF_RANGE
from kltriton.kernels import statistics as stats_table
from kltriton.kernels.divergence import KINDS, composed
from kltriton.kernels.linear import Side
from kltriton.kernels.linear.tiles import default_tile_elements
from kltriton.kernels.loss import terms
from kltriton.kernels.statistics import StreamStats
from kltriton.linear_logits import LinearLogits, is_linear
from kltriton.kernels.truncation import linear as truncation_linear
from kltriton.kernels.truncation import replay
from kltriton.ops import divergence as divergence_ops
from kltriton.ops import linear, loss, stream
from kltriton.ops import truncation as truncation_ops

NO_SIDE = Side(None, None, None, None, None)


def family(logits, ref=None) -> str:
    """The kernel family of the statistics of ``logits`` and ``ref`` (tensors or ``LinearLogits``)."""
    return "linear" if is_linear(logits) or is_linear(ref) else "stream"


def backend(name: Optional[str], logits, ref=None, family_name: Optional[str] = None) -> str:
    """The backend that runs ``family_name`` (default: ``family(logits, ref)``) on these logits' device."""
    return dispatch.resolve(name, family_name or family(logits, ref), logits.device.type,
                            logits.dtype == torch.float64)


def shard(logits, process_group, vocab_start) -> Optional[parallel.VocabShard]:
    """This rank's vocab shard (``kltriton.parallel.vocab_shard``), or None without a process group."""
    return parallel.vocab_shard(logits, process_group, vocab_start)


def _side(logits, detach: bool = False) -> Side:
    side = logits.side() if isinstance(logits, LinearLogits) else Side(logits, None, None, None, None)
    return Side(*(None if t is None else t.detach() for t in side)) if detach else side


def linear_sides(logits, ref_logits) -> Tuple[Side, Side, int]:
    """``(policy, ref, tile_elements)`` for the ``linear`` family: each side a ``Side`` (the reference
    detached; ``NO_SIDE`` without one) and the working-tile budget of the ``LinearLogits`` among them."""
    lin = logits if is_linear(logits) else ref_logits
    ref = _side(ref_logits, detach=True) if ref_logits is not None else NO_SIDE
    return _side(logits), ref, lin.tile_elements or default_tile_elements(lin.device.type)


def statistics(logits, ref_logits, target, temperature, wanted: int, backend_name: str,
               vocab_shard: Optional[parallel.VocabShard] = None) -> StreamStats:
    """``StreamStats`` (``[N]``) of ``logits`` (and ``ref_logits``, no gradient) at ``target``, differentiable
    w.r.t. the policy's logits or hidden states, weight and bias; ``backend_name`` from ``backend``."""
    if family(logits, ref_logits) == "linear":
        policy, ref, tile = linear_sides(logits, ref_logits)
        if vocab_shard is not None:
            return parallel.shard_linear(policy, ref, target, temperature, wanted, tile, backend_name, vocab_shard)
        return StreamStats(*linear.linear_forward(*policy, *ref, target, temperature, wanted, tile, backend_name))
    ref_logits = None if ref_logits is None else ref_logits.detach()
    if vocab_shard is not None:
        return parallel.shard_stream(logits, ref_logits, target, temperature, wanted, backend_name, vocab_shard)
    return StreamStats(*stream.stream_forward(logits, ref_logits, target, temperature, wanted, backend_name))


def loss_route(logits, ref, loss_type: str, whole_sequences: bool, vocab_shard) -> str:
    """``"fused"`` or ``"two-pass"`` for ``policy_loss`` (see the module docstring). ``whole_sequences``: the
    loss's per-row inputs need the whole sequences' new log-probs (on-policy rollout importance sampling)."""
    fused = (loss_type in terms.FUSED and not whole_sequences and vocab_shard is None
             and (is_linear(logits) or not is_linear(ref)))
    return "fused" if fused else "two-pass"


def fused_loss(logits, ref_logits, target, temperature, inputs, hp, loss_type, estimator: str, entropy_grad: bool,
               backend_name: Optional[str], with_entropy: bool = True, entropy_quantile: Optional[float] = None):
    """``(loss, StreamStats, threshold)`` of the ``loss`` family, the gradient written in the forward: tensors
    through ``ops.loss.loss_forward``, a ``LinearLogits`` policy through ``ops.loss.linear_loss_forward`` (only
    what requires grad gets a gradient). ``entropy_quantile``: TRL's entropy mask (``threshold`` its quantile,
    else NaN)."""
    quantile = None if entropy_quantile is None else torch.ones((), dtype=torch.float64,
                                                                device=target.device) * entropy_quantile
    if is_linear(logits):
        policy, ref, tile = linear_sides(logits, ref_logits)
        want = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in policy[:3]]
        out = loss.linear_loss_forward(*policy, *ref, target, temperature, *inputs, hp, loss_type, estimator,
                                       entropy_grad, *want, tile, with_entropy, quantile,
                                       backend(backend_name, logits, ref_logits))
        return out[0], StreamStats(*out[1:-4]), out[-4]
    name = backend(backend_name, logits, family_name="loss")
    with_grad = torch.is_grad_enabled() and logits.requires_grad
    out = loss.loss_forward(logits, ref_logits, target, temperature, *inputs, hp, loss_type, estimator, entropy_grad,
                            with_grad, with_entropy, quantile, name)
    return out[0], StreamStats(*out[1:-2]), out[-2]


def truncated_statistics(logits, target, temperature, truncation, layout, wanted: int, backend_name: Optional[str],
                         vocab_shard: Optional[parallel.VocabShard] = None) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``wanted`` asks) of the truncated distribution of
    ``logits`` (a tensor or ``LinearLogits``, local or a vocab shard) at ``target``; ``truncation`` a
    ``kltriton.Truncation``, ``layout`` the call's ``_inputs.Layout``. Differentiable like ``statistics``."""
    device, vocab = logits.device, logits.shape[-1] if vocab_shard is None else vocab_shard.vocab
    group = None if vocab_shard is None else vocab_shard.group
    if truncation.replay:
        name = backend(backend_name, logits, family_name="truncation")
        ids = replay.support(truncation.support_rows(layout.shape, device, vocab), name)
        own = ids if vocab_shard is None else replay.shard_ids(ids, vocab_shard.start, logits.shape[-1])
        if is_linear(logits):
            side = _side(logits)
            if group is not None:
                side = side._replace(x=parallel.replicated(side.x, group))
            values = replay.project(side, own, logits.tile_elements or default_tile_elements(device.type))
        else:
            values = replay.columns(logits, own, name)
        if group is not None:
            values = parallel.sum_over_ranks(values, group)
        return replay.statistics_of(values, ids, target, temperature, wanted, name)
    knobs = truncation.row_knobs(layout.shape, layout.num_seqs, layout.seq_index, device, vocab)

    def dense(rows, row_target, row_temperature, row_knobs):
        name = backend(backend_name, rows, family_name="truncation")
        if vocab_shard is not None:
            return parallel.shard_truncated(rows, row_target, row_temperature, row_knobs, wanted, name, vocab_shard)
        return truncation_ops.truncated_forward(rows, row_target, row_temperature, row_knobs, None, wanted, name)[1]

    if not is_linear(logits):
        return dense(logits, target, temperature, knobs)
    side = _side(logits)
    if group is not None:
        side = side._replace(x=parallel.replicated(side.x, group))

    def tile(rows, start, stop):
        row_temperature = temperature if temperature.dim() == 0 else temperature[start:stop]
        return dense(rows, target[start:stop], row_temperature, type(knobs)(*(k[start:stop] for k in knobs)))

    # Every rank must cut the rows into the same tiles (their floors take collectives): the widest shard decides.
    width = logits.shape[-1] if group is None else parallel.widest_shard(logits.shape[-1], device, group)
    tile_rows = max(1, (logits.tile_elements or default_tile_elements(device.type)) // width)
    return truncation_linear.statistics(side, tile, tile_rows)


# --- distillation -----------------------------------------------------------------------------------------------

def divergence_route(student, teacher, reduction: str, is_topk: bool, vocab_shard) -> str:
    """``"fused"`` or ``"two-pass"`` for ``token_divergence`` (see the module docstring)."""
    fused = (reduction != "none" and not is_topk and vocab_shard is None
             and (is_linear(student) or not is_linear(teacher)))
    return "fused" if fused else "two-pass"


def divergence(student, teacher, target, temperature, kind: str, beta, entropy: bool, backend_name: str,
               vocab_shard: Optional[parallel.VocabShard] = None):
    """``(divergence [N], entropy)`` of a dense teacher (logits or ``LinearLogits``), differentiable w.r.t. the
    student; ``entropy`` the student's (``[0]`` unless asked for). ``kind``: a name of ``kernels.divergence.KINDS``."""
    stat = KINDS[kind]
    stats = statistics(student, teacher, target, temperature, composed.wanted(kind, entropy), backend_name,
                       vocab_shard)
    if stat is not None:
        return getattr(stats, stat), stats.entropy
    lse, ref_lse = stats.lse.detach(), stats.ref_lse.detach()
    if vocab_shard is not None:  # a label that no shard holds: NaN, as the statistics give it
        target = torch.where((target >= 0) & torch.isnan(stats.logp.detach()), OUT_OF_RANGE, target)
    if family(student, teacher) == "linear":
        policy, ref, tile = linear_sides(student, teacher)
        if vocab_shard is not None:
            jsd, _ = parallel.shard_jsd(policy, ref, target, temperature, lse, ref_lse, beta, tile, backend_name,
                                        vocab_shard)
        else:
            jsd, _ = divergence_ops.linear_jsd_forward(*policy, *ref, target, temperature, lse, ref_lse, beta, tile,
                                                       backend_name)
    elif vocab_shard is not None:
        jsd, _ = parallel.shard_jsd(student, teacher.detach(), target, temperature, lse, ref_lse, beta, None,
                                    backend_name, vocab_shard)
    else:
        jsd, _ = divergence_ops.jsd_forward(student, teacher.detach(), target, temperature, lse, ref_lse, beta,
                                            backend_name)
    return jsd, stats.entropy


def divergence_loss(student, teacher, target, temperature, kind: str, beta, weight, entropy: bool,
                    backend_name: Optional[str]):
    """``(loss, divergence [N], entropy)`` of the ``"fused"`` route: ``sum weight * divergence`` with the student's
    gradient written in the forward (only what requires grad gets one)."""
    if is_linear(student):
        policy, ref, tile = linear_sides(student, teacher)
        want = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in policy[:3]]
        out = divergence_ops.linear_divergence_loss(*policy, *ref, target, temperature, weight, kind, beta, entropy,
                                                    *want, tile, backend(backend_name, student, teacher))
        return out[:3]
    with_grad = torch.is_grad_enabled() and student.requires_grad
    out = divergence_ops.divergence_loss(student, teacher.detach(), target, temperature, weight, kind, beta, entropy,
                                         with_grad, backend(backend_name, student, family_name="divergence"))
    return out[:3]


def columns(student, ids, target, temperature, entropy: bool, backend_name: str,
            vocab_shard: Optional[parallel.VocabShard] = None):
    """``(column log-probs [N, K], entropy)``: ``log softmax(student / T)`` at ``ids [N, K]`` (global ids, ``-1``
    padding: ``-inf``; 0 on unscored rows), differentiable w.r.t. the student, from its ``lse`` and its logits at
    the ids; ``entropy`` the student's (``[0]`` unless asked for). ``LinearLogits``: one pass over the GEMM tiles
    gathers the columns (vocab-sharded: the statistics route, then a ``K``-column gather of the LM head rows);
    logits: the statistics route, then a ``K``-column gather."""
    if is_linear(student) and vocab_shard is None:
        tile = student.tile_elements or default_tile_elements(student.device.type)
        logp, _, student_entropy = divergence_ops.linear_column_logprobs(*student.side(), ids, target, temperature,
                                                                         entropy, tile, backend_name)
        return logp, student_entropy
    stats = statistics(student, None, target, temperature, stats_table.request(entropy=entropy), backend_name,
                       vocab_shard)
    lse = stats.lse.detach()
    if is_linear(student):
        side, tile = student.side(), student.tile_elements or default_tile_elements(student.device.type)
    else:
        side, tile = _side(student), default_tile_elements(student.device.type)
    if vocab_shard is not None:
        return parallel.shard_columns(side, ids, target, temperature, lse, tile, backend_name, vocab_shard), \
            stats.entropy
    return divergence_ops.column_logprobs(student, ids, target, temperature, lse, tile, backend_name), stats.entropy
