"""kltriton's environment variables, read in one place: a value that does not parse names its variable.

| variable | meaning |
|---|---|
| ``KLTRITON_BACKEND`` | ``triton`` / ``cpp`` / ``reference``: the backend of every call that names none |
| ``KLTRITON_LINEAR_TILE`` | elements of the ``LinearLogits`` working tile (an int >= 1) |
| ``KLTRITON_INVARIANT`` | ``1``: start in the invariant mode (``kltriton.set_invariant``); read once, at import |
| ``KLTRITON_CPU_GRAD_CACHE`` | ``0``: the C++ backend keeps no freed gradient buffer (read by ``csrc/``) |
| ``KLTRITON_CPP_AOT`` | ``0``: ignore an ahead-of-time built C++ library |
| ``KLTRITON_VERBOSE_BUILD`` | ``1``: show the compiler's output of the C++ JIT build |
| ``KLTRITON_CACHE_DIR`` | where the C++ JIT build is cached (default ``~/.cache/kltriton``) |

Read here too, never set: ``TRITON_INTERPRET`` (``1``: Triton runs CPU tensors through its interpreter),
``WORLD_SIZE`` (a distributed launch: ``process_group=None`` before ``init_process_group`` is refused) and ``CXX``
(the C++ compiler of the JIT build, default ``c++``).
"""
import os
from typing import Optional

FLAGS = ("KLTRITON_CPU_GRAD_CACHE", "KLTRITON_CPP_AOT", "KLTRITON_VERBOSE_BUILD")


def env_int(name: str) -> Optional[int]:
    """The integer value (>= 1) of ``name``, or None when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """``0`` / ``1`` (also ``false`` / ``true``, ``no`` / ``yes``) of ``name``; ``default`` when unset or empty."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a flag: use 0 or 1")


def check_flags() -> None:
    """Parse every flag once (the C++ library reads ``KLTRITON_CPU_GRAD_CACHE`` itself: ``0`` turns the cache
    off, anything else leaves it on, so a typo is caught here rather than silently ignored)."""
    for name in FLAGS:
        env_flag(name, True)


def invariant_default() -> bool:
    """``KLTRITON_INVARIANT``: whether kltriton starts in the invariant mode (default off)."""
    return env_flag("KLTRITON_INVARIANT", False)


def backend_override() -> Optional[str]:
    """``KLTRITON_BACKEND``, or None when unset or empty (``kltriton.dispatch`` checks the name)."""
    return os.environ.get("KLTRITON_BACKEND") or None


def triton_interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cache_dir() -> Optional[str]:
    """``KLTRITON_CACHE_DIR``, or None."""
    return os.environ.get("KLTRITON_CACHE_DIR") or None


def compiler() -> str:
    """The C++ compiler of the JIT build: ``CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def launched_world_size() -> int:
    """``WORLD_SIZE`` of a distributed launch (torchrun, accelerate), 1 when unset or not a number."""
    world = os.environ.get("WORLD_SIZE", "1")
    return int(world) if world.isdigit() else 1
