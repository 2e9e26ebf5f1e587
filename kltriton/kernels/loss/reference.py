"""Reference backend of the ``loss`` family: the stream reference kernels composed (``composed.py``).

Any float dtype (float64 logits give a float64 oracle). ``scale_`` always multiplies (it reads and
writes the gradient even when the upstream gradient is 1).
"""
from kltriton.kernels.loss import composed
from kltriton.kernels.stream import reference as stream


def forward(logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator, entropy_grad, with_grad,
            with_entropy=True):
    return composed.forward(stream, logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator,
                            entropy_grad, with_grad, with_entropy)


def accumulate_(grad, logits, target, temperature, lse, basis):
    composed.accumulate_(stream, grad, logits, target, temperature, lse, basis)


def scale_(grad, upstream):
    grad.mul_(upstream.to(grad.dtype))
