"""C++ backend of the ``layout`` family: ``torch.ops.kltriton_cpp.layout_target`` (``csrc/layout.cpp``)."""
import torch

from kltriton.kernels import constants, cpp_library


def target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags):
    cpp_library.load()
    return torch.ops.kltriton_cpp.layout_target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift,
                                                flags)


def check_weights_dtype(weights):
    """The weights this backend makes are float32 (``RowWeights.dtype``)."""
    if weights.dtype != torch.float32:
        raise TypeError(f"the layout family's {__name__.rsplit('.', 1)[-1]} backend makes float32 weights, not "
                        f"{weights.dtype} (float64 runs on the reference backend)")


def target_weights(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, weights):
    check_weights_dtype(weights)
    cpp_library.load()
    return tuple(torch.ops.kltriton_cpp.layout_weights(
        labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags,
        constants.AGGREGATIONS.index(weights.aggregation), weights.num_tokens, weights.num_seqs_agg, weights.horizon,
        weights.advantages, weights.per_sequence, weights.kl_coef, weights.entropy_coef))


def target_rows(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags, rows, out):
    cpp_library.load()
    return torch.ops.kltriton_cpp.layout_target_rows(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab,
                                                     shift, flags, rows, out), out


def scored_rows(rows, target, out):
    cpp_library.load()
    torch.ops.kltriton_cpp.layout_scored_rows(rows, target, out)
    return out
