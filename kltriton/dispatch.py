"""Backend choice per kernel family: Triton on CUDA, the C++ kernels on CPU, the PyTorch reference otherwise.

``backend=`` on a call wins over the ``KLTRITON_BACKEND`` environment variable, which wins over
the automatic choice. A backend implements a family in ``kltriton/kernels/<family>/<backend>.py``
(see ``kltriton.kernels``); modules are imported on first use, so ``import kltriton`` neither
imports Triton nor compiles anything, and never touches CUDA.

(Not named ``backends.py``: Dynamo skips tracing every file whose path contains
``triton/backends``, Triton's own backends folder, and ``kltriton/backends.py`` matches.)
"""
import importlib
import importlib.metadata
import importlib.util
import os

from kltriton._install import pip_install

BACKENDS = ("triton", "cpp", "reference")
# Kernel families and what they compute (the contracts live in kltriton/kernels/<family>/).
FAMILIES = {
    "stream": "statistics streamed over rows of logits",
    "loss": "policy loss with its logits gradient produced in the forward",
    "linear": "the stream statistics of logits given as hidden @ weight.T (GEMM tiles)",
    "truncation": "statistics of the top-k / top-p / min-p truncated distribution of each row",
    "divergence": "the generalized JSD's second pass (after the stream log-sum-exps) and its gradient",
}
# The automatic choice per device, in order of preference.
_PREFERENCE = {"cuda": ("triton", "reference"), "cpu": ("cpp", "reference")}


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _module_name(family: str, backend: str) -> str:
    return f"kltriton.kernels.{family}.{backend}"


def _backend_availability(backend: str):
    """``(usable, why)`` of a backend as a whole on this machine, without touching a GPU."""
    if backend == "reference":
        return True, "plain PyTorch, always available"
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return False, f"triton is not installed (CUDA builds of torch bring it; or {pip_install('triton')})"
        version = importlib.metadata.version("triton")
        if tuple(int(part) for part in version.split(".")[:2] if part.isdigit()) < (3, 6):
            return False, f"triton {version} is older than 3.6, the oldest tested"
        if triton_interpreted():
            if importlib.util.find_spec("numpy") is None:
                return False, "TRITON_INTERPRET=1 is set but Triton's interpreter needs numpy (pip install numpy)"
            return True, "CPU tensors through Triton's interpreter (TRITON_INTERPRET=1), and CUDA tensors"
        return True, "CUDA tensors"
    if backend == "cpp":
        from kltriton.kernels import cpp_library

        return cpp_library.availability()
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def availability(backend: str, family: str = "stream"):
    """``(usable, why)`` for ``backend`` running ``family`` on this machine."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if importlib.util.find_spec(_module_name(family, backend)) is None:
        return False, f"does not implement the {family!r} family"
    return _backend_availability(backend)


def implementation(family: str, backend: str):
    """The module implementing ``family`` on ``backend`` (its contract: ``kltriton.kernels.<family>``)."""
    return importlib.import_module(_module_name(family, backend))


def _constant_for_dynamo(fn):
    """What ``torch.compiler.assume_constant_result`` does (it sets this flag), without importing
    ``torch._dynamo`` (about 1 s, and Triton) when kltriton is imported. The fullgraph compile
    tests fail if a torch release stops honouring the flag."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_dynamo
def resolve(backend, family: str, device_type: str, is_float64: bool) -> str:
    """The backend name that runs ``family`` on tensors of ``device_type``.

    Plain values in, a string out: torch.compile runs this once while tracing and keeps the
    answer instead of tracing into the imports and availability checks.
    """
    name = backend if backend is not None else os.environ.get("KLTRITON_BACKEND") or None
    if name is not None and name not in BACKENDS:
        source = "backend" if backend is not None else "KLTRITON_BACKEND"
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    if name is None:
        if is_float64:
            return "reference"
        for candidate in _PREFERENCE.get(device_type, ("reference",)):
            if availability(candidate, family)[0]:
                return candidate
        return "reference"
    if name != "reference" and is_float64:
        raise TypeError(f"float64 logits run on the reference backend only, not backend={name!r}")
    if name == "triton" and device_type != "cuda" and not (device_type == "cpu" and triton_interpreted()):
        raise ValueError(f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 "
                         f"set before kltriton is imported); logits are on {device_type}")
    if name == "cpp" and device_type != "cpu":
        raise ValueError(f"backend='cpp' needs CPU tensors; logits are on {device_type}")
    usable, why = availability(name, family)
    if not usable:
        raise RuntimeError(f"backend={name!r} cannot run the {family!r} family here: {why}")
    return name

