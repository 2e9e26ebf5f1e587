"""C++ backend of the ``truncation`` family: ``torch.ops.kltriton_cpp.truncated_forward`` / ``truncated_backward``.

CPU tensors in float32 / bfloat16 / float16. Per row, the floor by selection (``csrc/truncation.h``: the row
max, then per step a census of counts or masses at 8 thresholds, the candidates of one bracket narrowed and
sorted), then the restricted statistics while the row is in cache (``forward_row`` with ``FLOOR``); the backward
is the stream backward with the logits below the floor read as ``-inf``.
"""
import torch

from kltriton.kernels import cpp_library
from kltriton.kernels.row_views import as_rows3d
from kltriton.kernels.statistics import StreamStats



def forward(logits, target, temperature, top_k, top_p, min_p, floor, request):
    cpp_library.load()
    out = torch.ops.kltriton_cpp.truncated_forward(as_rows3d(logits.detach()), target, temperature, top_k, top_p,
                                                   min_p, floor, int(request))
    return out[0], StreamStats(*out[1:])


def backward(logits, target, temperature, floor, lse, basis):
    cpp_library.load()
    grad = torch.ops.kltriton_cpp.truncated_backward(as_rows3d(logits.detach()), target, temperature, floor, lse,
                                                     basis.label, basis.p, basis.p_logp)
    return grad.view(logits.shape)


def replay_support(ids):
    cpp_library.load()
    return torch.ops.kltriton_cpp.replay_support(ids)


def replay_columns(logits, ids):
    cpp_library.load()
    return torch.ops.kltriton_cpp.replay_columns(as_rows3d(logits), ids)


def replay_forward(values, ids, target, temperature, request):
    cpp_library.load()
    return tuple(torch.ops.kltriton_cpp.replay_forward(values, ids, target, temperature, int(request)))


def replay_backward(values, ids, target, temperature, row_max, log_mass, basis):
    cpp_library.load()
    return torch.ops.kltriton_cpp.replay_backward(values, ids, target, temperature, row_max, log_mass, basis.label,
                                                  basis.p, basis.p_logp)


def replay_scatter(columns, ids, vocab, dtype):
    cpp_library.load()
    return torch.ops.kltriton_cpp.replay_scatter(columns, ids, vocab, dtype)
