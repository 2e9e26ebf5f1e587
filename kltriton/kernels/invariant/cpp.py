"""C++ backend of the ``invariant`` family: ``torch.ops.kltriton_cpp.invariant_maxima`` / ``invariant_sums`` /
``invariant_forward`` (``csrc/invariant.h``), CPU tensors in float32 / bfloat16 / float16. Per row: the maximum, then
the fixed-point sums of the vectors of the row (its tail one more vector padded with ``-inf``); ``forward`` does both
while the row is in cache."""
import torch

from kltriton.kernels import cpp_library
from kltriton.kernels.row_views import as_rows3d


def maxima(logits, target, floor):
    cpp_library.load()
    return torch.ops.kltriton_cpp.invariant_maxima(as_rows3d(logits), target, floor)


def sums(logits, target, temperature, row_max, floor, request):
    cpp_library.load()
    return torch.ops.kltriton_cpp.invariant_sums(as_rows3d(logits), target, temperature, row_max, floor, int(request))


def forward(logits, target, temperature, floor, request):
    cpp_library.load()
    row_max, out = torch.ops.kltriton_cpp.invariant_forward(as_rows3d(logits), target, temperature, floor, int(request))
    return row_max, out
