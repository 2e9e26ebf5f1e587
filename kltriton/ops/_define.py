"""Custom ops from declared arguments: one ``torch.library`` op per kernel pass, keyed on sides.

An op declares its arguments once, as ``(name, kind)`` pairs. A kind is a schema type (``TENSOR``, ``OPTIONAL``,
``INT``, ``FLOAT``, ``BOOL``, ``STR``, ``DTYPE``, ``MUTABLE``: a tensor the op writes to) or a ``Group`` of them that the launcher, the fake and the backward receive as one
value: ``SIDE`` (a ``kltriton.kernels.linear.Side``: dense logits, or an LM head's hidden states, weight, bias,
scale and softcap; None when absent), ``BASIS`` (the gradient basis of ``constants.GRADIENT_BASIS``), ``UPSTREAM``
(``kltriton.kernels.stream.Upstream``: upstream gradients of the statistics, the basis made in the kernel), ``NEEDS_GRAD``
(which of a side's hidden states or logits, weight and bias get a gradient), ``LOSS_INPUTS``. The schema lists a
group's fields (``policy_x``, ``policy_weight``, ...), derived from the group's type, so no launcher, fake or
caller lists them, and a new basis term changes no op.

The saved state of the backward is named once (``save``, input or output names); the backward reads it by name
and returns gradients by input name (a ``SIDE`` input's gradient: ``(d_x, d_weight, d_bias)``).
"""
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional

import torch

from kltriton._autograd import first_order
from kltriton.kernels.constants import GRADIENT_BASIS
from kltriton.kernels.linear import Side
from kltriton.kernels.loss import LossInputs
from kltriton.kernels.statistics import Basis
from kltriton.kernels.stream import Upstream

TENSOR, OPTIONAL, INT, FLOAT, BOOL, STR, DTYPE = "Tensor", "Tensor?", "int", "float", "bool", "str", "ScalarType"
MUTABLE = "Tensor(a!)"  # a tensor the op writes to (at most one per op)


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
LOSS_INPUTS = Group(LossInputs, (OPTIONAL, TENSOR, TENSOR, TENSOR, TENSOR, OPTIONAL, OPTIONAL))
UPSTREAM = Group(Upstream, (OPTIONAL,) * len(Upstream._fields))
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
        self.launch, self.function = launch, None  # function: the eager autograd node (``define_op``'s backward)
        self.names = tuple(arg for arg, _ in self.inputs)
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
        _LIBRARY.impl(name, lambda *flat: _distinct(launch(self.grouped(flat))), "CompositeExplicitAutograd")
        torch.library.register_fake(f"kltriton::{name}", lambda *flat: _distinct(fake(self.grouped(flat))),
                                    lib=_LIBRARY)
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
        if not eager(args):
            return self.overload(*self.flatten(*args))
        named = SimpleNamespace(**dict(zip(self.names, args)))
        if self.function is not None and torch.is_grad_enabled():
            first = args[0]
            tensors = tuple(first) if isinstance(first, tuple) else (first,)
            if torch._C._any_requires_grad(*(t for t in tensors if t is not None)):
                differentiable = self.function.apply(named, *tensors)
                outputs = list(named.outputs)
                for i, tensor in zip(named.differentiable, differentiable):
                    outputs[i] = tensor
                del named.outputs  # the node holds ``named``: no reference from it to its own outputs
                return tuple(outputs) if len(outputs) > 1 else outputs[0]
        return self.launch(named)


def _distinct(outputs):
    """A registered op's outputs with no tensor twice: its schema declares no aliasing, while a launcher returns one
    empty tensor for every output a call does not compute (``statistics.empty_stats``), which eager calls keep."""
    if not isinstance(outputs, tuple):
        return outputs
    seen = set()
    distinct = []
    for output in outputs:
        if isinstance(output, torch.Tensor):
            output = output.clone() if id(output) in seen else output
            seen.add(id(output))
        distinct.append(output)
    return tuple(distinct)


_TRACING_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, key) for key in ("FAKE", "PROXY", "FUNCTIONAL"))
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a tensor's type, not a subclass (a DTensor, a fake)
# plain tensors and the other schema types
_SIMPLE = frozenset((*PLAIN_TENSORS, int, float, bool, str, type(None), torch.dtype))


