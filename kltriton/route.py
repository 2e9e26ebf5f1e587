"""The route table: how a public call (a ``front_door.Call``) reaches a kernel pass. The one module that decides it.

The ops are keyed on sides (``kltriton.ops``): dense logits or an LM head go to the same op, which picks the
family (``stream`` or ``linear``) from the sides. What the route decides is which pass, and whether it runs on this
rank's rows (``ops``) or over vocab shards (``parallel``):

| what (the public function)                          | local (``call.shard`` None)     | vocab-sharded                |
|-----------------------------------------------------|---------------------------------|------------------------------|
| statistics of a plain call (``plain``: ``token_logprobs``), or of local dense logits before the target is made | ``ops.statistics.dense_labels`` (the target made with them) | |
| statistics (log-probs, entropy, KL; every function) | ``ops.statistics.statistics``   | ``parallel.shard_statistics`` |
| statistics of an LM head's one tile (``tiles.one_tile``) before the target is made | ``Layout.scored_rows`` (the target and the GEMM operand in one op), then ``ops.statistics.statistics`` | |
| truncated statistics (``truncation=``, recompute)   | ``ops.truncation.truncated_forward``; an LM head: tiles of rows, each that route (``kernels.truncation.linear``) | ``parallel.shard_truncated`` (the floor: ``sharded_floor``) |
| truncated statistics (replay)                       | ``kernels.truncation.replay``   | the same, summed over ranks  |
| the fused policy loss (``policy_loss``)             | ``ops.loss.fused``              | (two-pass)                   |
| the fused policy loss with its row weights from the label side (``policy_loss``'s common call: ``weighted_loss``) | local dense logits, target not made yet: ``ops.loss.fused_labels`` (the target and the weights made with the loss); else ``Layout.weighted``, then ``ops.loss.fused`` | (two-pass) |
| the JSD's second pass (``token_divergence``)        | ``ops.divergence.jsd``          | ``parallel.shard_jsd``       |
| the fused divergence loss (``token_divergence``)    | ``ops.divergence.divergence_loss`` | (two-pass)                |
| a top-k teacher's columns (``token_divergence``)    | ``ops.divergence.columns``      | ``parallel.shard_columns``   |

The invariant mode (``invariant.enabled()``) keeps these routes and adds ``constants.INVARIANT`` to the statistics'
request: the ops run the ``invariant`` family (``ops.invariant``; an LM head by GEMMs of one fixed shape), the
vocab-parallel passes join the shards between its kernels, and a truncation's floor has fixed-point masses
(``invariant.floor``; over shards ``sharded_floor``'s). Replay is invariant in every mode. The lean steps that make
the target with the statistics (``dense_labels``, ``Layout.scored_rows``) are the ``stream`` family's, so they are
skipped; ``policy_loss`` takes its two-pass route, and the exact KL over the vocabulary and ``token_divergence``
raise (``invariant.refuse``).

``policy_loss`` (``loss_route``) is ``"fused"`` (its gradient written in the forward) unless a rule of
``LOSS_TWO_PASS`` holds, then ``"two-pass"`` (the statistics, the formulas of ``kernels.loss.terms`` in PyTorch,
autograd; the logits are read again in the backward):

| rule                                                                  | why                                          |
|-----------------------------------------------------------------------|----------------------------------------------|
| the loss type is not in ``terms.FUSED`` (a sequence-level or batch loss) | a row's derivative needs other rows first |
| the per-row inputs need the whole sequences (sequence-level IS, on-policy rollout IS, the off-policy mask, a masked entropy bonus) | the same |
| the logits are vocab-sharded                                          | the derivative needs the global statistics   |
| a truncation                                                          | the kept set is not a fused kernel's         |
| a dense policy with an LM-head reference                              | the fused kernels read one kind of side      |
| the invariant mode                                                    | the fused kernels' sums are the ``stream`` family's |

``token_divergence`` (``divergence_route``) is ``"fused"`` unless a rule of ``DIVERGENCE_TWO_PASS`` holds:

| rule                                                                  | why                                          |
|-----------------------------------------------------------------------|----------------------------------------------|
| no reduction (``reduction="none"``)                                   | the per-token divergences are the output     |
| a top-k teacher (``TopK``)                                            | its columns are a pass of their own          |
| the logits are vocab-sharded                                          | the derivative needs the global statistics   |
| a dense student with an LM-head teacher                               | the fused kernels read one kind of side      |

(In the invariant mode ``token_divergence`` raises.)

``parallel`` (vocab-parallel) is imported here and by the front door only.
"""
from typing import Callable, NamedTuple, Optional

