"""Swap attributes of a library's modules and put them back: the apply/undo shared by every integration."""
import sys
from typing import Callable, List, Optional, Tuple


class Patch:
    """The changes one ``apply()`` made. ``undo()`` restores them; usable as a context manager.

    A library module that copied a patched function with ``from x import f`` (before or after
    ``apply()``) holds it under its own name: ``swap`` and ``undo`` look through every loaded module
    of the library (``prefix``) for the original or the replacement object.
    """

    def __init__(self, name: str):
        self.name = name
        self.active = True
        self._swaps: List[Tuple[str, Callable, Callable]] = []  # (prefix, original, replacement)
        self._attrs: List[Tuple[object, str, object]] = []      # (owner, attribute, original value)

    def swap(self, prefix: str, original: Callable, replacement: Callable) -> None:
        """Replace ``original`` by ``replacement`` in every loaded module whose name starts with ``prefix``."""
        self._swaps.append((prefix, original, replacement))
        _replace_everywhere(prefix, original, replacement)

    def set(self, owner, attribute: str, value) -> None:
        """``setattr(owner, attribute, value)``, remembering the old value (owner: a class or module)."""
        self._attrs.append((owner, attribute, owner.__dict__[attribute]))
        setattr(owner, attribute, value)

    def undo(self) -> None:
        """Restore everything; a second call does nothing."""
        if not self.active:
            return
        self.active = False
        for owner, attribute, value in reversed(self._attrs):
            setattr(owner, attribute, value)
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

    ``install(patch)`` imports the library and makes the changes through ``patch``.
    """

    def __init__(self, name: str, install: Callable[[Patch], None]):
        self.name = name
        self._install = install
        self.current: Optional[Patch] = None

    def apply(self) -> Patch:
        """Make the library compute with kltriton. Returns a ``Patch``: ``.undo()`` or ``with apply(): ...``."""
        if self.current is not None and self.current.active:
            raise RuntimeError(f"kltriton's {self.name} integration is already applied; undo() it first")
        patch = Patch(self.name)
        self._install(patch)
        self.current = patch
        return patch

    def undo(self) -> None:
        """Undo the current ``apply()`` (no-op when none is active)."""
        if self.current is not None:
            self.current.undo()


def _replace_everywhere(prefix: str, old, new) -> None:
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for attribute, value in list(vars(module).items()):
            if value is old:
                setattr(module, attribute, new)
