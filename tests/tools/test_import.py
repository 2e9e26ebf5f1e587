"""``import kltriton`` stays light: no Triton, no Dynamo, no adapters' libraries, no CUDA."""
import subprocess
import sys

CHECK = """
import sys
import torch
import kltriton
heavy = [m for m in ("triton", "torch._dynamo", "transformers", "torchrl", "kltriton.kernels.cpp_library")
         if m in sys.modules]
assert not heavy, heavy
assert not torch.cuda.is_initialized()
"""


def test_import_is_light():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
