"""A first C++ build says it is alive (issue 41: 257 s of silence looked like a hang): a line when it starts, one
every ``PROGRESS_EVERY_S`` seconds with the sources compiled so far, and a last line with its total time. Fake
builds stand in for the compiler: each step waits for the reporter's next line, so no test depends on timing."""
import re
import threading
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from kltriton.kernels import cpp_library


@pytest.fixture
def said(monkeypatch):
    """The reporter's lines, recorded (and still printed); ``said.wait_for(text)`` blocks until one contains it."""
    lines, new_line = [], threading.Condition()
    say = cpp_library._say

    def record(message):
        say(message)
        with new_line:
            lines.append(message)
            new_line.notify_all()

    def wait_for(text):
        with new_line:
            assert new_line.wait_for(lambda: any(text in line for line in lines), timeout=60), (text, lines)

    monkeypatch.setattr(cpp_library, "_say", record)
    record.lines, record.wait_for = lines, wait_for
    return record


def test_progress_lines_count_the_object_files_then_the_total_time(tmp_path, said, capsys):
    with cpp_library.build_progress(tmp_path, ["a.cpp", "b.cpp"], every_s=0.01):
        said.wait_for("0 of 2 sources compiled")
        (tmp_path / "a.o").write_bytes(b"")
        said.wait_for("1 of 2 sources compiled")
        (tmp_path / "b.o").write_bytes(b"")
        said.wait_for("linking")
    assert re.fullmatch(r"C\+\+ CPU kernels built in \d+ s", said.lines[-1])
    assert all(line.startswith("still building the C++ CPU kernels: ") for line in said.lines[:-1])
    assert capsys.readouterr().err.splitlines()[-1].startswith("kltriton: C++ CPU kernels built in ")


def test_a_failed_build_stops_reporting_and_claims_no_time(tmp_path, said):
    with pytest.raises(RuntimeError, match="compiler error"):
        with cpp_library.build_progress(tmp_path, ["a.cpp"], every_s=0.01):
            said.wait_for("still building")
            raise RuntimeError("compiler error")
    count = len(said.lines)
    time.sleep(0.1)  # ten reporting periods: the reporter has stopped
    assert len(said.lines) == count and not any("built in" in line for line in said.lines)


def test_the_jit_build_reports_its_start_progress_and_time(tmp_path, said, monkeypatch):
    """``_jit_build`` (the first CPU call's path) around a fake ninja build of every source."""
    monkeypatch.setenv("KLTRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_library, "PROGRESS_EVERY_S", 0.01)
    monkeypatch.setitem(cpp_library._state, "loads", cpp_library._state["loads"])  # the fake load counts one

    def fake_load(name, sources, build_directory, **kwargs):
        said.wait_for(f"0 of {len(sources)} sources compiled")
        for source in sources:
            (Path(build_directory) / f"{Path(source).stem}.o").write_bytes(b"")
        said.wait_for("linking")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert cpp_library._jit_build(cpp_library.source_dir()).startswith("JIT build ")
    assert said.lines[0].startswith("building the C++ CPU kernels (")
    assert f"{len(cpp_library.SOURCES)} sources" in said.lines[0]
    assert any(line.startswith("still building the C++ CPU kernels: ") for line in said.lines[1:-1])
    assert said.lines[-1].startswith("C++ CPU kernels built in ")
