"""Build machinery of the C++ CPU backend (``kltriton.kernels.cpp_library``), not its numerics.

- importing the module compiles nothing;
- no compiler (or no ninja): one clear warning, ``availability() == (False, reason)``, and the
  dispatcher falls back to the reference;
- the library is loaded / registered once per process however often ``load()`` is called;
- concurrent builds in one cache directory build once (``flock``), a stale torch baton is removed;
- ahead-of-time libraries for a CPU capability the machine lacks are ignored;
- results do not depend on the number of threads.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import kernel_backward, kernel_forward, temp
from kltriton.kernels import cpp_library
from kltriton.kernels.stream import cpp as stream_cpp

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env_extra: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


def _last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    proc = _run(
        """
        import json, torch
        import kltriton.kernels.cpp_library as c
        import kltriton
        print(json.dumps({"registered": c._registered(), "loaded": c._state["loaded"]}))
        """,
        {"KLTRITON_CACHE_DIR": str(cache), "KLTRITON_CPP_AOT": "0"},
    )
    out = _last_json(proc)
    assert out == {"registered": False, "loaded": False}
    assert not cache.exists()


def test_no_compiler_single_warning_and_fallback(tmp_path):
    proc = _run(
        """
        import json, warnings, torch
        from kltriton.kernels import cpp_library as c
        from kltriton.kernels.stream import cpp as stream_cpp
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            quick = c.availability(build=False)
            a1 = c.availability()
            a2 = c.availability()
            try:
                stream_cpp.forward(torch.randn(2, 5), None, torch.tensor([0, 1]), torch.tensor(1.0, dtype=torch.float64), 0)
                raised = None
            except c.CppUnavailable as err:
                raised = str(err)
            from kltriton import dispatch
            picked = dispatch.resolve(None, "stream", "cpu", False)
        msgs = [str(x.message) for x in w if "C++ CPU backend" in str(x.message)]
        print(json.dumps({"quick": quick, "a1": a1, "a2": a2, "raised": raised, "msgs": msgs, "picked": picked}))
        """,
        {"CXX": "/nonexistent/bin/c++", "KLTRITON_CACHE_DIR": str(tmp_path / "fresh"), "KLTRITON_CPP_AOT": "0"},
    )
    out = _last_json(proc)
    assert out["quick"][0] is False and "compiler" in out["quick"][1]
    assert out["a1"][0] is False and "/nonexistent/bin/c++" in out["a1"][1]
    assert out["a2"] == out["a1"]
    assert out["raised"] is not None and "compiler" in out["raised"]
    assert len(out["msgs"]) == 1, out["msgs"]
    assert "unavailable" in out["msgs"][0] and "reference" in out["msgs"][0]
    assert out["picked"] == "reference"


def test_no_ninja_reason(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("KLTRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(cpp_library.CppUnavailable, match="ninja"):
        cpp_library._jit_build(cpp_library.source_dir())


def test_load_twice_registers_once():
    ok, why = cpp_library.availability()
    if not ok:
        pytest.skip(why)
    loads = cpp_library._state["loads"]
    assert loads <= 1
    how1 = cpp_library.load()
    how2 = cpp_library.load()
    assert how1 == how2 and cpp_library._state["loads"] == loads
    cpp_library._reset_for_tests()  # a fresh loader state must notice the registered ops
    try:
        assert cpp_library.load() == "already registered in this process"
        assert cpp_library._state["loads"] == loads
    finally:
        cpp_library._reset_for_tests()
        cpp_library.load()
    assert hasattr(torch.ops.kltriton_cpp, "stream_forward")
    info = torch.ops.kltriton_cpp.build_info()
    assert f"cap={cpp_library.cpu_capability()}" in info


def test_thread_count_determinism():
    ok, why = cpp_library.availability()
    if not ok:
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3001, generator=g) * 4
    y = x + torch.randn(64, 3001, generator=g)
    t = torch.randint(0, 3001, (64,), generator=g)
    t[5] = -1
    gl, ge, gk = (torch.randn(64, generator=g) for _ in range(3))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            st = kernel_forward(stream_cpp, x, y, t, temp(0.7), True, True)
            grad = kernel_backward(stream_cpp, x, y, t, temp(0.7), st, gl, ge, gk)
            results.append((st, grad))
    finally:
        torch.set_num_threads(before)
    (s1, g1), (s2, g2) = results
    for a, b in zip(s1, s2):
        assert torch.equal(a, b)
    assert torch.equal(g1, g2)


_FAKE_BUILD = """
    import json, os, sys, time, torch
    from pathlib import Path
    from torch.utils import cpp_extension
    from kltriton.kernels import cpp_library as c
    log = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(os.environ["FAKE_LOG"])
    def fake_load(name, sources, build_directory, **kw):
        assert not (Path(build_directory) / "lock").exists(), "stale torch baton not removed"
        with open(log, "a") as fh:
            fh.write(f"build {os.getpid()}\\n")
        time.sleep(1.5)
        (Path(build_directory) / f"{name}.so").write_bytes(b"fake")
    def fake_load_library(path):
        with open(log, "a") as fh:
            fh.write(f"load {os.getpid()}\\n")
    c._load_library = fake_load_library
    cpp_extension.load = fake_load
    how = c._jit_build(c.source_dir())
    print(json.dumps({"how": how}))
