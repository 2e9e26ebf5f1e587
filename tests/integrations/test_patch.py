"""``apply()`` of every integration is all or nothing, and a missing library says how to install it. A fake
library module stands in for TRL / verl / OpenRLHF here, so these run without them."""
import re
import sys
import types

import pytest

from kltriton.integrations import _patch


@pytest.fixture
def fake_library(monkeypatch):
    """A package ``fakelib`` with a module ``fakelib.utils`` holding two functions, and a second module that
    imported one of them by name."""
    package = types.ModuleType("fakelib")
    utils = types.ModuleType("fakelib.utils")
    utils.first = lambda: "first"
    utils.second = lambda: "second"
    user = types.ModuleType("fakelib.user")
    user.first = utils.first
    package.utils = utils
    for name, module in (("fakelib", package), ("fakelib.utils", utils), ("fakelib.user", user)):
        monkeypatch.setitem(sys.modules, name, module)
    return utils, user


def _integration(names):
    def install(patch):
        import fakelib.utils as utils

        for name in names:
            patch.swap("fakelib", patch.resolve(utils, name), lambda name=name: f"kltriton {name}")
    return _patch.Integration("Fake", install, package="fakelib", tested="1.0")


def test_apply_patches_every_target_and_undo_restores(fake_library):
    utils, user = fake_library
    first = utils.first
    patch = _integration(["first", "second"]).apply()
    assert utils.first() == "kltriton first" and user.first() == "kltriton first" and utils.second() == "kltriton second"
    patch.undo()
    assert utils.first is first and user.first is first


def test_a_missing_target_changes_nothing_and_names_it(fake_library):
    utils, user = fake_library
    first, second = utils.first, utils.second
    integration = _integration(["first", "second", "third"])
    with pytest.raises(_patch.IntegrationError, match=r"\(tested with 1\.0\): it lacks fakelib\.utils\.third\. Nothing was changed"):
        integration.apply()
    assert utils.first is first and utils.second is second and user.first is first
    assert integration.current is None


def test_replace_hands_back_the_originals_and_undo_restores_them():
    class Sampler:
        def sample(self, x):
            return f"vllm sample {x}"

        @staticmethod
        def gather(x):
            return f"vllm gather {x}"

    def sample(self, x):
        return f"kltriton, then {original.sample(self, x)}"

    def gather(x):
        return f"kltriton, then {original.gather(x)}"

    sample_before, gather_before = vars(Sampler)["sample"], vars(Sampler)["gather"]
    patch = _patch.Patch("Fake")
    original = patch.replace(Sampler, sample=sample, gather=staticmethod(gather))
    assert Sampler().sample(1) == "vllm sample 1"  # recorded, not made before commit
    patch.commit()
    assert Sampler().sample(1) == "kltriton, then vllm sample 1"
    assert Sampler().gather(2) == Sampler.gather(2) == "kltriton, then vllm gather 2"
    patch.undo()
    assert vars(Sampler)["sample"] is sample_before and vars(Sampler)["gather"] is gather_before
    with pytest.raises(AttributeError, match="Sampler.missing"):
        _patch.Patch("Fake").replace(Sampler, missing=sample)


def test_a_missing_library_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fakelib", None)  # import fails as for an uninstalled package
    with pytest.raises(ImportError, match=r'pip install "fakelib==1\.0"'):
        _integration(["first"]).apply()


@pytest.mark.parametrize("name, command", [("trl", 'pip install "trl==1.16.0"'),
                                           ("verl", 'pip install "verl==0.9.1"'),
                                           ("openrlhf", 'pip install --no-deps "openrlhf==0.11.2"')])
def test_each_integration_says_what_to_install(monkeypatch, name, command):
    """tests/tools/test_install_hints.py checks these commands against pyproject.toml's extras."""
    module = __import__(f"kltriton.integrations.{name}", fromlist=["apply"])
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=re.escape(command)):
        module.apply()
