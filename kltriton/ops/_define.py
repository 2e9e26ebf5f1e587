"""Custom ops from declared arguments: one ``torch.library`` op per kernel pass, keyed on sides.

An op declares its arguments once, as ``(name, kind)`` pairs. A kind is a schema type (``TENSOR``, ``OPTIONAL``,
``INT``, ``BOOL``, ``STR``, ``DTYPE``) or a ``Group`` of them that the launcher, the fake and the backward receive as one
value: ``SIDE`` (a ``kltriton.kernels.linear.Side``: dense logits, or an LM head's hidden states, weight, bias,
scale and softcap; None when absent), ``BASIS`` (the gradient basis of ``constants.GRADIENT_BASIS``), ``NEEDS_GRAD``
(which of a side's hidden states or logits, weight and bias get a gradient), ``LOSS_INPUTS``. The schema lists a
group's fields (``policy_x``, ``policy_weight``, ...), derived from the group's type, so no launcher, fake or
caller lists them, and a new basis term changes no op.

The saved state of the backward is named once (``save``, input or output names); the backward reads it by name
and returns gradients by input name (a ``SIDE`` input's gradient: ``(d_x, d_weight, d_bias)``).
"""
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional

import torch

from kltriton.kernels.constants import GRADIENT_BASIS
from kltriton.kernels.linear import Side
from kltriton.kernels.loss import LossInputs
from kltriton.kernels.statistics import Basis

TENSOR, OPTIONAL, INT, BOOL, STR, DTYPE = "Tensor", "Tensor?", "int", "bool", "str", "ScalarType"


class NeedsGrad(NamedTuple):
    """Which of a side's tensors get a gradient."""
    x: bool
    weight: bool
    bias: bool


class Group(NamedTuple):
    """An argument made of several schema arguments: ``kind`` builds the value from its fields, ``types`` are their
    schema types; with ``optional``, a value whose fields are all None is None."""
    kind: type
    types: tuple
    optional: bool = False


SIDE = Group(Side, (OPTIONAL,) * len(Side._fields), optional=True)
BASIS = Group(Basis, tuple(TENSOR if term in ("label", "p") else OPTIONAL for term in GRADIENT_BASIS))
NEEDS_GRAD = Group(NeedsGrad, (BOOL,) * 3)
LOSS_INPUTS = Group(LossInputs, (OPTIONAL, TENSOR, TENSOR, TENSOR, TENSOR, OPTIONAL))
assert Basis._fields == GRADIENT_BASIS


def _width(kind) -> int:
    return len(kind.types) if isinstance(kind, Group) else 1


def _group(kind: Group, fields):
    if kind.optional and all(f is None for f in fields):
        return None
    return kind.kind(*fields)


def _fields(kind: Group, value):
    return (None,) * len(kind.types) if value is None else tuple(value)


_LIBRARY = torch.library.Library("kltriton", "FRAGMENT")


class Op:
    """A ``torch.library`` op with grouped arguments: call it with one value per declared argument; ``overload`` is
    the ``torch.ops.kltriton`` op and ``flatten`` gives its schema arguments (for ``torch.library.opcheck``).

    The op is defined on a ``torch.library.Library`` with its own autograd kernel rather than through
    ``torch.library.custom_op``: custom_op's autograd path re-reads the schema once per argument on every call
    (quadratic in the argument count: 40-150 us a call for these schemas), most of a call's host cost at small
    shapes."""

    def __init__(self, name, inputs, outputs, launch, fake):
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        names = [arg for arg, _ in self.inputs] + list(self.outputs)
        assert len(set(names)) == len(names), f"kltriton::{name}: an input and an output share a name"
        self.spans, self.layout, start = {}, [], 0  # layout: (name, Group or None, start, stop) in schema order
        for arg, kind in list(self.inputs) + [(out, TENSOR) for out in self.outputs]:
            self.spans[arg] = (start, start + _width(kind))
            self.layout.append((arg, kind if isinstance(kind, Group) else None, start, start + _width(kind)))
            start += _width(kind)
        params = []
        for arg, kind in self.inputs:
            if isinstance(kind, Group):
                params += [f"{t} {arg}_{field}" for t, field in zip(kind.types, kind.kind._fields)]
            else:
                params.append(f"{kind} {arg}")
        returns = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join(["Tensor"] * len(self.outputs)) + ")"
        _LIBRARY.define(f"{name}({', '.join(params)}) -> {returns}")
        _LIBRARY.impl(name, lambda *flat: launch(self.grouped(flat)), "CompositeExplicitAutograd")
        torch.library.register_fake(f"kltriton::{name}", lambda *flat: fake(self.grouped(flat)), lib=_LIBRARY)
        self.overload = getattr(torch.ops.kltriton, name).default

    def grouped(self, flat) -> SimpleNamespace:
        """The arguments (and outputs, when ``flat`` holds them after the inputs) by name, groups built."""
        count = len(flat)
        return SimpleNamespace(**{arg: flat[start] if group is None else _group(group, flat[start:stop])
                                  for arg, group, start, stop in self.layout if start < count})

    def flatten(self, *args) -> tuple:
        flat = []
        for (arg, kind), value in zip(self.inputs, args, strict=True):
            flat += _fields(kind, value) if isinstance(kind, Group) else [value]
        return tuple(flat)

    def __call__(self, *args):
        return self.overload(*self.flatten(*args))