import torch

from kltriton import dispatch, invariant, parallel
from kltriton._values import runtime_scalar
from kltriton.front_door import Call
from kltriton.kernels import OUT_OF_RANGE, constants
from kltriton.kernels import statistics as table
from kltriton.kernels.divergence import KINDS, composed
from kltriton.kernels.loss import LossTerms, row_inputs, terms
from kltriton.kernels.statistics import StreamStats
from kltriton.kernels.linear.tiles import one_tile, one_tile_operand, plan
from kltriton.kernels.truncation import linear as truncation_linear
from kltriton.kernels.truncation import replay
from kltriton.ops import divergence as divergence_ops
from kltriton.ops import loss as loss_ops
from kltriton.ops import statistics as statistics_ops
from kltriton.ops import truncation as truncation_ops
from kltriton.ops._define import PLAIN_TENSORS, NeedsGrad, eager
from kltriton import collectives


def family(call: Call) -> str:
    """The kernel family of the call's statistics: ``linear`` when a side is an LM head, else ``stream``."""
    return statistics_ops.family(call.policy, call.ref)


def backend(call: Call, family_name: Optional[str] = None) -> str:
    """The backend that runs ``family_name`` (default: ``family(call)``) on the call's device."""
    return dispatch.resolve(call.backend, family_name or family(call), call.device.type, call.dtype == torch.float64)


def _want(call: Call) -> NeedsGrad:
    """Which of the policy's hidden states (or logits), weight and bias get a gradient in a forward that writes it."""
    return NeedsGrad(*(torch.is_grad_enabled() and t is not None and t.requires_grad for t in call.policy[:3]))


def plain(logits, labels, mask, cu_seqlens, temperature, *others) -> bool:
    """Whether a call takes the lean path (``front_door.enter_plain``, then ``plain_statistics``): dense logits, the
    label side and the temperature as plain tensors (or a python temperature), every other input None (``others``:
    a reference, groups, a vocab start, a truncation), in an eager call outside the invariant mode. SPEC's "The host
    floor": at small N the generic path's steps cost more than the kernels."""
    return (type(logits) in PLAIN_TENSORS and others.count(None) == len(others) and not invariant.enabled()
            and eager((logits, labels, mask, cu_seqlens, temperature)))


def plain_statistics(logits, layout, temperature, request: int, backend) -> StreamStats:
    """``statistics`` of a plain call (``plain``): the ``stream`` kernels on the logits at the layout's targets."""
    name = dispatch.resolve(backend, "stream", logits.device.type, logits.dtype == torch.float64)
    return statistics_ops.dense_labels(logits, None, layout, temperature, request, name)


def statistics(call: Call, request: int) -> StreamStats:
    """``StreamStats`` (``[N]``) of the call's policy (and reference, no gradient) at its targets, differentiable
    w.r.t. the policy's logits or hidden states, weight and bias. With a truncation, of the policy's truncated
    distribution (``truncated_statistics``; the reference is then scored by ``reference_statistics``)."""
    if request & constants.HEAD:
        check_head(call)
    fixed = invariant.enabled()
    if fixed:
        invariant.check_request(request)
        request |= constants.INVARIANT
    if call.truncation is not None:
        return truncated_statistics(call._replace(ref=None), request)
    ref = None if call.ref is None else call.ref.x
    if (call.shard is None and family(call) == "stream" and call.layout.pending and not fixed
            and eager((call.policy.x, ref, call.temperature, call.layout.source))):
        # the target not made yet: made with the statistics, one op (``forward_labels``)
        return statistics_ops.dense_labels(call.policy.x, ref, call.layout, call.temperature, request, backend(call))
    rows = None
    if (call.shard is None and call.layout.pending and not fixed
            and one_tile(call.policy, call.ref, call.layout.shape.numel(), call.tile_elements)
            and eager((call.policy, call.temperature, call.layout.source))):
        # an LM head's one tile: its GEMM operand made with the target, one op (``Layout.scored_rows``)
        tile_rows, _ = plan(call.vocab, call.tile_elements)
        rows = call.layout.scored_rows(*one_tile_operand(call.policy, tile_rows))
    name = backend(call, "invariant" if fixed else None)
    args = (call.policy, call.ref, call.layout.target, call.temperature, request, call.tile_elements, name)
    if call.shard is not None:
        return parallel.shard_statistics(*args, call.shard)
    return statistics_ops.local(*args, rows)