"""


def test_concurrent_builds_build_once_and_clear_stale_baton(tmp_path):
    cache = tmp_path / "cache"
    key = cpp_library.build_key(cpp_library.source_dir())
    (cache / key).mkdir(parents=True)
    (cache / key / "lock").write_text("left by a killed build")  # torch FileBaton of a dead process
    log = tmp_path / "log.txt"
    env = dict(os.environ, KLTRITON_CACHE_DIR=str(cache), FAKE_LOG=str(log), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_FAKE_BUILD)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(ROOT)) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    lines = log.read_text().split()
    assert lines.count("build") == 1 and lines.count("load") == 1, lines
    assert (cache / key / cpp_library._OK_MARKER).is_file()


def test_flock_released_when_holder_is_killed(tmp_path):
    lock = tmp_path / "k.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys, time
            fh = open({str(lock)!r}, "a+")
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            print("locked", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with cpp_library._file_lock(lock):  # would block forever if the lock survived its holder
        pass


def test_compile_flags_follow_capability():
    assert "-mavx512f" in cpp_library.compile_flags("AVX512")
    assert "-DCPU_CAPABILITY_AVX512" in cpp_library.compile_flags("AVX512")
    avx2 = cpp_library.compile_flags("AVX2")
    assert "-mavx2" in avx2 and not any("avx512" in f for f in avx2)
    default = cpp_library.compile_flags("DEFAULT")
    assert not any(f.startswith("-m") for f in default) and "-DCPU_CAPABILITY=DEFAULT" in default
    assert "-fopenmp" in default and "-fopenmp" in cpp_library.LINK_FLAGS
    assert cpp_library.cpu_capability() in ("DEFAULT", "AVX2", "AVX512")


def test_aot_library_capability_check(tmp_path, monkeypatch):
    pkg = tmp_path / "kltriton"
    pkg.mkdir()
    monkeypatch.setattr(cpp_library, "_package_dir", lambda: pkg)
    monkeypatch.delenv("KLTRITON_CPP_AOT", raising=False)
    assert cpp_library.aot_library_path() is None
    lib = pkg / "_C.cpython-311-x86_64-linux-gnu.so"
    lib.write_bytes(b"\x7fELF....KLTRITON_CPP_BUILD_TAG cap=AVX512;....")
    assert cpp_library._lib_capability(lib) == "AVX512"
    monkeypatch.setattr(cpp_library, "cpu_capability", lambda: "AVX2")
    assert cpp_library.aot_library_path() is None  # never load AVX512 code on an AVX2 machine
    monkeypatch.setattr(cpp_library, "cpu_capability", lambda: "AVX512")
    assert cpp_library.aot_library_path() == lib
    monkeypatch.setenv("KLTRITON_CPP_AOT", "0")
    assert cpp_library.aot_library_path() is None
    lib.write_bytes(b"KLTRITON_CPP_BUILD_TAG cap=CPU_CAPABILITY;")
    assert cpp_library._lib_capability(lib) == "DEFAULT"
