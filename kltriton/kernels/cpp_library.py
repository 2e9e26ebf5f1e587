"""The C++ CPU library (``csrc/``): builds or loads it once, registering ``torch.ops.kltriton_cpp.*``.

Family-agnostic: every family's ``cpp.py`` backend calls ``load()`` and then its own ops. The
kernels use SIMD through ATen's ``Vectorized<float>`` for the machine's CPU capability (AVX512 /
AVX2 / portable) and OpenMP threads over rows (``at::parallel_for``, so ``torch.set_num_threads``
applies); results do not depend on the number of threads.

Loading, in order (``load()``; importing this module compiles nothing):

1. the ops are already registered in this process: nothing to do (never loaded twice);
2. an ahead-of-time library ``kltriton/_C*.so`` (``KLTRITON_BUILD_CPP=1 pip install
   --no-build-isolation .``) built for a CPU capability this machine has
   (``KLTRITON_CPP_AOT=0`` ignores it);
3. a JIT build with ``torch.utils.cpp_extension.load`` (needs a C++ compiler, ``$CXX`` or ``c++``,
   and ninja), cached in ``$KLTRITON_CACHE_DIR`` or ``~/.cache/kltriton``, one directory per
   (torch version, CPU capability, hash of the sources and flags). Concurrent builds are serialised
   by an ``flock`` on ``<cache>/<key>.lock`` (released by the OS if the builder dies); a stale torch
   ``FileBaton`` left by a killed build is removed under that lock. A finished build is loaded
   without a compiler next time. A build prints one line to stderr when it starts, one every
   ``PROGRESS_EVERY_S`` seconds while it runs (sources compiled so far, time so far) and one with its
   total time; ``KLTRITON_VERBOSE_BUILD=1`` shows the compiler's own output.

If none works, ``availability()`` is ``(False, reason)`` and one ``warnings.warn`` per process says
why; automatic backend choice then uses the PyTorch reference.
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from kltriton._env import cache_dir, check_flags, env_flag
from kltriton._env import compiler as cxx
from kltriton.kernels.constants import (CPP_HEADERS, CPP_LINK_FLAGS, CPP_SOURCES, CPU_CAPABILITIES,
                                        cpp_compile_flags)

NAMESPACE = "kltriton_cpp"
SOURCES, HEADERS, LINK_FLAGS = CPP_SOURCES, CPP_HEADERS, CPP_LINK_FLAGS
_BUILD_TAG = b"KLTRITON_CPP_BUILD_TAG cap="
PROGRESS_EVERY_S = 20.0  # a build says it is alive at least this often: a slow build must not look like a hang
_CAP_RANK = {cap: rank for rank, cap in enumerate(CPU_CAPABILITIES)}
_OK_MARKER = "kltriton_build_ok"


class CppUnavailable(RuntimeError):
    """The C++ backend could not be loaded or built (the message says why)."""


_lock = threading.RLock()
_state: dict = {"loaded": False, "how": None, "error": None, "warned": False, "loads": 0}


# ----------------------------------------------------------------------------- build configuration

def cpu_capability() -> str:
    """ATen's CPU capability mapped to the flag sets above (``DEFAULT`` when not x86 AVX2/512)."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "DEFAULT"
    return cap if cap in _CAP_RANK else "DEFAULT"


def compile_flags(cap: str | None = None) -> list[str]:
    """C++ flags of a build for ``cap`` (the ISA flags never exceed what ATen detected)."""
    return cpp_compile_flags(cpu_capability() if cap is None else cap)


def _package_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def source_dir() -> Path | None:
    """``csrc`` shipped inside the package (``kltriton/csrc``) or of a source checkout."""
    pkg = _package_dir()
    for cand in (pkg / "csrc", pkg.parent / "csrc"):
        if all((cand / f).is_file() for f in SOURCES + HEADERS):
            return cand
    return None


def cache_root() -> Path:
    env = cache_dir()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kltriton"


def build_key(src: Path, cap: str | None = None) -> str:
    cap = cpu_capability() if cap is None else cap
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.encode() + b"\0" + (src / f).read_bytes() + b"\0")
    h.update(" ".join(compile_flags(cap) + list(LINK_FLAGS)).encode())
    h.update(f"{sys.platform}-{torch.__version__}".encode())
    torch_ver = re.sub(r"[^A-Za-z0-9.]+", "_", torch.__version__)
    return f"torch{torch_ver}-{cap.lower()}-{h.hexdigest()[:16]}"


