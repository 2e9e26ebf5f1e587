"""Swap attributes of a library's modules and put them back: the apply/undo shared by every integration.

``apply()`` is all or nothing: the integration's ``install`` first resolves every target (importing the
library, looking each attribute up) and records the changes on a ``Patch``; only when all of them resolved
are they made. A library that lacks one (another version than the tested one) gets a clear error naming the
attribute and the tested version, and nothing is changed.
"""
import importlib
import importlib.metadata
import sys
from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

from kltriton._install import pip_install


class IntegrationError(RuntimeError):
    """An integration cannot be applied to the installed library (nothing was changed)."""


class Patch:
    """The changes one ``apply()`` made. ``undo()`` restores them; usable as a context manager.

    A library module that copied a patched function with ``from x import f`` (before or after
    ``apply()``) holds it under its own name: ``swap`` and ``undo`` look through every loaded module
    of the library (``prefix``) for the original or the replacement object.
    """

    def __init__(self, name: str):
        self.name = name
        self.active = False
        self._swaps: List[Tuple[str, Callable, Callable]] = []  # (prefix, original, replacement)
        self._attrs: List[Tuple[object, str, object, object]] = []  # (owner, attribute, original, new value)

    @staticmethod
    def resolve(owner, attribute: str):
        """``owner.attribute``, or an ``AttributeError`` naming it (``apply`` turns it into an
        ``IntegrationError``)."""
        try:
            return getattr(owner, attribute)
        except AttributeError:
            where = getattr(owner, "__module__", None) if isinstance(owner, type) else None
            owner_name = f"{where}.{owner.__qualname__}" if where else getattr(owner, "__name__", repr(owner))
            raise AttributeError(f"{owner_name}.{attribute}") from None

    def swap(self, prefix: str, original: Callable, replacement: Callable) -> None:
        """Replace ``original`` by ``replacement`` in every loaded module whose name starts with ``prefix``
        (recorded now, made by ``commit``)."""
        self._swaps.append((prefix, original, replacement))

    def set(self, owner, attribute: str, value) -> None:
        """``setattr(owner, attribute, value)`` (owner: a class or module), recorded now, made by ``commit``."""
        if attribute not in vars(owner):
            self.resolve(owner, attribute)  # inherited or missing: missing raises, naming it
            raise AttributeError(f"{getattr(owner, '__qualname__', owner)}.{attribute} is inherited, not defined "
                                 "on it")
        self._attrs.append((owner, attribute, vars(owner)[attribute], value))

    def replace(self, owner, **replacements) -> SimpleNamespace:
        """``set(owner, name, replacement)`` for each keyword; returns the originals under the same names
        (``owner.name`` as it is now, a staticmethod's function), which the replacements call: one list of the
        hooked attributes of ``owner``."""
        originals = SimpleNamespace(**{name: self.resolve(owner, name) for name in replacements})
        for name, replacement in replacements.items():
            self.set(owner, name, replacement)
        return originals

    def commit(self) -> None:
        """Make every recorded change."""
        for owner, attribute, _, value in self._attrs:
            setattr(owner, attribute, value)
        for prefix, original, replacement in self._swaps:
            _replace_everywhere(prefix, original, replacement)
        self.active = True

    def undo(self) -> None:
        """Restore everything; a second call does nothing."""
        if not self.active:
            return
        self.active = False
        for owner, attribute, original, _ in reversed(self._attrs):
            setattr(owner, attribute, original)
        for prefix, original, replacement in reversed(self._swaps):
            _replace_everywhere(prefix, replacement, original)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def __repr__(self):
        return f"<kltriton {self.name} integration, {'active' if self.active else 'undone'}>"


class Integration:
    """One library's ``apply()`` / ``undo()``: at most one active ``Patch`` at a time.

    ``install(patch)`` imports the library, resolves its targets and records the changes on ``patch``.
    ``package`` / ``tested``: the library's import and distribution name and the version the integration was
    tested with (for the error messages, with the install command of ``kltriton._install``).
    """

    def __init__(self, name: str, install: Callable[[Patch], None], *, package: str, tested: str):
        self.name, self.package, self.tested = name, package, tested
        self._install = install
        self.current: Optional[Patch] = None

    def apply(self) -> Patch:
        """Make the library compute with kltriton. Returns a ``Patch``: ``.undo()`` or ``with apply(): ...``.
        All or nothing: an ``IntegrationError`` (nothing changed) when a target is missing."""
        if self.current is not None and self.current.active:
            raise RuntimeError(f"kltriton's {self.name} integration is already applied; undo() it first")
        try:
            importlib.import_module(self.package)
        except ImportError as err:
            raise ImportError(f"kltriton's {self.name} integration needs {self.package} (tested with "
                              f"{self.package} {self.tested}): {pip_install(self.package, self.tested)} "
                              f"({err})") from err
        patch = Patch(self.name)
        try:
            self._install(patch)
        except (AttributeError, ImportError) as err:
            what = f"it lacks {err}" if isinstance(err, AttributeError) else f"importing its modules failed ({err})"
            raise IntegrationError(f"kltriton's {self.name} integration cannot patch {self.package} "
                                   f"{_version(self.package)} (tested with {self.tested}): {what}. Nothing was "
                                   "changed.") from err
        patch.commit()
        self.current = patch
        return patch

    def undo(self) -> None:
        """Undo the current ``apply()`` (no-op when none is active)."""
        if self.current is not None:
            self.current.undo()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _replace_everywhere(prefix: str, old, new) -> None:
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for attribute, value in list(vars(module).items()):
            if value is old:
                setattr(module, attribute, new)
