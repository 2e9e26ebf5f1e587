"""One helper that turns a typed kernel function into a ``torch.library`` custom op with autograd.

``torch.library.custom_op`` needs the schema (from the function's annotations), a fake kernel for
tracing, and for autograd a ``setup_context`` that saves state plus a backward that unpacks it by
position. ``define_op`` does the bookkeeping once: the saved state is named once (``save``), and
the backward reads it by name and returns gradients by input name.
"""
import inspect
from types import SimpleNamespace

import torch


def define_op(name, fn, *, outputs, fake, save=(), backward=None, materialize_grads=True):
    """Register ``fn`` as ``kltriton::<name>`` and return the op.

    Args:
        fn: the kernel launcher; its annotations give the schema. Returns a tuple of tensors
            named by ``outputs`` (or one tensor when ``outputs`` has one name).
        fake: same arguments as ``fn``, returns empty tensors of the outputs' shapes and dtypes.
        save: names of ``fn``'s parameters and of ``outputs`` that ``backward`` reads.
        backward: ``backward(saved, grads) -> {input name: gradient}``; ``saved`` has the ``save``
            names as attributes (and ``needs_grad``: input name -> whether autograd wants its
            gradient), ``grads`` maps output names to their gradient (``None`` when that
            output was not used). Omit it for an op that is not differentiable.
        materialize_grads: False passes ``None`` (not zeros) for unused outputs' gradients to
            ``backward``: an op with a large output that is never differentiated then allocates
            and fills nothing for it.
    """
    op = torch.library.custom_op(f"kltriton::{name}", fn, mutates_args=())
    op.register_fake(fake)
    if backward is None:
        return op
    params = list(inspect.signature(fn).parameters)

    def setup_context(ctx, inputs, output):
        output = output if isinstance(output, (tuple, list)) else (output,)
        values = dict(zip(params, inputs), **dict(zip(outputs, output)))
        ctx.tensor_names = [k for k in save if isinstance(values[k], torch.Tensor)]
        ctx.save_for_backward(*(values[k] for k in ctx.tensor_names))
        ctx.plain = {k: values[k] for k in save if k not in ctx.tensor_names}
        ctx.set_materialize_grads(materialize_grads)

    def autograd_backward(ctx, *grads):
        saved = SimpleNamespace(**dict(zip(ctx.tensor_names, ctx.saved_tensors)), **ctx.plain,
                                needs_grad=dict(zip(params, ctx.needs_input_grad)))
        result = backward(saved, dict(zip(outputs, grads)))
        return tuple(result.get(p) for p in params)

    op.register_autograd(autograd_backward, setup_context=setup_context)
    return op