def eager(args) -> bool:
    """Whether a call of an op (``args``: its arguments, groups as tuples) may skip the dispatcher and run its launcher
    (or autograd node) directly: not while ``torch.compile``, ``make_fx`` or a functorch transform traces it, and only
    with plain tensors (a fake, functional or other subclass tensor goes through the registered op, which is what
    those systems see). A mode that only watches (a ``TorchDispatchMode`` that counts ops) sees the ops the launcher
    dispatches. Every call asks: the common answer (no mode, no transform) costs a few hundred nanoseconds."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if torch._C._len_torch_dispatch_stack():
        for key in _TRACING_MODES:
            if torch._C._get_dispatch_mode(key) is not None:
                return False
    for arg in args:
        if type(arg) in _SIMPLE:
            continue
        if isinstance(arg, tuple):  # a group's fields
            for field in arg:
                if type(field) not in _SIMPLE and isinstance(field, torch.Tensor):
                    return False
        elif isinstance(arg, torch.Tensor):
            return False
    return True


def _eager_function(op: Op, save, backward, materialize_grads, grad_outputs):
    """The autograd node of an eager call (``Op.__call__`` without the dispatcher): ``apply(args, *tensors)`` with
    ``args`` the inputs by name and ``tensors`` the first input's tensors (a ``Group``'s fields, or the tensor), the
    only input that gets a gradient. The forward runs the launcher and returns only the outputs that can have a
    gradient (``grad_outputs(args)``: on a CPU core every output of an autograd node costs a few microseconds); every
    output goes to ``args.outputs``, their indices to ``args.differentiable``. It saves the first input's tensors and
    the ``save`` outputs it returns (the version counters catch an in-place change before the backward; a returned
    output held as it is would be a reference cycle through this node); the other ``save`` outputs and inputs are held
    as they are (each saved tensor costs a CPU core a fraction of a microsecond, most of them are empty)."""
    first, first_kind = op.inputs[0]
    grouped = isinstance(first_kind, Group)
    saved_outputs = [i for i, out in enumerate(op.outputs) if out in save]
    index = {out: i for i, out in enumerate(op.outputs)}
    plans = {}  # grad_outputs' names -> (returned, saved and returned, saved and held) output indices

    class EagerFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, args, *tensors):
            outs = op.launch(args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            names = grad_outputs(args)
            plan = plans.get(names)
            if plan is None:  # the outputs' indices: which are returned, saved, held (a few sets of names per op)
                differentiable = [index[name] for name in names]
                plan = plans[names] = (differentiable, [i for i in saved_outputs if i in differentiable],
                                       [i for i in saved_outputs if i not in differentiable])
            differentiable, ctx.tracked, held = plan
            args.outputs = outs
            args.differentiable = ctx.differentiable = differentiable
            ctx.args, ctx.present = args, [t is not None for t in tensors]
            ctx.held, ctx.repeated = [(i, outs[i]) for i in held], False
            ctx.save_for_backward(*(t for t in tensors if t is not None), *(outs[i] for i in ctx.tracked))
            ctx.set_materialize_grads(materialize_grads)
            return tuple(outs[i] for i in differentiable)

        @staticmethod
        @first_order(f"kltriton::{op.overload.name().split('::')[-1]}")
        def backward(ctx, *returned):
            grads = dict.fromkeys(op.outputs)
            for i, grad in zip(ctx.differentiable, returned):
                grads[op.outputs[i]] = grad
            saved = SimpleNamespace(**vars(ctx.args))
            stored = iter(ctx.saved_tensors)
            fields = [next(stored) if here else None for here in ctx.present]
            setattr(saved, first, _group(first_kind, fields) if grouped else fields[0])
            for i in ctx.tracked:
                setattr(saved, op.outputs[i], next(stored))
            for i, tensor in ctx.held:
                setattr(saved, op.outputs[i], tensor)
            needs = ctx.needs_input_grad[1:]
            saved.needs_grad = {first: tuple(needs) if grouped else needs[0]}
            saved.eager = True  # the outputs it saved are its own: the backward may write over them
            saved.repeated, ctx.repeated = ctx.repeated, True  # a later backward (retain_graph) finds them written
            grad = backward(saved, grads).get(first)
            grad = grad if isinstance(grad, tuple) else (grad,)
            return (None, *grad, *(None,) * (len(ctx.present) - len(grad)))

    EagerFunction.__name__ = f"{op.overload.name().split('::')[-1]}_backward_node"
    return EagerFunction


def _below_autograd(overload, keyset, flat):
    """Run ``overload`` on the dispatch keys under autograd (the backend's kernel, a fake, a tracing mode)."""
    with torch._C._AutoDispatchBelowAutograd():
        return overload.redispatch(keyset & torch._C._after_autograd_keyset, *flat)


def define_op(name, *, inputs, outputs, launch, fake, save=(), backward: Optional[Callable] = None,
              materialize_grads=True, grad_outputs=None) -> Op:
    """Register ``kltriton::<name>`` and return it as an ``Op``.

    Args:
        inputs: ``(name, kind)`` pairs in schema order.
        outputs: the names of the returned tensors (one tensor when there is one name).
        launch: ``launch(args) -> outputs`` (a tuple, or the tensor), ``args`` the inputs by name.
        fake: the same, returning empty tensors of the outputs' shapes and dtypes (for tracing).
        save: names of inputs and outputs that ``backward`` reads.
        backward: ``backward(saved, grads) -> {input name: gradient}``; ``saved`` has the ``save`` names as
            attributes, ``needs_grad`` (input name -> bool, a group's: a tuple of bools) and ``eager`` (True in an
            eager call, whose saved outputs nobody else holds: the backward may write over them; ``repeated``: a
            backward of the same eager call ran before, and wrote over them), ``grads`` maps output
            names to their gradient (None when unused, with ``materialize_grads=False``). Omit it for an op that is
            not differentiable (its outputs never require grad).
        grad_outputs: the names of the outputs that can have a gradient (default: every output), or a function of the
            inputs by name returning them (the statistics a call computes); the others come out without one.
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
        @first_order(f"kltriton::{name}")
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
    names = tuple(outputs) if grad_outputs is None else grad_outputs
    op.function = _eager_function(op, save, backward, materialize_grads,
                                  names if callable(names) else (lambda args: names))

    def autograd_kernel(keyset, *flat):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*flat):
            return Function.apply(keyset, *flat)
        return _below_autograd(op.overload, keyset, flat)

    _LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op
