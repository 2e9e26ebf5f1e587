"""Triton backend of the ``loss`` family: the stream Triton kernels composed (``composed.py``), and an
in-place scaling kernel that returns at once on the device when the upstream gradient is 1.

The fused single-pass kernel (statistics, then the gradient of the same row while it is in L2) is
the C++ backend's design; here the forward reads the logits twice (see the issue 15 notes).
"""
import triton
import triton.language as tl

from kltriton.kernels.loss import composed

SCALE_BLOCK = 4096


@triton.jit
def _scale_kernel(
    grad_ptr,      # [numel] contiguous, logits dtype, scaled in place
    upstream_ptr,  # [] the upstream gradient of the loss
    numel,
    BLOCK: tl.constexpr,
):
    upstream = tl.load(upstream_ptr).to(tl.float32)
    if upstream != 1.0:  # a unit upstream gradient reads and writes nothing
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        g = tl.load(grad_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(grad_ptr + offs, (g * upstream).to(grad_ptr.dtype.element_ty), mask=inside)


def forward(logits, ref_logits, target, temperature, rows, bounds, loss_type, estimator, entropy_grad, with_grad):
    return composed.forward("triton", logits, ref_logits, target, temperature, rows, bounds, loss_type,
                            estimator, entropy_grad, with_grad)


def scale_(grad, upstream):
    numel = grad.numel()
    if numel:
        _scale_kernel[(triton.cdiv(numel, SCALE_BLOCK),)](grad, upstream.float(), numel, BLOCK=SCALE_BLOCK)
