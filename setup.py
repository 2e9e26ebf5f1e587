"""Packaging. The C++ kernels ship as sources (``kltriton/csrc``) and compile on first use.

``KLTRITON_BUILD_CPP=1 pip install --no-build-isolation .`` compiles them into the wheel
instead (``kltriton/_C*.so``): that needs the installed torch at build time (hence no build
isolation), ties the wheel to that torch version, and targets the building machine's CPU
capability (the loader skips it on a CPU that lacks it and falls back to the JIT build).
"""
import os

from setuptools import find_packages, setup


def cpp_extension():
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    capability = torch.backends.cpu.get_cpu_capability()
    capability = capability if capability in ("AVX2", "AVX512") else "DEFAULT"
    isa_flags = {
        "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
        "AVX2": ["-mavx2", "-mfma", "-mf16c"],
        "DEFAULT": [],
    }[capability]
    extension = CppExtension(
        "kltriton._C",
        sources=["csrc/stream_ops.cpp", "csrc/stream_forward.cpp", "csrc/stream_backward.cpp"],
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args=["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}",
                            f"-DCPU_CAPABILITY_{capability}", *isa_flags],
        extra_link_args=["-fopenmp"],
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(
    packages=find_packages(include=["kltriton", "kltriton.*"]) + ["kltriton.csrc"],
    package_dir={"kltriton.csrc": "csrc"},
    package_data={"kltriton.csrc": ["*.cpp", "*.h"]},
    **(cpp_extension() if os.environ.get("KLTRITON_BUILD_CPP") == "1" else {}),
)
