"""The Triton kernels compile for Hopper (sm_90) without a GPU.

The CPU interpreter runs the kernel bodies as numpy and misses compiler-only errors (e.g. a
non-constexpr global, a type change of a loop-carried value). Triton can compile for a named
target without a device, so every kernel variant is compiled here in a subprocess (the
interpreter is switched on for the rest of the suite).
"""
import os
import subprocess
import sys
import textwrap

COMPILE_ALL = textwrap.dedent('''
    import itertools, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kltriton.kernels.stream import triton as ts

    def arg_type(name, dtype, ref_dtype):
        if name == "target_ptr":
            return "*i64"
        if name == "temperature_ptr":
            return "*fp64"
        if name == "ref_ptr":
            return "*" + ref_dtype
        if name in ("logits_ptr", "grad_ptr"):
            return "*" + dtype
        if name.endswith("_ptr"):
            return "*fp32"
        return "i64" if "stride" in name else "i32"

    def compile_variant(kernel, dtype, absent, block_v, ref_dtype=None):
        """Compile with the arguments named in ``absent`` passed as None (a compile-time constant)."""
        flags = dict({n: None for n in absent}, BLOCK_V=block_v)
        signature = {n: "constexpr" if n in flags else arg_type(n, dtype, ref_dtype or dtype)
                     for n in kernel.arg_names}
        constexprs = {(kernel.arg_names.index(n),): v for n, v in flags.items()}
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=ts.NUM_WARPS))

    count = 0
    for dtype in ("fp32", "bf16", "fp16"):
        for ref, ent, full in itertools.product([False, True], repeat=3):
            if full and not ref:
                continue
            absent = ([] if ref else ["ref_ptr", "ref_logp_ptr", "ref_lse_ptr"]) + \
                     ([] if ent else ["entropy_ptr"]) + ([] if full else ["full_kl_ptr"])
            compile_variant(ts._stream_forward_kernel, dtype, absent, 4096)
            count += 1
        for ent, full in itertools.product([False, True], repeat=2):
            absent = ([] if ent else ["entropy_ptr", "g_entropy_ptr"]) + \
                     ([] if full else ["ref_ptr", "ref_lse_ptr", "full_kl_ptr", "g_full_kl_ptr"])
            compile_variant(ts._stream_backward_kernel, dtype, absent, 1024)
            count += 1
    # A reference in another dtype than the policy (e.g. a bf16 policy, an fp32 reference).
    for dtype, ref_dtype in (("bf16", "fp32"), ("fp32", "bf16"), ("fp16", "fp32")):
        compile_variant(ts._stream_forward_kernel, dtype, [], 4096, ref_dtype)
        compile_variant(ts._stream_backward_kernel, dtype, [], 1024, ref_dtype)
        count += 2
    from kltriton.kernels.loss import triton as tl_loss
    for dtype in ("fp32", "bf16", "fp16"):
        kernel = tl_loss._scale_kernel
        signature = {"grad_ptr": "*" + dtype, "upstream_ptr": "*fp32", "numel": "i64", "BLOCK": "constexpr"}
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={(3,): tl_loss.SCALE_BLOCK}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        count += 1
    print("compiled", count)
''')


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 39" in done.stdout
