"""C++ backend of the ``loss`` family: ``torch.ops.kltriton_cpp.loss_forward`` / ``loss_scale_``.

One pass per row (``csrc/loss_forward.cpp``): the row's statistics, its loss coefficients, then its
gradient while the row is still in cache. CPU tensors in float32 / bfloat16 / float16. The fused row
kernel takes one dtype: reference logits in another dtype run the two-pass composition of the C++
stream kernels (``composed.py``), which reads them in their own dtype.
"""
import torch

from kltriton.kernels import cpp_library
from kltriton.kernels.loss import LossStats, composed
from kltriton.kernels.rows import as_rows3d

LOSS_TYPES = {"ppo": 0, "cispo": 1}
ESTIMATORS = {"": 0, "k1": 1, "abs": 2, "k2": 3, "k3": 4, "full": 5}


def availability():
    return cpp_library.availability()


def _f32(tensor):
    return None if tensor is None else tensor.detach().reshape(-1).to(torch.float32).contiguous()


def forward(logits, ref_logits, target, temperature, rows, bounds, loss_type, estimator, entropy_grad, with_grad):
    if ref_logits is not None and ref_logits.dtype != logits.dtype:
        return composed.forward("cpp", logits, ref_logits, target, temperature, rows, bounds, loss_type, estimator,
                                entropy_grad, with_grad)
    cpp_library.load()
    straight = estimator.endswith("+")
    base = estimator[:-1] if straight else estimator
    outs = torch.ops.kltriton_cpp.loss_forward(
        as_rows3d(logits.detach()), None if ref_logits is None else as_rows3d(ref_logits.detach()), target,
        temperature, _f32(rows.old_logp), _f32(rows.advantages), _f32(rows.w_pg), _f32(rows.w_kl),
        _f32(rows.w_ent), _f32(rows.ref_logp), bounds.to(torch.float64).contiguous(), LOSS_TYPES[loss_type],
        ESTIMATORS[base], straight, bool(entropy_grad), bool(with_grad))
    return LossStats(*outs[:4]), outs[4]


def scale_(grad, upstream):
    cpp_library.load()
    torch.ops.kltriton_cpp.loss_scale_(grad, upstream)
