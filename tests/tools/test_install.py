"""The quick start's editable install works from any folder: a script saved next to the clone (in the clone's parent
folder, where Python sees the clone's folder ``kltriton/`` first) imports the package, not that folder (issue 41)."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_script_in_the_clones_parent_folder_imports_the_editable_install(tmp_path):
    clone = tmp_path / "parent" / "kltriton"  # a clone keeps the repository's name
    clone.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, clone / name)
    for folder in ("kltriton", "csrc"):
        shutil.copytree(ROOT / folder, clone / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    # A virtual environment that sees this one's packages (torch, setuptools, pip), with the clone installed as the
    # README says, without downloading anything.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(clone)],
                   check=True, capture_output=True, timeout=300)
    script = clone.parent / "script.py"
    script.write_text("import kltriton\nprint(kltriton.__file__, kltriton.token_logprobs.__name__)\n")
    done = subprocess.run([python, str(script)], cwd=clone.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(clone / "kltriton" / "__init__.py"), "token_logprobs"]

