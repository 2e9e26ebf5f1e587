"""C++ backend of the ``divergence`` family: ``torch.ops.kltriton_cpp.jsd_forward`` / ``jsd_backward``
(``csrc/divergence.cpp``, row kernels in ``csrc/row_mixture.h``). CPU tensors in float32 / bfloat16 / float16,
the teacher in its own dtype."""
import torch

from kltriton.kernels import cpp_library
from kltriton.kernels.divergence import composed
from kltriton.kernels.row_views import as_rows3d
from kltriton.kernels.stream import cpp as stream



def forward(logits, ref_logits, target, temperature, lse, ref_lse, beta):
    cpp_library.load()
    jsd, kl_student = torch.ops.kltriton_cpp.jsd_forward(as_rows3d(logits.detach()), as_rows3d(ref_logits.detach()),
                                                         target, temperature, lse, ref_lse, beta.to(torch.float64))
    return jsd, kl_student


def backward(logits, ref_logits, target, temperature, lse, ref_lse, beta, kl_student, coef):
    cpp_library.load()
    grad = torch.ops.kltriton_cpp.jsd_backward(as_rows3d(logits.detach()), as_rows3d(ref_logits.detach()), target,
                                               temperature, lse, ref_lse, beta.to(torch.float64), kl_student, coef)
    return grad.view(logits.shape)


loss_forward = composed.bind(stream, forward, backward)
