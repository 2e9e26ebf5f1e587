"""kltriton's environment variables, read in one place: a value that does not parse names its variable.

| variable | meaning |
|---|---|
| ``KLTRITON_BACKEND`` | ``triton`` / ``cpp`` / ``reference``: the backend of every call that names none |
| ``KLTRITON_LINEAR_TILE`` | elements of the ``LinearLogits`` working tile (an int >= 1) |
| ``KLTRITON_CPU_GRAD_CACHE`` | ``0``: the C++ backend keeps no freed gradient buffer (read by ``csrc/``) |
| ``KLTRITON_CPP_AOT`` | ``0``: ignore an ahead-of-time built C++ library |
| ``KLTRITON_VERBOSE_BUILD`` | ``1``: show the compiler's output of the C++ JIT build |
| ``KLTRITON_CACHE_DIR`` | where the C++ JIT build is cached (default ``~/.cache/kltriton``) |
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
