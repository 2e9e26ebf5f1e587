"""The install commands that kltriton's error messages give work for a kltriton installed from a clone or a wheel:
they name the packages themselves (never the index form of an extra), with the versions of pyproject.toml."""
import importlib
import pathlib
import re
import sys

import pytest
from packaging.requirements import Requirement

from kltriton import _install, dispatch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pyproject_extras():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["optional-dependencies"]


def _requirements(command):
    """The quoted requirements of a ``pip install "a" "b"`` command."""
    return [Requirement(text) for text in re.findall(r'"([^"]+)"', command.split(" (")[0])]


def test_commands_match_pyproject_extras():
    extras = _pyproject_extras()
    for name, requirements in _install.EXTRAS.items():
        assert list(requirements) == extras[name], name
        quoted = _requirements(_install.pip_install(name))
        assert [str(r) for r in quoted] == [str(Requirement(r)) for r in extras[name]]


def test_openrlhf_has_no_extra_and_its_command_pins_the_tested_version():
    """openrlhf's extra could not install anywhere (flash-attn's build needs torch inside pip's build isolation)."""
    from kltriton.integrations import openrlhf

    assert "openrlhf" not in _pyproject_extras()
    command = _install.pip_install("openrlhf")
    assert command.startswith('pip install --no-deps "openrlhf==') and "docs/install.md" in command
    assert str(_requirements(command)[0].specifier) == f"=={openrlhf._integration.tested}"


@pytest.mark.parametrize("name", ["trl", "verl"])
def test_trainer_commands_pin_the_tested_version(name):
    module = importlib.import_module(f"kltriton.integrations.{name}")
    (requirement,) = _requirements(_install.pip_install(name))
    assert requirement.name == name and str(requirement.specifier) == f"=={module._integration.tested}"


def test_verl_command_says_it_cannot_share_torchrl_s_environment():
    assert "tensordict" in _install.pip_install("verl") and "docs/install.md" in _install.pip_install("verl")


def test_no_message_names_an_extra_on_an_index():
    """``pip install kltriton[x]`` fails for a kltriton installed from a clone or a wheel (it is on no index)."""
    sources = [path for path in (ROOT / "kltriton").rglob("*.py")]
    offenders = [str(path.relative_to(ROOT)) for path in sources if "pip install kltriton[" in path.read_text()]
    assert not offenders


def test_missing_triton_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    usable, why = dispatch.BACKENDS["triton"].availability()
    assert not usable and 'pip install "triton>=3.6" "numpy"' in why


@pytest.mark.parametrize("module, blocked, command", [
    ("kltriton.adapters.torchrl", "torchrl", 'pip install "torchrl>=0.13.3,<0.15" "tensordict>=0.13,<0.15"'),
    ("kltriton.adapters.torchrl_losses", "torchrl", 'pip install "torchrl>=0.13.3,<0.15" "tensordict>=0.13,<0.15"'),
    ("kltriton.adapters.torchrl_ray", "ray", 'pip install "ray==2.60.0"'),
])
def test_missing_adapter_library_says_what_to_install(monkeypatch, module, blocked, command):
    for name in [name for name in sys.modules if name == blocked or name.startswith(blocked + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, blocked, None)  # import fails as for an uninstalled package
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=re.escape(command)):
        importlib.import_module(module)


@pytest.mark.parametrize("name", ["trl", "verl", "openrlhf"])
def test_missing_trainer_library_says_what_to_install(monkeypatch, name):
    module = importlib.import_module(f"kltriton.integrations.{name}")
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=re.escape(_install.pip_install(name, module._integration.tested))):
        module.apply()