def check_head(call: Call):
    """The head's statistics (``constants.HEAD``: is_top1, the sum and max of the logits, log_sum_sq_probs) come from
    the stream family (dense logits, LM-head tiles, vocab shards); the truncation and the invariant mode have passes of
    their own that do not compute them yet."""
    where = ("a truncation" if call.truncation is not None else
             "the invariant mode" if invariant.enabled() else None)
    if where is not None:
        raise NotImplementedError(f"kltriton: is_top1, mean_logits and log_sum_sq_probs are not available with {where} "
                                  "yet")


def reference_statistics(call: Call, request: int) -> StreamStats:
    """``statistics`` of the reference side alone (its own pass, no gradient)."""
    with torch.no_grad():
        return statistics(call._replace(policy=call.ref, ref=None, truncation=None), request)


class Rule(NamedTuple):
    """A row of a route's table (the module docstring's): what sends a call to the two-pass route, and why."""
    what: str
    why: str
    holds: Callable  # (call, *the route's arguments) -> bool


def _dense_with_head_reference(call: Call) -> bool:
    return call.policy.weight is None and call.ref is not None and call.ref.weight is not None


# (call, loss_type, whole_sequences): ``whole_sequences``, the loss's per-row inputs need the whole sequences' new
# log-probs.
LOSS_TWO_PASS = (
    Rule("the loss type is not in ``terms.FUSED`` (a sequence-level or batch loss)",
         "a row's derivative needs other rows first", lambda call, loss_type, whole: loss_type not in terms.FUSED),
    Rule("the per-row inputs need the whole sequences (sequence-level IS, on-policy rollout IS, the off-policy mask, "
         "a masked entropy bonus)", "the same", lambda call, loss_type, whole: whole),
    Rule("the logits are vocab-sharded", "the derivative needs the global statistics",
         lambda call, *_: call.shard is not None),
    Rule("a truncation", "the kept set is not a fused kernel's", lambda call, *_: call.truncation is not None),
    Rule("a dense policy with an LM-head reference", "the fused kernels read one kind of side",
         lambda call, *_: _dense_with_head_reference(call)),
    Rule("the invariant mode", "the fused kernels' sums are the ``stream`` family's",
         lambda call, *_: invariant.enabled()),
)

# (call, reduction)
DIVERGENCE_TWO_PASS = (
    Rule('no reduction (``reduction="none"``)', "the per-token divergences are the output",
         lambda call, reduction: reduction == "none"),
    Rule("a top-k teacher (``TopK``)", "its columns are a pass of their own", lambda call, _: call.topk is not None),
    Rule("the logits are vocab-sharded", "the derivative needs the global statistics",
         lambda call, _: call.shard is not None),
    Rule("a dense student with an LM-head teacher", "the fused kernels read one kind of side",
         lambda call, _: _dense_with_head_reference(call)),
)


def two_pass_rule(rules, call: Call, *args) -> Optional[Rule]:
    """The first of ``rules`` (``LOSS_TWO_PASS``, ``DIVERGENCE_TWO_PASS``) that holds for the call, or None."""
    for rule in rules:
        if rule.holds(call, *args):
            return rule
    return None


def loss_route(call: Call, loss_type: str, whole_sequences: bool) -> str:
    """``"fused"`` or ``"two-pass"`` for ``policy_loss`` (``LOSS_TWO_PASS``)."""
    return "fused" if two_pass_rule(LOSS_TWO_PASS, call, loss_type, whole_sequences) is None else "two-pass"


