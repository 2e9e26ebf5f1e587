"""The invariant mode: ``kltriton.set_invariant(True)`` (or ``KLTRITON_INVARIANT=1``).

In this mode every log-prob, log-sum-exp and entropy (of the policy, the reference, and of a truncated
distribution) is bitwise independent of the batch composition, the ``LinearLogits`` tile size, the kernels' block
sizes, the replay support's padding and the number of vocab shards (where they cut the vocabulary): a row's
reductions are a maximum and int64 fixed-point sums (the ``invariant`` kernel family, ``kltriton.kernels.invariant``),
both associative.

This module holds the switch and what the routes ask of it; the passes are the ordinary ones. ``kltriton.route``
adds ``constants.INVARIANT`` to the statistics' request, and the ops that receive it run the ``invariant`` family
(``kltriton.ops.invariant``):

- dense logits: the rows' maxima and fixed-point sums (one kernel on whole rows; over vocab shards the
  ``kltriton.parallel`` pass joins them between the kernels: one all-reduce max of ``[N]`` values, one int64
  all-reduce of ``[k + 2, N]``), then ``finalize``;
- an LM head: the same per token tile, the logits built by GEMMs of one fixed shape (``kltriton.kernels.linear.fixed``);
- a truncation (recompute mode): the floor with fixed-point masses (``floor``; over shards ``sharded_floor``'s), then
  the statistics of the entries above it. Replay is invariant in every mode.

Gradients w.r.t. the logits are per entry given the row's ``lse`` (the ``stream`` / ``truncation`` families'
backward), so they are invariant too; an LM head's hidden-state gradient is a sum over the vocabulary (over GEMM
blocks and ranks, in floating point) and is not.
"""
from kltriton import sharded_floor
from kltriton._env import invariant_default
from kltriton.kernels import constants
from kltriton.kernels.linear import fixed

_ENABLED = invariant_default()


def set_invariant(enabled: bool) -> bool:
    """Turn the invariant mode on or off (default: off, or ``KLTRITON_INVARIANT=1`` at import).

    On: ``token_logprobs``, ``token_kl`` (per-token estimators), ``fused_kl_reward`` and ``policy_loss`` (its two-pass
    route) give log-probs, log-sum-exps and entropies bitwise independent of the batch composition, the
    ``LinearLogits`` tile size, the kernels' block sizes, the replay support's padding and the number of vocab shards
    (``process_group`` / DTensor), on each backend; their logits gradients follow. The exact KL over the vocabulary
    (``estimator="full"``) and ``token_divergence`` raise a ``ValueError`` in this mode. See
    ``docs/engine.md`` for what it costs.

    Returns the previous setting, so a caller can restore it.
    """
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


def enabled() -> bool:
    """Whether the invariant mode is on."""
    return _ENABLED


def refuse(what: str):
    """The error of a computation the invariant mode does not cover."""
    raise ValueError(f"{what} is not available in the invariant mode (kltriton.set_invariant(True)): its sums over the "
                     "vocabulary merge in floating point, so they depend on where vocab shards and tiles cut it. "
                     "Switch the mode off for this call (kltriton.set_invariant(False) returns the previous setting).")


def check_request(request: int):
    """The invariant mode computes ``logp``, ``lse``, ``entropy`` and the reference's ``logp`` / ``lse``."""
    if request & constants.FULL_KL:
        refuse("the exact KL over the vocabulary (estimator='full')")
    if request & constants.FORWARD_KL:
        refuse("the forward KL over the vocabulary")


def floor(logits, target, temperature, knobs):
    """``[N]``: the ``truncation`` family's floor of whole rows with fixed-point masses (``sharded_floor.local_floor``;
    over vocab shards ``parallel.shard_truncated`` takes ``shard_floor``'s, the same floor bit for bit)."""
    return sharded_floor.local_floor(logits, target, temperature, knobs)


def head_rows(device) -> int:
    """Rows of an LM head's logits tile in this mode (``kernels.linear.fixed.geometry``)."""
    return fixed.geometry(device.type)[0]


head = fixed.head
