"""Shared test setup: Triton runs on CPU through its interpreter (set before any kernel is defined)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kltriton import dispatch  # noqa: E402

BACKENDS = ("reference", "triton", "cpp")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tests run on KLTRITON_TEST_DEVICE (default cpu; "cuda" on a GPU box with TRITON_INTERPRET=0).
TEST_DEVICE = os.environ.get("KLTRITON_TEST_DEVICE", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than 30 s; deselect with -m 'not slow'")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend usable on this machine; CPU tensors reach Triton through the interpreter."""
    usable, why = dispatch.availability(request.param)
    if request.param == "cpp" and TEST_DEVICE != "cpu":
        usable, why = False, "C++ kernels take CPU tensors"
    if not usable:
        pytest.skip(f"{request.param} backend unavailable: {why}")
    return request.param


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def dtype(request):
    return request.param


@pytest.fixture
def device():
    return TEST_DEVICE
