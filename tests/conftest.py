"""Shared test setup: Triton runs on CPU through its interpreter (set before any kernel is defined)."""
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's on-disk caches of a test session are its own: a cache left by an older kltriton (other custom-op
# signatures) must not serve its compiled graphs here.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="kltriton-test-inductor-"))

import pytest  # noqa: E402
import torch  # noqa: E402

from kltriton import dispatch  # noqa: E402

BACKENDS = tuple(dispatch.BACKENDS)  # every backend dispatch describes: a new one is tested without an edit here
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tests run on KLTRITON_TEST_DEVICE (default cpu; "cuda" on a GPU box with TRITON_INTERPRET=0).
TEST_DEVICE = os.environ.get("KLTRITON_TEST_DEVICE", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than 30 s; deselect with -m 'not slow'")


def pytest_collection_modifyitems(config, items):
    """``KLTRITON_TEST_SPLIT=i/k``: keep every k-th collected test from the i-th (0-based), so that k processes run
    a selection between them, each compiling its own kernels (``python -m benchmarks gpu``'s check step)."""
    split = os.environ.get("KLTRITON_TEST_SPLIT")
    if not split:
        return
    index, parts = (int(part) for part in split.split("/"))
    if not 0 <= index < parts:
        raise pytest.UsageError(f"KLTRITON_TEST_SPLIT must be i/k with 0 <= i < k, got {split!r}")
    kept = items[index::parts]
    kept_ids = {id(item) for item in kept}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
    items[:] = kept


# Messages of a CPU tensor reaching Triton with the interpreter off (kltriton.dispatch.resolve, Triton's
# launcher): on a GPU run, the tests written for CPU tensors through the interpreter report these as
# skips, not failures. Nothing else is converted.
CPU_TENSOR_ON_TRITON = ("needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1",
                        "cannot be accessed from Triton (cpu tensor?)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if TEST_DEVICE == "cpu" or call.excinfo is None or report.outcome != "failed":
        return
    error, messages = call.excinfo.value, []
    while error is not None and len(messages) < 8:  # the error and its causes (opcheck wraps it)
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    if any(fragment in message for message in messages for fragment in CPU_TENSOR_ON_TRITON):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           "Skipped: CPU tensors reach Triton only under TRITON_INTERPRET=1")


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
