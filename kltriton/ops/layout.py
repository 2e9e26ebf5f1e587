"""The layout pass as a custom op: ``kltriton::target`` turns the label-side inputs into the per-row target (the
``layout`` family, ``kltriton.kernels.layout``), checking their values into the device's flag vector
(``flag_vector``) when asked; ``check_inputs`` raises what the flags hold."""
from typing import Optional

import torch

from kltriton import dispatch
from kltriton.kernels import constants
from kltriton.kernels.layout import RowWeights
from kltriton.ops._define import BOOL, DTYPE, FLOAT, INT, OPTIONAL, STR, TENSOR, Group, define_op


_FLAGS = {}  # device -> int64 [len(FLAG_SLOTS)]: what the layout kernels found wrong since the last check
_HOST_FLAGS = {}  # device -> the flag vector as a numpy array, for a device whose memory the host reads (CPU)


def flag_vector(device) -> torch.Tensor:
    """The device's flag vector (``constants.FLAG_SLOTS``), made at its first use: the layout kernels OR into it what
    they find wrong (``constants.BAD_*`` bits), so that no call reads a value on the host."""
    flags = _FLAGS.get(device)
    if flags is None:
        device = torch.device(device)
        flags = _FLAGS.get(device)
    if flags is None:
        flags = _FLAGS[device] = torch.zeros(len(constants.FLAG_SLOTS), dtype=torch.int64, device=device)
        if device.type == "cpu":
            _HOST_FLAGS[device] = flags.numpy()
    return flags


def raise_flagged(device, context: Optional[dict] = None) -> None:
    """Raise the ``ValueError`` of what the device's flag vector holds, and clear it (a host read: on a device, a
    synchronization). ``context``: the call's ``vocab``, ``ignore_index``, ``n`` and ``spans`` for the message (None:
    a call since the last check, whose context is gone)."""
    host = _HOST_FLAGS.get(device)
    if host is not None and not host[0]:  # every CPU call comes here: the common answer without a tensor op
        return
    flags = _FLAGS.get(torch.device(device))
    if flags is None:
        return
    values = dict(zip(constants.FLAG_SLOTS, flags.tolist()))
    if not values["bits"]:
        return
    flags.zero_()
    raise ValueError(_flag_message(values, context, device))


def _flag_message(values, context, device) -> str:
    bits = values["bits"]
    earlier = "" if context is not None else f" (in a call on {device} since the last kltriton.check_inputs())"
    if bits & constants.BAD_TEMPERATURE:
        return f"temperature must be > 0 and finite everywhere{earlier}"
    if bits & constants.BAD_TOPK_ID:
        return (f"teacher TopK ids must lie in [0, V) or be -1 (padding); found {values['topk_id']}{earlier} (the "
                f"position gave NaN)")
    if bits & constants.BAD_SUPPORT_ID:
        return (f"support ids must lie in [0, V) or be -1 (padding); found {values['support_id']}{earlier} (the "
                f"position gave NaN)")
    if bits & constants.BAD_CU_SEQLENS_ENDS:
        n = f"N={context['n']}" if context else "N"
        where = " (every rank's packed tokens: the offsets are global under a sequence_group)" if context and \
            context.get("split") else ""
        return (f"cu_seqlens must start at 0 and end at {n}{where}, got {values['cu_first']} ... "
                f"{values['cu_last']}{earlier}")
    if bits & constants.BAD_CU_SEQLENS_ORDER:
        return f"cu_seqlens must be non-decreasing{earlier}"
    if context is None:
        return (f"labels must lie in [0, V) or equal ignore_index; found {values['label']}{earlier} (the position "
                f"gave NaN)")
    spans = context.get("spans")
    where = f", the vocabulary the ranks' shards cover ({spans})" if spans else ""
    return (f"labels must lie in [0, V={context['vocab']}){where} or equal ignore_index={context['ignore_index']}; "
            f"found {values['label']}")


def check_inputs() -> None:
    """Raise the ``ValueError`` of a bad input value (a label outside ``[0, V)`` that is not ``ignore_index``, a
    malformed ``cu_seqlens``, a temperature that is not ``> 0`` and finite, a ``TopK`` or replay support id outside
    ``[-1, V)``) that a kltriton call found on a device since the last check, and clear the record. It reads each device's flag vector: a synchronization, so call it
    where the training loop synchronizes anyway (after ``loss.item()``, at logging). On CPU every call raises at
    once and there is nothing left to raise here."""
    for device in list(_FLAGS):
        raise_flagged(device)


def launch_target(labels, mask, cu_seqlens, temperature, ignore_index, vocab, shift, check, backend):
    """The ``target`` op's launcher, by position: an eager call (``_inputs.Layout``) calls it directly."""
    flags = flag_vector(labels.device) if check else None
    return dispatch.implementation("layout", backend).target(labels, mask, cu_seqlens, temperature, ignore_index,
                                                              vocab, shift, flags)


def _launch(args):
    return launch_target(args.labels, args.mask, args.cu_seqlens, args.temperature, args.ignore_index, args.vocab,
                         args.shift, args.check, args.backend)


def launch_target_weights(labels, mask, cu_seqlens, temperature, ignore_index, vocab, shift, check, weights, backend):
    """The ``target_weights`` op's launcher, by position: an eager call (``_inputs.Layout``) calls it directly."""
    flags = flag_vector(labels.device) if check else None
    return dispatch.implementation("layout", backend).target_weights(labels, mask, cu_seqlens, temperature,
                                                                      ignore_index, vocab, shift, flags, weights)


def launch_target_rows(labels, mask, cu_seqlens, temperature, ignore_index, vocab, shift, check, rows, out, backend):
    """``(target, out)`` of the layout family's ``target_rows``, by position (eager calls only, ``_inputs.Layout``)."""
    flags = flag_vector(labels.device) if check else None
    return dispatch.implementation("layout", backend).target_rows(labels, mask, cu_seqlens, temperature, ignore_index,
                                                                   vocab, shift, flags, rows, out)


def _launch_weights(args):
    return launch_target_weights(args.labels, args.mask, args.cu_seqlens, args.temperature, args.ignore_index,
                                 args.vocab, args.shift, args.check, args.weights, args.backend)


_INPUTS = (("labels", TENSOR), ("mask", OPTIONAL), ("cu_seqlens", OPTIONAL), ("temperature", OPTIONAL),
           ("ignore_index", INT), ("vocab", INT), ("shift", BOOL), ("check", BOOL))
ROW_WEIGHTS = Group(RowWeights, (STR, OPTIONAL, OPTIONAL, OPTIONAL, OPTIONAL, BOOL, FLOAT, FLOAT, DTYPE))

target_weights = define_op(
    "target_weights", inputs=(*_INPUTS, ("weights", ROW_WEIGHTS), ("backend", STR)), outputs=("target", "prepared"),
    launch=_launch_weights,
    fake=lambda args: (args.labels.new_empty(args.labels.numel(), dtype=torch.int64),
                       args.labels.new_empty((5, args.labels.numel()), dtype=args.weights.dtype)))

target = define_op(
    "target",
    inputs=(*_INPUTS, ("backend", STR)),
    outputs=("target",), launch=_launch,
    fake=lambda args: args.labels.new_empty(args.labels.numel(), dtype=torch.int64))
