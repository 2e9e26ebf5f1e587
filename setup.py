"""Packaging. The C++ kernels ship as sources (``kltriton/csrc``) and compile on first use;
``KLTRITON_BUILD_CPP=1 pip install --no-build-isolation .`` compiles them into the wheel
instead (tied to the torch version it was built against)."""
from setuptools import find_packages, setup

packages = find_packages(include=["kltriton", "kltriton.*"]) + ["kltriton.csrc"]
setup(
    packages=packages,
    package_dir={"kltriton.csrc": "csrc"},
    package_data={"kltriton.csrc": ["*.cpp", "*.h"]},
)
