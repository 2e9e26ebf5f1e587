"""``python -m kltriton``: ``info`` says each backend's status once, bad demo arguments are usage errors (exit status 2,
no traceback), and a folder named ``kltriton`` that shadows the package gets a message saying what to do."""
import subprocess
import sys
import types

import pytest

import kltriton
from kltriton import __main__ as cli
from kltriton import demo


@pytest.mark.parametrize("argv, message", [
    (["--vocab", "0"], "argument --vocab: must be at least 1, got 0"),
    (["--vocab", "x"], "argument --vocab: not an integer: 'x'"),
    (["--tokens", "-5"], "argument --tokens: must be at least 2, got -5"),
    (["--sequences", "0"], "argument --sequences: must be at least 1, got 0"),
    (["--tokens", "3", "--sequences", "2"], "--tokens must be at least 2 x --sequences (4), got 3"),
    (["--coef", "nan"], "argument --coef: must be finite, got nan"),
    (["--coef=-inf"], "argument --coef: must be finite, got -inf"),
    (["--coef", "abc"], "argument --coef: not a number: 'abc'"),
    (["--device", "tpu"], "argument --device: invalid choice"),
])
def test_bad_demo_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m kltriton demo") and message in err


def test_demo_vocab_0_from_the_command_line_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "kltriton", "demo", "--vocab", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --vocab: must be at least 1, got 0" in done.stderr


def test_smallest_valid_demo_arguments_parse(monkeypatch):
    """The bounds are inclusive: --vocab 1, --sequences 1, --tokens 2 reach the demo itself."""
    reached = {}
    monkeypatch.setattr(demo, "build_models", lambda vocab, device: reached.setdefault("vocab", vocab) and 1 / 0)
    with pytest.raises(ZeroDivisionError):
        demo.main(["--vocab", "1", "--sequences", "1", "--tokens", "2", "--coef", "0"])
    assert reached == {"vocab": 1}


def test_a_folder_shadowing_the_package_gets_a_clear_message(monkeypatch, capsys, tmp_path):
    """Run from the clone's parent folder, Python imports the clone (a folder without __init__.py) as an empty
    namespace package, and ``from kltriton import __version__`` failed with "unknown location"."""
    shadow = types.ModuleType("kltriton")
    shadow.__path__ = [str(tmp_path / "kltriton")]  # a namespace package has a __path__ and no __file__
    monkeypatch.setitem(sys.modules, "kltriton", shadow)
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "kltriton") in err and "cd kltriton" in err


def test_the_real_package_is_not_reported_as_shadowed():
    assert kltriton.__file__ and cli._shadowed_by_a_folder() is None


def test_info_gives_one_line_per_backend_and_names_families_only_where_they_differ(monkeypatch, capsys):
    from kltriton import dispatch

    real = dispatch.availability

    def availability(name, family):  # the cpp backend without the loss family's module
        if name != "cpp":
            return real(name, family)
        return (False, "no loss module") if family == "loss" else (True, "loaded")

    monkeypatch.setattr(dispatch, "availability", availability)
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("backends (for every family, unless a line names the families):") + 1:]
    assert [line.split()[0] for line in table] == ["triton", "cpp", "cpp", "reference"]
    others = ", ".join(family for family in dispatch.FAMILIES if family != "loss")
    assert table[1:3] == [f"  cpp        yes  loaded   (families: {others})",
                          "  cpp        no   no loss module   (families: loss)"]
    assert "families" not in table[0] + table[3]