# ----------------------------------------------------------------------------- loading

def _registered() -> bool:
    try:
        return hasattr(getattr(torch.ops, NAMESPACE), "stream_forward")
    except Exception:
        return False


def _lib_capability(path: Path) -> str | None:
    """The CPU capability an ahead-of-time library was compiled for (from its embedded tag)."""
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            i = data.find(_BUILD_TAG)
            if i < 0:
                return None
            j = data.find(b";", i, i + 64)
            cap = data[i + len(_BUILD_TAG): j].decode("ascii", "replace") if j > 0 else ""
    except (OSError, ValueError):
        return None
    return "DEFAULT" if cap == "CPU_CAPABILITY" else cap


def aot_library_path() -> Path | None:
    """Path of an ahead-of-time built library (``kltriton/_C*.so``) usable on this machine, or None.

    ``KLTRITON_BUILD_CPP=1`` at ``pip install --no-build-isolation`` builds it (see setup.py).
    A library built for a CPU capability this machine lacks is ignored (never loaded).
    """
    if not env_flag("KLTRITON_CPP_AOT", True):
        return None
    pkg = _package_dir()
    here = _CAP_RANK[cpu_capability()]
    for path in sorted(pkg.glob("_C*.so")) + sorted(pkg.glob("_C*.pyd")):
        cap = _lib_capability(path)
        if cap in _CAP_RANK and _CAP_RANK[cap] <= here:
            return path
    return None


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive inter-process lock (``flock``; the OS drops it if the holder dies)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: torch's FileBaton still guards the build
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _clear_stale_baton(build_dir: Path) -> None:
    """Remove torch's ``FileBaton`` file left by a killed build (call only under ``_file_lock``)."""
    stale = build_dir / "lock"
    with contextlib.suppress(FileNotFoundError):
        stale.unlink()


def _say(message: str) -> None:
    print(f"kltriton: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def build_progress(build_dir: Path, sources, every_s: float):
    """Report the build of ``sources`` into ``build_dir`` that runs in the ``with`` body: every ``every_s``
    seconds a stderr line with the sources compiled so far (their ``.o`` files in ``build_dir``, ninja's names)
    and the time so far; when the body succeeds, a last line with the total time."""
    started = time.perf_counter()
    objects = [build_dir / f"{Path(name).stem}.o" for name in sources]
    stop = threading.Event()

    def report():
        while not stop.wait(every_s):
            done = sum(obj.is_file() for obj in objects)
            step = f"{done} of {len(objects)} sources compiled" if done < len(objects) else "linking"
            _say(f"still building the C++ CPU kernels: {step}, {time.perf_counter() - started:.0f} s so far")

    reporter = threading.Thread(target=report, name="kltriton-build-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        stop.set()
        reporter.join()
    _say(f"C++ CPU kernels built in {time.perf_counter() - started:.0f} s")


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))
    _state["loads"] += 1


def _jit_build(src: Path) -> str:
    cap = cpu_capability()
    key = build_key(src, cap)
    root = cache_root()
    build_dir = root / key
    name = "kltriton_cpp_" + key.rsplit("-", 1)[1][:12]
    so = build_dir / f"{name}.so"
    ok = build_dir / _OK_MARKER
    compiler = cxx()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CppUnavailable(f"cannot create the build cache {root} ({err}); set KLTRITON_CACHE_DIR") from err
    with _file_lock(root / f"{key}.lock"):
        if so.is_file() and ok.is_file():
            _load_library(so)
            return f"cached JIT build {so} ({cap})"
        if shutil.which(compiler) is None:
            raise CppUnavailable(f"no C++ compiler: {compiler!r} not found (set CXX to a C++17 compiler)")
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            raise CppUnavailable("ninja is not available (pip install ninja)")
        build_dir.mkdir(parents=True, exist_ok=True)
        _clear_stale_baton(build_dir)
        ok.unlink(missing_ok=True)
        _say(f"building the C++ CPU kernels ({cap}, {len(SOURCES)} sources) in {build_dir}, once per torch version "
             f"and CPU: 1-2.5 minutes on 2 cores, longer under load; a line every {PROGRESS_EVERY_S:.0f} s...")
        try:
            with build_progress(build_dir, SOURCES, PROGRESS_EVERY_S):
                cpp_extension.load(
                    name=name,
                    sources=[str(src / f) for f in SOURCES],
                    extra_cflags=compile_flags(cap),
                    extra_ldflags=list(LINK_FLAGS),
                    extra_include_paths=[str(src)],
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=env_flag("KLTRITON_VERBOSE_BUILD", False),
                )
        except Exception as err:
            tail = str(err).strip().splitlines()[-12:]
            raise CppUnavailable(f"build failed in {build_dir}: " + "\n".join(tail)) from err
        _state["loads"] += 1
        ok.write_text(" ".join(compile_flags(cap)) + "\n")
        return f"JIT build {so} ({cap})"


