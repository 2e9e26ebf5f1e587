"""Every Python block of README.md runs on its own, as written, each in a fresh interpreter: a reader can paste
any one of them. A block that starts a process group (``dist.init_process_group``) runs as its comment says, under
``torchrun --standalone --nproc-per-node 2`` (gloo over loopback). A block that needs a library kltriton does not
depend on (the trainer integrations') is skipped where that library is not installed, and only then."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# not kltriton's dependencies: the trainers and what they import (OpenRLHF imports flash-attn, a CUDA build)
OPTIONAL = ("torchrl", "tensordict", "ray", "trl", "verl", "openrlhf", "deepspeed", "flash_attn")
MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def python_blocks(path):
    """``(line, code)`` of each fenced ```python block of the Markdown file ``path``."""
    text = path.read_text()
    return [(text.count("\n", 0, match.start()) + 1, match.group(1))
            for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


README_BLOCKS = python_blocks(ROOT / "README.md")


def test_the_readme_has_its_examples():
    assert len(README_BLOCKS) >= 11


@pytest.mark.parametrize("line, code", README_BLOCKS, ids=[f"README.md:{line}" for line, _ in README_BLOCKS])
def test_readme_block_runs_on_its_own(tmp_path, line, code):
    script = tmp_path / "example.py"
    script.write_text(code)
    # this checkout's kltriton, from a folder that is not the checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if "init_process_group" in code:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
        env.update(OMP_NUM_THREADS="1")
    else:
        command = [sys.executable, str(script)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        missing = MISSING.search(done.stderr)
        if missing and missing.group(1).split(".")[0] in OPTIONAL:
            pytest.skip(f"README.md:{line} needs {missing.group(1)}, not installed here")
    assert done.returncode == 0, f"README.md:{line} failed:\n{done.stderr[-3000:]}"
