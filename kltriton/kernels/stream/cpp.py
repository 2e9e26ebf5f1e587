"""C++ backend of the ``stream`` family: ``torch.ops.kltriton_cpp.stream_forward`` / ``stream_backward``.

CPU tensors in float32 / bfloat16 / float16 (the reference logits may have another of these dtypes than
the policy's, each read as it is): one streaming pass per row with an online max / sum in fp32
(``csrc/row_forward.h``), and a backward that writes the gradient row by row from the row's basis
coefficients (``csrc/row_backward.h``). The library is built or loaded by ``kltriton.kernels.cpp_library``.
"""
import torch

from kltriton.kernels import cpp_library
from kltriton.kernels.row_views import as_rows3d
from kltriton.kernels.statistics import StreamStats


def rows3d(tensor):
    """``tensor`` (or None) as the C++ kernels' ``[A, B, V]`` rows, not detached: the ops' autograd key falls through,
    so their outputs never require grad (and their callers run the kernels without grad mode, where a view costs
    least)."""
    return None if tensor is None else as_rows3d(tensor)


def forward(logits, ref_logits, target, temperature, request) -> StreamStats:
    cpp_library.load()
    return StreamStats(*torch.ops.kltriton_cpp.stream_forward(rows3d(logits), rows3d(ref_logits), target,
                                                              temperature, int(request)))


def forward_labels(logits, ref_logits, labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, shift, flags,
                   temperature, request):
    cpp_library.load()
    target, *stats = torch.ops.kltriton_cpp.stream_forward_labels(
        rows3d(logits), rows3d(ref_logits), labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, shift,
        flags, temperature, int(request))
    return target, StreamStats(*stats)


def backward(logits, ref_logits, target, temperature, lse, ref_lse, basis) -> torch.Tensor:
    cpp_library.load()
    with_ref = basis.reads_ref()
    grad = torch.ops.kltriton_cpp.stream_backward(
        rows3d(logits), rows3d(ref_logits) if with_ref else None, target, temperature, lse,
        ref_lse if with_ref else None, list(basis))
    return grad.view(logits.shape)


def backward_upstream(logits, ref_logits, target, temperature, lse, ref_lse, upstream, out=None) -> torch.Tensor:
    cpp_library.load()
    with_ref = upstream.reads_ref()
    grad = torch.ops.kltriton_cpp.stream_backward_upstream(
        rows3d(logits), rows3d(ref_logits) if with_ref else None, target, temperature, lse,
        ref_lse if with_ref else None, list(upstream), out)
    return grad.view(logits.shape)
