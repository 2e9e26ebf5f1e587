"""Backend choice per kernel family: Triton on CUDA, the C++ kernels on CPU, the PyTorch reference otherwise.

``backend=`` on a call wins over the ``KLTRITON_BACKEND`` environment variable, which wins over the automatic
choice. Each backend describes itself once (``BACKENDS``: its name, the devices it runs on, whether it is usable
here and why, whether it takes float64) and implements a family in ``kltriton/kernels/<family>/<backend>.py``
(see ``kltriton.kernels``); the ``linear`` family (``LinearLogits``) is the same algorithm on every backend, GEMM
tiles folded by the backend's own ``stream``, ``loss`` and ``divergence`` kernels (``kernels.linear.tiles``), so it
is composed here rather than written per backend. Modules are imported on first use, so ``import kltriton``
neither imports Triton nor compiles anything, and never touches CUDA.

(Not named ``backends.py``: Dynamo skips tracing every file whose path contains ``triton/backends``, Triton's own
backends folder, and ``kltriton/backends.py`` matches.)
"""
import functools
import importlib
import importlib.metadata
import importlib.util
from types import SimpleNamespace
from typing import Callable, NamedTuple, Tuple

from kltriton._env import backend_override, triton_interpreted
from kltriton._install import pip_install

# Kernel families and what they compute (the contracts live in kltriton/kernels/<family>/).
FAMILIES = {
    "layout": "labels, mask, shift and packed segments into the per-row target; the inputs' value checks",
    "stream": "statistics streamed over rows of logits",
    "epilogue": "the [N] arithmetic after the statistics: the KL estimator, reward shaping, sequence means",
    "loss": "policy loss with its logits gradient produced in the forward",
    "linear": "the stream statistics of logits given as hidden @ weight.T (GEMM tiles)",
    "truncation": "statistics of the top-k / top-p / min-p truncated distribution of each row",
    "divergence": "the generalized JSD's second pass (after the stream log-sum-exps) and its gradient",
    "invariant": "row maxima and fixed-point sums, independent of how the vocabulary is cut (the invariant mode)",
}
COMPOSED = {"linear": ("stream", "loss", "divergence", "layout")}  # composed from these families of the same backend


class Backend(NamedTuple):
    """A backend, as it describes itself."""
    name: str
    devices: str                              # the tensors it takes, in words (for errors)
    runs_on: Callable[[str], bool]            # whether it takes tensors of this device type
    availability: Callable[[], Tuple[bool, str]]  # (usable on this machine, why), without touching a GPU
    float64: bool = False                     # whether it takes float64 logits (the oracle mode)


def _reference_availability():
    return True, "plain PyTorch, always available"


def _triton_availability():
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


def _cpp_availability():
    from kltriton.kernels import cpp_library

    return cpp_library.availability()


BACKENDS = {
    "triton": Backend("triton", "CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before kltriton is imported)",
                      lambda device: device == "cuda" or (device == "cpu" and triton_interpreted()),
                      _triton_availability),
    "cpp": Backend("cpp", "CPU tensors", lambda device: device == "cpu", _cpp_availability),
    "reference": Backend("reference", "tensors of any device", lambda device: True, _reference_availability,
                         float64=True),
}
# The automatic choice per device, in order of preference.
PREFERENCE = {"cuda": ("triton", "reference"), "cpu": ("cpp", "reference")}


def _module_name(family: str, backend: str) -> str:
    return f"kltriton.kernels.{family}.{backend}"


def _implements(family: str, backend: str) -> bool:
    if family in COMPOSED:
        return all(_implements(part, backend) for part in COMPOSED[family])
    return importlib.util.find_spec(_module_name(family, backend)) is not None


def _check_names(backend: str, family: str):
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)} or None, got {backend!r}")


@functools.lru_cache(maxsize=None)
def availability(backend: str, family: str = "stream"):
    """``(usable, why)`` for ``backend`` running ``family`` on this machine, found once per process: every call
    resolves its backend through it, and the checks (``find_spec``, ``importlib.metadata``) cost 0.5-1.5 ms, more
    than a whole kernel at small N (measured on an H100: a ~1.4 ms floor under every Triton call)."""
    _check_names(backend, family)
    if not _implements(family, backend):
        return False, f"does not implement the {family!r} family"
    return BACKENDS[backend].availability()


@functools.lru_cache(maxsize=None)
def implementation(family: str, backend: str):
    """The module (or, for a composed family, the namespace) implementing ``family`` on ``backend`` (its contract:
    ``kltriton.kernels.<family>``)."""
    if family == "linear":
        from kltriton.kernels.linear import tiles

        stream, loss, divergence, layout = (implementation(part, backend) for part in COMPOSED["linear"])
        forward, backward, column_forward, column_backward = tiles.bind(stream)
        jsd_forward, jsd_backward, divergence_loss = tiles.bind_divergence(divergence)
        one_tile_forward, one_tile_backward = tiles.bind_one_tile(stream, layout)
        return SimpleNamespace(forward=forward, backward=backward, column_forward=column_forward,
                               column_backward=column_backward, loss_forward=tiles.bind_loss(loss),
                               jsd_forward=jsd_forward, jsd_backward=jsd_backward, divergence_loss=divergence_loss,
                               one_tile_forward=one_tile_forward, one_tile_backward=one_tile_backward)
    return importlib.import_module(_module_name(family, backend))


@functools.lru_cache(maxsize=None)
def _automatic(family: str, device_type: str, is_float64: bool, usable) -> str:
    """The first backend of ``PREFERENCE`` that runs ``family`` here by ``usable`` (``availability``; found once for
    each, so a test that replaces ``availability`` gets its own answer)."""
    candidates = [b for b in PREFERENCE.get(device_type, ("reference",)) if BACKENDS[b].float64 or not is_float64]
    return next((b for b in candidates if usable(b, family)[0]), "reference")


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
    name = backend if backend is not None else backend_override()
    if name is not None and name not in BACKENDS:
        source = "backend" if backend is not None else "KLTRITON_BACKEND"
        raise ValueError(f"{source} must be one of {tuple(BACKENDS)}, got {name!r}")
    if name is None:
        return _automatic(family, device_type, is_float64, availability)
    chosen = BACKENDS[name]
    if is_float64 and not chosen.float64:
        raise TypeError(f"float64 logits run on the reference backend only, not backend={name!r}")
    if not chosen.runs_on(device_type):
        raise ValueError(f"backend={name!r} needs {chosen.devices}; logits are on {device_type}")
    usable, why = availability(name, family)
    if not usable:
        raise RuntimeError(f"backend={name!r} cannot run the {family!r} family here: {why}")
    return name
