"""The Triton kernels compile for Hopper (sm_90) without a GPU.

The CPU interpreter runs the kernel bodies as numpy and misses compiler-only errors (e.g. a
non-constexpr global, a type change of a loop-carried value). Triton can compile for a named
target without a device, so every kernel variant is compiled here in a subprocess (the
interpreter is switched on for the rest of the suite), with the launch settings ``forward`` /
``backward`` use (``benchmarks/static.py``), for every dtype at a vocab that splits rows across
programs (the combine kernel too) and is not a multiple of 16. ``test_static_report.py`` covers
aligned vocabs.
"""
import os
import subprocess
import sys
import textwrap

COMPILE_ALL = textwrap.dedent('''
    from benchmarks import static
    rows = static.report(cases=[(100003, dtype) for dtype in static.DTYPES])
    print("compiled", len(rows))
''')


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    # Per dtype: 6 forward variants, their 6 combine kernels, 4 backward variants.
    assert "compiled 48" in done.stdout