def fused_loss(call: Call, inputs, hyperparameters, loss_type, estimator: str, entropy_grad: bool, with_entropy: bool = True,
               entropy_quantile: Optional[float] = None):
    """``(loss, StreamStats, threshold, LossTerms)`` of the ``loss`` family, the gradient written in the forward (only
    what requires grad gets one); ``LossTerms``: the per-token KL and ratio and the metrics of the family's ``terms``.
    ``entropy_quantile``: TRL's entropy mask (``threshold`` its quantile, else NaN)."""
    quantile = None if entropy_quantile is None else runtime_scalar(entropy_quantile, call.device)
    name = backend(call, "loss" if call.policy.weight is None else "linear")
    out = loss_ops.fused(call.policy, call.ref, call.layout.target, call.temperature, inputs, hyperparameters,
                         loss_type, estimator, entropy_grad, _want(call), with_entropy, quantile, call.tile_elements,
                         name)
    stats_end = 1 + len(table.NAMES)
    kl, ratio, metrics = out[stats_end + 4:]
    return out[0], StreamStats(*out[1:stats_end]), out[stats_end], LossTerms(out[0], kl, ratio, metrics)


def weighted_loss(call: Call, weights, old_logp, hyperparameters, loss_type, estimator: str, entropy_grad: bool,
                  with_entropy: bool):
    """``(loss, StreamStats, LossTerms)`` of ``fused_loss`` with the loss's per-row inputs made from the label side
    (``weights``: a ``kernels.layout.RowWeights``) with the target, ``old_logp`` and the call's given reference
    log-probs as they are. Local dense logits in an eager call whose target is not made yet: one call of the loss
    family's ``forward_labels`` (``ops.loss.fused_labels``); else ``Layout.weighted``, then ``fused_loss``."""
    layout, logits, ref = call.layout, call.policy.x, None if call.ref is None else call.ref.x
    if (family(call) == "stream" and call.shard is None and layout.pending
            and eager((logits, ref, call.temperature, old_logp, call.ref_logprobs, weights, layout.source))):
        return loss_ops.fused_labels(logits, ref, layout, weights, call.temperature, old_logp, call.ref_logprobs,
                                     hyperparameters, loss_type, estimator, entropy_grad, with_entropy,
                                     backend(call, "loss"))
    inputs = row_inputs(layout.weighted(weights), old_logp, call.ref_logprobs)
    value, stats, _, terms_out = fused_loss(call, inputs, hyperparameters, loss_type, estimator, entropy_grad,
                                            with_entropy)
    return value, stats, terms_out


