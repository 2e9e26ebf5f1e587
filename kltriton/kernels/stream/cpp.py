"""C++ backend of the ``stream`` family: ``torch.ops.kltriton_cpp.stream_forward`` / ``stream_backward``.

CPU tensors in float32 / bfloat16 / float16 (the reference logits may have another of these dtypes
than the policy's, each read as it is): one
streaming pass per row with an online max / sum in fp32 (``csrc/stream_forward.cpp``), and a
backward that writes the gradient row by row (``csrc/stream_backward.cpp``). The library is
built or loaded by ``kltriton.kernels.cpp_library``.
"""
import torch

from kltriton.kernels import cpp_library
from kltriton.kernels.rows import as_rows3d
from kltriton.kernels.stream import StreamStats

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def availability():
    return cpp_library.availability()


def _rows(tensor):
    return None if tensor is None else as_rows3d(tensor.detach())


def _f32(tensor):
    return None if tensor is None else tensor.detach().reshape(-1).to(torch.float32).contiguous()


def forward(logits, ref_logits, target, temperature, with_entropy, with_full_kl) -> StreamStats:
    cpp_library.load()
    outs = torch.ops.kltriton_cpp.stream_forward(
        _rows(logits), _rows(ref_logits), target, temperature, bool(with_entropy), bool(with_full_kl))
    return StreamStats(*outs)


def backward(logits, ref_logits, target, temperature, lse, ref_lse, g_logp, g_entropy, entropy,
             g_full_kl, full_kl) -> torch.Tensor:
    cpp_library.load()
    with_full_kl = g_full_kl is not None
    grad = torch.ops.kltriton_cpp.stream_backward(
        _rows(logits), _rows(ref_logits) if with_full_kl else None, target, temperature, _f32(lse),
        _f32(ref_lse) if with_full_kl else None, _f32(g_logp), _f32(g_entropy), _f32(entropy),
        _f32(g_full_kl), _f32(full_kl))
    return grad.view(logits.shape)
