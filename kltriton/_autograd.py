"""What every autograd node of kltriton shares: a backward that runs kernels is first-order only, and says so.

A leaf module (it imports torch only), so kernel modules and ops alike can use it."""
import functools

import torch


class _SecondDerivative(torch.autograd.Function):
    """Stands between a first-order gradient and the upstream gradients it came from (``first_order``): the identity
    on the gradient, and a ``RuntimeError`` with its message if a second derivative reaches it."""

    @staticmethod
    def forward(ctx, message, gradient, *upstream):
        ctx.message = message
        return gradient.detach()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def first_order(name: str):
    """A ``backward`` decorator for an autograd node whose backward runs kernels: the gradient is computed without
    recording a graph, and a second derivative through it (``create_graph=True``, then a gradient of that gradient) is
    a ``RuntimeError`` naming kltriton and ``name``, never a silently wrong value (as
    ``torch.autograd.function.once_differentiable``, whose message names neither)."""
    message = (f"kltriton: {name} has no second derivative (double backward): its backward runs kernels that autograd "
               f"does not differentiate. Take first-order gradients through it (create_graph=False), or compute the "
               f"quantity whose second derivative you need in plain PyTorch.")

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():  # a plain first-order backward
                return backward(ctx, *grads)
            # create_graph=True: what a second derivative would differentiate, the upstream gradients and the saved
            # inputs (read before the backward, which may write over a saved output)
            links = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            mark = lambda o: None if o is None else _SecondDerivative.apply(message, o, *links)  # noqa: E731
            return tuple(mark(o) for o in outputs) if isinstance(outputs, tuple) else mark(outputs)
        return wrapper
    return decorate


def used_up(name: str) -> RuntimeError:
    """The error of a second backward through one eager call whose first backward wrote over what its forward saved
    (a gradient written in the forward, scaled in place; a kept logits tile): ``name`` the op."""
    return RuntimeError(f"kltriton: a second backward through the same {name} call (retain_graph=True): its first "
                        f"backward wrote over the gradient its forward saved. Compute the loss again for another "
                        f"backward.")