def truncated_statistics(call: Call, request: int) -> StreamStats:
    """``StreamStats`` (``logp``, ``lse``, ``entropy`` when ``request`` asks) of the truncated distribution of the
    call's policy (a tensor or an LM head, local or a vocab shard) at its targets. Differentiable like
    ``statistics``."""
    layout, device, shard, side = call.layout, call.device, call.shard, call.policy
    target, temperature, vocab = layout.target, call.temperature, call.vocab
    group = None if shard is None else shard.group
    truncation = call.truncation
    if truncation.replay:
        name = backend(call, "truncation")
        rows, bad_rows = truncation.support_rows(layout.shape, device, vocab)
        if bad_rows is not None:  # a support id outside [-1, V), recorded on a device: its row scored as NaN
            target = torch.where(bad_rows & (target >= 0), OUT_OF_RANGE, target)
        ids = truncation_ops.replay_support(rows, name)
        own = ids if shard is None else replay.shard_ids(ids, shard.start, shard.size)
        if side.weight is not None:
            if group is not None:
                side = side._replace(x=collectives.replicated(side.x, group))
            values = replay.project(side, own, call.tile_elements)
        else:
            values = truncation_ops.replay_columns(side.x, own, name)
        if group is not None:
            values = collectives.sum_over_ranks(values, group)
        return truncation_ops.replay_statistics(values, ids, target, temperature, request, name)
    knobs = truncation.row_knobs(layout.shape, layout.num_seqs, layout.seq_index, device, vocab)
    fixed = bool(request & constants.INVARIANT)
    name = backend(call, "invariant" if fixed else "truncation")

    def dense(rows, row_target, row_temperature, row_knobs):
        if shard is not None:
            return parallel.shard_truncated(rows, row_target, row_temperature, row_knobs, request, name, shard)
        floor = invariant.floor(rows, row_target, row_temperature, row_knobs) if fixed else None
        return truncation_ops.truncated_forward(rows, row_target, row_temperature, row_knobs, floor, request, name)[1]

    if side.weight is None:
        return dense(side.x, target, temperature, knobs)
    if group is not None:
        side = side._replace(x=collectives.replicated(side.x, group))

    def tile(rows, start, stop):
        row_temperature = temperature if temperature.dim() == 0 else temperature[start:stop]
        return dense(rows, target[start:stop], row_temperature, type(knobs)(*(k[start:stop] for k in knobs)))

    if fixed:  # the logits of GEMMs of one shape, the same tiles on every rank
        return truncation_linear.statistics(side, tile, invariant.head_rows(device), invariant.head)
    # Every rank must cut the rows into the same tiles (their floors take collectives): the widest shard decides.
    local_width = side.weight.shape[0]
    width = local_width if group is None else collectives.widest_shard(local_width, device, group)
    tile_rows = max(1, call.tile_elements // width)
    return truncation_linear.statistics(side, tile, tile_rows)


# --- distillation -----------------------------------------------------------------------------------------------

def divergence_route(call: Call, reduction: str) -> str:
    """``"fused"`` or ``"two-pass"`` for ``token_divergence`` (``DIVERGENCE_TWO_PASS``)."""
    if invariant.enabled():
        invariant.refuse("token_divergence")
    return "fused" if two_pass_rule(DIVERGENCE_TWO_PASS, call, reduction) is None else "two-pass"


def divergence(call: Call, kind: str, beta, entropy: bool):
    """``(divergence [N], entropy)`` of a dense teacher (logits or an LM head), differentiable w.r.t. the
    student; ``entropy`` the student's (``[0]`` unless asked for). ``kind``: a name of ``kernels.divergence.KINDS``."""
    stat = KINDS[kind]
    stats = statistics(call, composed.statistics_request(kind, entropy))
    if stat is not None:
        return getattr(stats, stat), stats.entropy
    lse, ref_lse = stats.lse.detach(), stats.ref_lse.detach()
    target, temperature, shard = call.layout.target, call.temperature, call.shard
    args = (call.policy, call.ref)
    if shard is not None:  # a label that no shard holds: NaN, as the statistics give it
        target = torch.where((target >= 0) & torch.isnan(stats.logp.detach()), OUT_OF_RANGE, target)
        jsd, _ = parallel.shard_jsd(*args, target, temperature, lse, ref_lse, beta, call.tile_elements,
                                    backend(call), shard)
    else:
        name = backend(call, "divergence" if family(call) == "stream" else "linear")
        jsd, _ = divergence_ops.jsd(*args, target, temperature, lse, ref_lse, beta, call.tile_elements, name)
    return jsd, stats.entropy


def divergence_loss(call: Call, kind: str, beta, weight, entropy: bool):
    """``(loss, divergence [N], entropy)`` of the ``"fused"`` route: ``sum weight * divergence`` with the student's
    gradient written in the forward (only what requires grad gets one)."""
    name = backend(call, "divergence" if call.policy.weight is None else "linear")
    out = divergence_ops.divergence_loss(call.policy, call.ref, call.layout.target, call.temperature, weight, kind,
                                         beta, entropy, _want(call), call.tile_elements, name)
    return out[:3]


def columns(call: Call, ids, entropy: bool):
    """``(column log-probs [N, K], entropy)``: ``log softmax(student / T)`` at ``ids [N, K]`` (global ids, ``-1``
    padding: ``-inf``; 0 on unscored rows), differentiable w.r.t. the student; ``entropy`` the student's (``[0]``
    unless asked for). Local: one op (an LM head's statistics and columns from the same tiles); vocab-sharded: the
    statistics route for the global ``lse``, then the columns each shard holds, summed."""
    if invariant.enabled():
        invariant.refuse("token_divergence")
    target, temperature, shard = call.layout.target, call.temperature, call.shard
    if shard is None:
        logp, _, student_entropy = divergence_ops.columns(call.policy, ids, target, temperature, None, entropy,
                                                          call.tile_elements, backend(call))
        return logp, student_entropy
    stats = statistics(call, table.request(entropy=entropy))
    return parallel.shard_columns(call.policy, ids, target, temperature, stats.lse.detach(), call.tile_elements,
                                  backend(call), shard), stats.entropy
