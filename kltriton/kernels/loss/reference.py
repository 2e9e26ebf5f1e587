"""Reference backend of the ``loss`` family: the stream reference kernels composed (``composed.py``).

Any float dtype (float64 logits give a float64 oracle). ``scale_`` always multiplies (it reads and
writes the gradient even when the upstream gradient is 1).
"""
from kltriton.kernels.loss import composed


def forward(logits, ref_logits, target, temperature, rows, bounds, loss_type, estimator, entropy_grad, with_grad):
    return composed.forward("reference", logits, ref_logits, target, temperature, rows, bounds, loss_type,
                            estimator, entropy_grad, with_grad)


def scale_(grad, upstream):
    grad.mul_(upstream.to(grad.dtype))