def _below_autograd(overload, keyset, flat):
    """Run ``overload`` on the dispatch keys under autograd (the backend's kernel, a fake, a tracing mode)."""
    with torch._C._AutoDispatchBelowAutograd():
        return overload.redispatch(keyset & torch._C._after_autograd_keyset, *flat)


def define_op(name, *, inputs, outputs, launch, fake, save=(), backward: Optional[Callable] = None,
              materialize_grads=True) -> Op:
    """Register ``kltriton::<name>`` and return it as an ``Op``.

    Args:
        inputs: ``(name, kind)`` pairs in schema order.
        outputs: the names of the returned tensors (one tensor when there is one name).
        launch: ``launch(args) -> outputs`` (a tuple, or the tensor), ``args`` the inputs by name.
        fake: the same, returning empty tensors of the outputs' shapes and dtypes (for tracing).
        save: names of inputs and outputs that ``backward`` reads.
        backward: ``backward(saved, grads) -> {input name: gradient}``; ``saved`` has the ``save`` names as
            attributes and ``needs_grad`` (input name -> bool, a group's: a tuple of bools), ``grads`` maps output
            names to their gradient (None when unused, with ``materialize_grads=False``). Omit it for an op that is
            not differentiable (its outputs never require grad).
    """
    op = Op(name, inputs, outputs, launch, fake)
    if backward is None:
        _LIBRARY.impl(name, torch.library.fallthrough_kernel, "Autograd")
        return op
    kept = sorted({i for arg in save for i in range(*op.spans[arg])})
    n_inputs = op.spans[op.inputs[-1][0]][1]

    class Function(torch.autograd.Function):
        """The op's autograd node: the forward runs below autograd and saves the ``save`` slots."""

        @staticmethod
        def forward(ctx, keyset, *flat_inputs):
            output = _below_autograd(op.overload, keyset, flat_inputs)
            flat = flat_inputs + (output if isinstance(output, tuple) else (output,))
            ctx.tensor_slots = [i for i in kept if isinstance(flat[i], torch.Tensor)]
            ctx.save_for_backward(*(flat[i] for i in ctx.tensor_slots))
            ctx.plain = {i: flat[i] for i in kept if i not in ctx.tensor_slots}
            ctx.set_materialize_grads(materialize_grads)
            return output

        @staticmethod
        def backward(ctx, *grads):
            flat = [None] * (n_inputs + len(op.outputs))
            for i, tensor in zip(ctx.tensor_slots, ctx.saved_tensors):
                flat[i] = tensor
            for i, value in ctx.plain.items():
                flat[i] = value
            saved = op.grouped(flat)
            needs = ctx.needs_input_grad[1:]  # [0] is the dispatch key set
            saved.needs_grad = {arg: tuple(needs[slice(*op.spans[arg])]) if isinstance(kind, Group)
                                else needs[op.spans[arg][0]] for arg, kind in op.inputs}
            out = [None] * n_inputs
            for arg, grad in backward(saved, dict(zip(op.outputs, grads))).items():
                start, _ = op.spans[arg]
                for i, g in enumerate(grad if isinstance(grad, tuple) else (grad,)):
                    out[start + i] = g
            return (None, *out)

    Function.__name__ = f"{name}_backward_node"

    def autograd_kernel(keyset, *flat):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*flat):
            return Function.apply(keyset, *flat)
        return _below_autograd(op.overload, keyset, flat)

    _LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op
