"""Backend choice: Triton on CUDA, the C++ kernels on CPU, the PyTorch reference otherwise.

``backend=`` on a call wins over the ``KLTRITON_BACKEND`` environment variable, which wins
over the automatic choice. Backend modules are imported on first use, so ``import kltriton``
neither imports Triton nor compiles anything, and never touches CUDA.
"""
import importlib
import importlib.util
import os

import torch

BACKENDS = ("triton", "cpp", "reference")
_MODULES = {
    "triton": "kltriton.kernels.triton_stream",
    "cpp": "kltriton.kernels.cpp_stream",
    "reference": "kltriton.reference",
}


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def availability(name: str):
    """``(usable, why)`` for a backend on this machine, without touching a GPU."""
    if name == "reference":
        return True, "plain PyTorch, always available"
    if name == "triton":
        try:
            importlib.import_module("triton")
        except ImportError as err:  # pragma: no cover - triton is a dependency
            return False, f"triton is not importable: {err}"
        if triton_interpreted() and importlib.util.find_spec("numpy") is None:
            return False, "TRITON_INTERPRET=1 is set but Triton's interpreter needs numpy (pip install numpy)"
        return True, "CUDA tensors" + (", and CPU tensors under TRITON_INTERPRET=1" if triton_interpreted() else "")
    if name == "cpp":
        try:
            return importlib.import_module(_MODULES["cpp"]).availability()
        except ImportError as err:
            return False, f"C++ loader missing: {err}"
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")


def resolve(backend, logits):
    """The backend name to run ``logits`` (a tensor) with."""
    return _resolve(backend, logits.device.type, logits.dtype == torch.float64)


def _constant_for_dynamo(fn):
    """What ``torch.compiler.assume_constant_result`` does (it sets this flag), without importing
    ``torch._dynamo`` (about 1 s, and Triton) when kltriton is imported. The fullgraph compile
    tests fail if a torch release stops honouring the flag."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_dynamo
def _resolve(backend, device_type: str, is_float64: bool) -> str:
    # Plain values in, a string out: torch.compile runs this once while tracing and keeps
    # the answer instead of tracing into the imports and availability checks.
    name = backend if backend is not None else os.environ.get("KLTRITON_BACKEND") or None
    if name is not None and name not in BACKENDS:
        source = "backend" if backend is not None else "KLTRITON_BACKEND"
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    if name is None:
        if is_float64:
            return "reference"
        if device_type == "cuda":
            return "triton"
        if device_type == "cpu" and availability("cpp")[0]:
            return "cpp"
        return "reference"
    if name != "reference" and is_float64:
        raise TypeError(f"float64 logits run on the reference backend only, not backend={name!r}")
    if name == "triton":
        if device_type != "cuda" and not (device_type == "cpu" and triton_interpreted()):
            raise ValueError(f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 "
                             f"set before kltriton is imported); logits are on {device_type}")
        usable, why = availability("triton")
        if not usable:
            raise RuntimeError(f"backend='triton' is not available: {why}")
    if name == "cpp":
        if device_type != "cpu":
            raise ValueError(f"backend='cpp' needs CPU tensors; logits are on {device_type}")
        usable, why = availability("cpp")
        if not usable:
            raise RuntimeError(f"backend='cpp' is not available: {why}")
    return name


def module(name: str):
    """The backend module implementing ``forward`` / ``backward`` (see ``kltriton.kernels``)."""
    return importlib.import_module(_MODULES[name])
