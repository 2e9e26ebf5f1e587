"""Values shared by the Python layer, the Triton kernels, the C++ kernels and ``setup.py``.

No torch import: ``setup.py`` loads this file by path to build the C++ library ahead of time
with exactly the flags of the JIT build. The C++ sources receive the target sentinels as
``-D`` defines from ``cpp_compile_flags``, so each value is written once, here.
"""

# The per-row ``target`` every kernel family takes (``[N]`` int64): a label in ``[0, V)`` to score,
# or one of these sentinels. Kernels never read the logits of a sentinel row.
SKIP = -1          # not scored: outputs 0.0, gradient 0
OUT_OF_RANGE = -2  # scored, but the label lies outside [0, V) (validation off): outputs NaN

# C++ sources of the CPU library (``csrc/``) and the headers their build depends on.
CPP_SOURCES = ("stream_ops.cpp", "stream_forward.cpp", "stream_backward.cpp", "loss_forward.cpp",
               "gradient_buffer.cpp")
CPP_HEADERS = ("stream_common.h",)

# Instruction-set flags per ATen CPU capability; a build never uses more than ATen detected.
CPU_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")  # in increasing order
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
    "DEFAULT": (),
}
# A tuple: torch's cpp_extension.load appends to the lists it is given.
CPP_LINK_FLAGS = ("-fopenmp",)


def cpp_compile_flags(capability: str) -> list:
    """Compiler flags of a C++ build for ``capability`` (a key of ``ISA_FLAGS``)."""
    return ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
            f"-DKLTRITON_SKIP={SKIP}", f"-DKLTRITON_OUT_OF_RANGE={OUT_OF_RANGE}", *ISA_FLAGS[capability]]