def _load_impl() -> str:
    if _registered():
        return "already registered in this process"
    aot = aot_library_path()
    if aot is not None:
        try:
            _load_library(aot)
            return f"ahead-of-time build {aot}"
        except (OSError, RuntimeError) as err:  # e.g. built against another torch: try the JIT
            if _registered():
                return f"ahead-of-time build {aot}"
            aot_err = err
    else:
        aot_err = None
    src = source_dir()
    if src is None:
        msg = "the C++ sources (csrc/) are not installed"
        if aot_err is not None:
            msg += f" and the ahead-of-time library failed to load: {aot_err}"
        raise CppUnavailable(msg)
    return _jit_build(src)


def load() -> str:
    """Load (building if needed) the C++ ops once per process; returns how. Raises ``CppUnavailable``."""
    if _state["loaded"]:  # every kernel call comes here: no lock, no environment read once loaded
        return _state["how"]
    check_flags()  # a mistyped flag is an error naming it, not a silent fallback
    with _lock:
        if _state["loaded"]:
            return _state["how"]
        if _state["error"] is not None:
            raise CppUnavailable(_state["error"])
        try:
            how = _load_impl()
        except Exception as err:
            reason = str(err) if isinstance(err, CppUnavailable) else f"{type(err).__name__}: {err}"
            _state["error"] = reason
            if not _state["warned"]:
                _state["warned"] = True
                warnings.warn(f"kltriton: the C++ CPU backend is unavailable, using the PyTorch "
                              f"reference instead: {reason}", RuntimeWarning, stacklevel=2)
            raise CppUnavailable(reason) from err
        if not _registered():  # pragma: no cover - a library without the ops
            _state["error"] = f"loaded {how} but torch.ops.{NAMESPACE} has no stream_forward"
            raise CppUnavailable(_state["error"])
        _state["loaded"], _state["how"] = True, how
        return how


def availability(build: bool = True) -> tuple[bool, str]:
    """``(usable, why)``. Builds / loads on first call unless ``build=False`` (then only says
    whether loading could work: ops registered, an AOT library, a cached build or a compiler)."""
    with _lock:
        if _state["loaded"]:
            return True, _state["how"]
        if _state["error"] is not None:
            return False, _state["error"]
    if not build:
        if _registered():
            return True, "already registered in this process"
        if aot_library_path() is not None:
            return True, f"ahead-of-time build {aot_library_path()} (not loaded yet)"
        src = source_dir()
        if src is None:
            return False, "the C++ sources (csrc/) are not installed"
        if (cache_root() / build_key(src) / _OK_MARKER).is_file():
            return True, "cached JIT build (not loaded yet)"
        compiler = cxx()
        if shutil.which(compiler) is None:
            return False, f"no C++ compiler: {compiler!r} not found (set CXX to a C++17 compiler)"
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            return False, "ninja is not available (pip install ninja)"
        return True, f"buildable with {compiler} (compiled on first use)"
    try:
        return True, load()
    except CppUnavailable as err:
        return False, str(err)


def empty_cache() -> int:
    """Give the C++ backend's cached gradient buffer (``csrc/gradient_buffer.cpp``) back to the OS, as
    ``torch.cuda.empty_cache()`` does for CUDA's caching allocator; returns the bytes released (0 when the
    library is not loaded or holds none). Gradients still in use are not affected."""
    if not _state["loaded"]:
        return 0
    return int(torch.ops.kltriton_cpp.empty_gradient_cache())


def _reset_for_tests() -> None:
    """Forget the load outcome (not the library: a registered namespace is never loaded again)."""
    with _lock:
        _state.update(loaded=False, how=None, error=None, warned=False)
