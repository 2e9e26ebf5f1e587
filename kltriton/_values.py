"""Python values as the kernels take them, a leaf module (torch only): a float option checked (``check_float``), and
a float as a device scalar or a vector of floats as a device vector, made once per value (``runtime_scalar``,
``constant_vector``: on a GPU every small tensor made per call is a kernel launch)."""
import collections
import math
import struct

import torch


def check_float(name: str, value, *, above=None, at_least=None, allow_none: bool = False):
    """``value`` as a python float: a real number (not a bool or a tensor), finite, ``> above`` and
    ``>= at_least`` when given; ``None`` passes when ``allow_none``. Every float option of every op goes
    through here (a NaN passes every ``<`` / ``>`` check, so each range check alone would let it through).
    While ``torch.compile`` traces, the float is a graph input and is returned unchecked (a comparison
    would specialize the graph on its value)."""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a python float, got None")
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a python float{' or None' if allow_none else ''}, got "
                        f"{type(value).__name__}")
    if torch.compiler.is_compiling():
        return value
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be > {above}, got {value}")
    if at_least is not None and not value >= at_least:
        raise ValueError(f"{name} must be >= {at_least}, got {value}")
    return value


_SCALARS = collections.OrderedDict()  # (device, value.hex()) -> 0-dim float64 tensor, most recent last
SCALAR_CACHE_SIZE = 256


def runtime_scalar(value, device) -> torch.Tensor:
    """A python float as a 0-dim float64 tensor on ``device``, the form the custom ops take.

    A float argument of a custom op is baked into the graph by ``torch.compile`` (a new value
    recompiles); a tensor is data. While ``torch.compile`` traces, it is written as ``ones * value``
    (kernels with the value as an argument: no host-to-device copy) because Dynamo turns a traced float
    into a graph input only where it meets tensor arithmetic, and would specialize ``torch.full((), value)``.
    In eager calls the tensor of each value is made once per device and kept (the ``SCALAR_CACHE_SIZE`` most
    recent values): on a GPU every small tensor made per call is a kernel launch. Nobody writes to it.
    """
    if torch.compiler.is_compiling():
        return torch.ones((), dtype=torch.float64, device=device) * value
    key = (device, struct.pack("d", value))  # the bits: -0.0 and 0.0 are two values
    scalar = _SCALARS.get(key)
    if scalar is None:
        scalar = torch.full((), value, dtype=torch.float64, device=device)
        if not _capturing(scalar.device):  # made inside a CUDA graph capture: the graph's memory, not kept
            _SCALARS[key] = scalar
            if len(_SCALARS) > SCALAR_CACHE_SIZE:
                _SCALARS.popitem(last=False)
    return scalar


def constant_vector(values, device) -> torch.Tensor:
    """Python floats as one float64 vector on ``device``, made once per device and set of values and kept with the
    scalars of ``runtime_scalar`` (eager calls only: while ``torch.compile`` traces, build it from
    ``runtime_scalar``s). Nobody writes to it."""
    key = (device, len(values), struct.pack(f"{len(values)}d", *values))  # the bits; never a scalar's key
    vector = _SCALARS.get(key)
    if vector is None:
        vector = torch.tensor(values, dtype=torch.float64).to(device)
        if not _capturing(vector.device):
            _SCALARS[key] = vector
            if len(_SCALARS) > SCALAR_CACHE_SIZE:
                _SCALARS.popitem(last=False)
    return vector


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
