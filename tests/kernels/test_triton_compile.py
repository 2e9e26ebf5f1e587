"""The Triton kernels compile for Hopper (sm_90) without a GPU.

The CPU interpreter runs the kernel bodies as numpy and misses compiler-only errors (e.g. a
non-constexpr global, a type change of a loop-carried value). Triton can compile for a named
target without a device, so every kernel variant is compiled here in a subprocess (the
interpreter is switched on for the rest of the suite), with the launch settings ``forward`` /
``backward`` use (``benchmarks/static.py``), for every dtype at a vocab that splits rows across
programs (the combine kernel too) and is not a multiple of 16; a reference in another dtype than
the policy; the loss family's fused kernel (its ``STATIC_VARIANTS`` and every other fused formula), the entropy mask's
accumulate kernel and the scaling kernel; the truncation and invariant families' kernels.
``test_static_report.py`` covers aligned vocabs.
"""
import os
import subprocess
import sys
import textwrap

COMPILE_ALL = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from benchmarks import static
    from kltriton.kernels.divergence import triton as td
    from kltriton.kernels.loss import triton as tl_loss
    from kltriton.kernels.stream import triton as ts

    count = len(static.report(cases=[(100003, dtype) for dtype in static.DTYPES]))
    # A reference in another dtype than the policy (e.g. a bf16 policy, an fp32 reference).
    for dtype, ref_dtype in (("bf16", "fp32"), ("fp32", "bf16"), ("fp16", "fp32")):
        for name, launch, variant, absent in ts.launches(32000, static.BYTES[dtype]):
            if variant in ("fwd+reflogp", "bwd+plogp+plogq", "bwd+q"):  # the variants that read the reference
                constants = dict(launch.constexprs, **{a: None for a in absent})
                static.compile_kernel(getattr(ts, name), dtype, 32000, constants, launch.options, 90, ref_dtype)
                count += 1
        for name, launch, variant, absent in tl_loss.launches(32000, static.BYTES[dtype]):
            if "ref" in variant:
                constants = dict(launch.constexprs, **{a: None for a in absent})
                static.compile_kernel(getattr(tl_loss, name), dtype, 32000, constants, launch.options, 90, ref_dtype)
                count += 1
        for name, launch, variant, absent in td.launches(32000, static.BYTES[dtype]):  # a teacher in its dtype
            constants = dict(launch.constexprs, **{a: None for a in absent})
            static.compile_kernel(getattr(td, name), dtype, 32000, constants, launch.options, 90, ref_dtype)
            count += 1
    # The fused formulas that STATIC_VARIANTS leaves out, with TRL's bias-corrected KL (a runtime value).
    others = tuple((f, False, f, "k1", False) for f in tl_loss.formulas.FUSED
                   if f not in {v[2] for v in tl_loss.STATIC_VARIANTS})
    for name, launch, variant, absent in tl_loss.launches(32000, 4, others):
        if name == "_loss_forward_kernel":
            constants = dict(launch.constexprs, **{a: None for a in absent})
            static.compile_kernel(tl_loss._loss_forward_kernel, "fp32", 32000, constants, launch.options, 90)
            count += 1
    for dtype in ("fp32", "bf16", "fp16"):
        kernel = tl_loss._scale_kernel
        signature = {"grad_ptr": "*" + dtype, "upstream_ptr": "*fp32", "numel": "i64", "BLOCK": "constexpr"}
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={(3,): tl_loss.SCALE_BLOCK}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        count += 1
    from kltriton.kernels import constants
    from kltriton.kernels.epilogue import triton as et
    from kltriton.kernels.layout import triton as lt

    def build(kernel, types, constexprs):
        """``kernel`` compiled for sm_90 with these argument types (default: i64 scalars, fp32 pointers)."""
        signature, cx = {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
                cx[(i,)] = constexprs[name]
            else:
                signature[name] = types.get(name, "i64" if not name.endswith("_ptr") else "*fp32")
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=cx),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

    # The [N] kernels: the layout family's targets (a shift, packed segments), its loss weights (every aggregation)
    # and scored rows; the epilogue's KL, reward and backward (every estimator); the loss family's terms (every fused
    # formula, without a KL, with k3, with the full KL).
    layout_types = {"labels_ptr": "*i64", "mask_ptr": "*u8", "cu_ptr": "*i32", "temperature_ptr": "*fp64",
                    "target_ptr": "*i64", "flags_ptr": "*i64", "adv_ptr": "*fp32", "num_tokens_ptr": "*fp64",
                    "num_seqs_agg_ptr": "*fp64", "horizon_ptr": "*fp64", "out_ptr": "*fp32", "rows_ptr": "*bf16",
                    "kl_coef": "fp64", "entropy_coef": "fp64"}
    for shift in (False, True):
        for cu in (None, "cu"):
            absent = {} if cu else {"cu_ptr": None}
            build(lt._target_kernel, layout_types, dict(absent, SHIFT=shift, BLOCK=lt.BLOCK))
            count += 1
    for aggregation in constants.AGGREGATIONS:
        for per_seq in (False, True):
            build(lt._weights_kernel, layout_types, dict(SHIFT=True, AGGREGATION=aggregation, PER_SEQUENCE=per_seq,
                                                         BLOCK=lt.BLOCK))
            count += 1
    build(lt._scored_rows_kernel, layout_types, dict(BLOCK=256))
    count += 1
    epi_types = {"target_ptr": "*i64", "coef_ptr": "*fp64", "cu_ptr": "*i64", "kl_clamp": "fp64", "score_clip": "fp64"}
    for est in ("k1", "abs", "k2", "k3", "full"):
        for straight in ((False, True) if est in ("k1", "k3") else (False,)):
            for kernel, given in ((et._kl_kernel, True), (et._reward_kernel, False), (et._backward_kernel, False)):
                build(kernel, epi_types, dict(REF_GIVEN=given, ESTIMATOR=est, STRAIGHT=straight, BLOCK=et.BLOCK))
                count += 1
    terms_types = {"target_ptr": "*i64", "hp_ptr": "*fp64"}
    for formula in tl_loss.formulas.FUSED:
        for est in ("", "k3", "full"):
            build(tl_loss._terms_kernel, terms_types, dict(REF_GIVEN=False, LOSS_TYPE=formula, ESTIMATOR=est,
                                                            STRAIGHT=False, BLOCK=tl_loss.TERMS_BLOCK))
            count += 1
    print("compiled", count)
''')


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    # Per dtype: 12 forward variants (every request the bits allow), their 12 combine kernels, 8 backward variants (every
    # set of optional basis terms), the fused loss kernel's STATIC_VARIANTS and the entropy mask's accumulate variants,
    # the JSD pass and its gradient, the truncation family's 4 forward and 2 backward variants, the invariant family's 2
    # maxima and 4 sums variants; mixed reference dtypes: forward with a reference and the backward with the log q and the
    # q terms for 3 pairs, plus the combine kernel of the fp32 policy (V = 32000 splits there), the loss kernel's variants
    # with reference logits and the JSD kernels for 3 pairs; the fused formulas that STATIC_VARIANTS leaves out; the scale
    # kernel; the [N] kernels (layout, epilogue, the loss's terms).
    assert "compiled 270" in done.stdout, done.stdout
