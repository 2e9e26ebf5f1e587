"""Every script in ``examples/`` runs end to end as its docstring says (``python examples/<name>.py``), in a fresh
interpreter, and passes its own check (exit status 0, "OK" printed). The TRL one needs TRL: skipped where it is not
installed, run in ``.ci/run``'s trainer-integrations step."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NEEDS = {"trl_grpo.py": "trl"}  # an example's library that kltriton does not depend on


def test_the_examples_are_there():
    assert {path.name for path in EXAMPLES} >= {"rlhf_reward.py", "grpo_step.py", "distillation.py", "trl_grpo.py"}


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs_and_checks_itself(tmp_path, script):
    if script.name in NEEDS:
        pytest.importorskip(NEEDS[script.name])
    # this checkout's kltriton, from a folder that is not the checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "OK" in done.stdout and "MISMATCH" not in done.stdout, done.stdout
