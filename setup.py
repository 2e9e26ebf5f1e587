"""Packaging. The C++ kernels ship as sources (``kltriton/csrc``) and compile on first use.

``KLTRITON_BUILD_CPP=1 pip install -v --no-build-isolation .`` compiles them into the wheel
instead (``kltriton/_C*.so``; ``-v`` shows the build's progress): that needs the installed torch
at build time (hence no build isolation), ties the wheel to that torch version, and targets the
building machine's CPU capability (the loader skips it on a CPU that lacks it and falls back to
the JIT build).
The compiler flags come from ``kltriton/kernels/constants.py``, the table the JIT build uses.
"""
import importlib.util
import os
import time

from setuptools import find_packages, setup


def _constants():
    """``kltriton.kernels.constants`` loaded by path (importing ``kltriton`` would import torch)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kltriton", "kernels", "constants.py")
    spec = importlib.util.spec_from_file_location("kltriton_build_constants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpp_extension():
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class TimedBuildExtension(BuildExtension):
        """torch's build (ninja prints a ``[k/N]`` line per source) between a first and a last line, its time.
        pip shows a build's output with ``pip install -v`` only."""

        def run(self):
            started = time.perf_counter()
            print(f"kltriton: compiling the C++ kernels ({len(constants.CPP_SOURCES)} sources, 1-2.5 minutes on "
                  "2 cores, longer under load)", flush=True)
            super().run()
            print(f"kltriton: C++ kernels built in {time.perf_counter() - started:.0f} s", flush=True)

    constants = _constants()
    capability = torch.backends.cpu.get_cpu_capability()
    capability = capability if capability in constants.ISA_FLAGS else "DEFAULT"
    extension = CppExtension(
        "kltriton._C",
        sources=[f"csrc/{name}" for name in constants.CPP_SOURCES],
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args=constants.cpp_compile_flags(capability),
        extra_link_args=list(constants.CPP_LINK_FLAGS),
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": TimedBuildExtension}}


setup(
    packages=find_packages(include=["kltriton", "kltriton.*"]) + ["kltriton.csrc"],
    package_dir={"kltriton.csrc": "csrc"},
    package_data={"kltriton.csrc": ["*.cpp", "*.h"]},
    **(cpp_extension() if os.environ.get("KLTRITON_BUILD_CPP") == "1" else {}),
)
