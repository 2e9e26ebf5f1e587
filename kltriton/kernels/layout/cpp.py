"""C++ backend of the ``layout`` family: ``torch.ops.kltriton_cpp.layout_target`` (``csrc/layout.cpp``)."""
import torch

from kltriton.kernels import cpp_library


def target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift, flags):
    cpp_library.load()
    return torch.ops.kltriton_cpp.layout_target(labels2d, mask2d, cu_seqlens, temperature, ignore_index, vocab, shift,
                                                flags)
