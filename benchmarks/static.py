"""Static report of the compiled Triton kernels: ``python -m benchmarks static [--out DIR]``.

Compiles every kernel variant of ``kltriton.kernels.stream.triton`` (and the loss family's fused kernel,
``kltriton.kernels.loss.triton``, in its ``STATIC_VARIANTS``, the truncation family's kernels,
``kltriton.kernels.truncation.triton``, the divergence family's JSD kernels,
``kltriton.kernels.divergence.triton``, and the invariant family's kernels, ``kltriton.kernels.invariant.triton``),
as their ``launches`` list them, for an NVIDIA target (sm_90 by default; no GPU needed) with the launch settings
``forward`` / ``backward`` would use, disassembles the cubin with the ``cuobjdump`` Triton ships, and reports per
variant: registers, spills (local memory, STL/LDL), shared memory, the vocab loop's SASS instruction count per
element handled by a thread, barriers (BAR.SYNC) and global load / store widths inside that loop. Compiles are
cached by Triton.

Must run with ``TRITON_INTERPRET=0`` (the interpreter replaces the kernels by Python functions);
``main`` sets it when it imports the kernels itself.
"""
import argparse
import datetime
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

VOCABS = (32000, 151936, 262144, 50257)  # 50257 (GPT-2): rows not 16-byte aligned
DTYPES = ("fp32", "bf16", "fp16")
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# --quick: every variant at these (vocab, dtype): split rows, unaligned rows, one program per row.
QUICK = ((151936, "bf16"), (50257, "fp32"), (32000, "fp16"))


def _arg_type(name, dtype, ref_dtype=None):
    if name == "target_ptr":
        return "*i64"
    if name in ("temperature_ptr", "hp_ptr", "top_p_ptr", "min_p_ptr", "beta_ptr"):
        return "*fp64"
    if name in ("top_k_ptr", "mass_ptr", "weighted_ptr"):  # the invariant family's fixed-point sums
        return "*i64"
    if name == "ref_ptr":
        return "*" + (ref_dtype or dtype)
    if name in ("logits_ptr", "grad_ptr"):
        return "*" + dtype
    if name.endswith("_ptr"):
        return "*fp32"
    return "i64" if "stride" in name else "i32"


def compile_kernel(kernel, dtype, vocab, constants, options, arch=90, ref_dtype=None):
    """Compile ``kernel`` as the launcher would specialize it for contiguous ``[N, vocab]`` rows:
    pointers 16-byte aligned, integers divisible by 16 marked so (Triton's default specialization),
    ``constants`` (absent tensors as None, constexprs) baked in, the reference in ``ref_dtype``
    (default ``dtype``). Returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = {"vocab": vocab, "logits_outer_stride": vocab, "logits_inner_stride": vocab,
            "ref_outer_stride": vocab, "ref_inner_stride": vocab}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
            continue
        signature[name] = _arg_type(name, dtype, ref_dtype)
        if name.endswith("_ptr") or ints.get(name, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _tool(name):
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_of(cubin: bytes):
    """(instructions [(address, text)], resource usage dict) of a cubin, via cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    instructions = [(int(m.group(1), 16), m.group(2).strip())
                    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    return instructions, usage


def loops(instructions):
    """Every backward branch as (first address, branch address): a loop body."""
    found = []
    for address, text in instructions:
        m = re.search(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-f]+)", text)
        if m and m.group(1) and int(m.group(1), 16) < address:
            found.append((int(m.group(1), 16), address))
    return found


def _width(op):
    """Bits moved by one LDG/STG opcode such as LDG.E.128 or STG.E.U16."""
    m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}[m.group(1)] if m else 32


def _opcode(text):
    """``LDG.E.128`` of ``@!P0 LDG.E.128 R4, desc[UR6][R24.64]`` (the predicate dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def _widths(prefix, texts):
    return sorted({_width(_opcode(t)) for t in texts if _opcode(t).startswith(prefix)})


def analyse(compiled, elements_per_thread):
    """The report of one compiled kernel. Its vocab loop is its largest loop body ("loop_*"; the whole
    kernel when it has no loop, as the backward: one vocab block per program)."""
    instructions, usage = sass_of(compiled.asm["cubin"])
    body = [text for _, text in instructions]  # a kernel without a loop: all of it
    if loops(instructions):
        start, end = max(loops(instructions), key=lambda se: se[1] - se[0])
        body = [text for address, text in instructions if start <= address <= end]
    spill_ops = sum(_opcode(t).startswith(("STL", "LDL")) for _, t in instructions)
    all_texts = [t for _, t in instructions]
    return {
        "registers": usage.get("REG"),
        "spill_bytes": usage.get("LOCAL", 0) + usage.get("STACK", 0),
        "spill_instructions": spill_ops,
        "shared_bytes": usage.get("SHARED", 0),
        "sass_instructions": len(instructions),
        "loop_instructions": len(body),
        "elements_per_thread_per_iteration": elements_per_thread,
        "instructions_per_element": round(len(body) / elements_per_thread, 2),
        "loop_barriers": sum(_opcode(t).startswith("BAR") for t in body),
        "loop_shuffles": sum(_opcode(t).startswith("SHFL") for t in body),
        "loop_exp2": sum(_opcode(t) == "MUFU.EX2" for t in body),
        "loop_load_bits": _widths("LDG", body),
        "loop_store_bits": _widths("STG", body),
        "load_bits": _widths("LDG", all_texts),
        "store_bits": _widths("STG", all_texts),
    }


def _kernel(name):
    from kltriton.kernels.divergence import triton as td
    from kltriton.kernels.invariant import triton as ti
    from kltriton.kernels.loss import triton as tl_loss
    from kltriton.kernels.stream import triton as ts
    from kltriton.kernels.truncation import triton as tt

    return next(getattr(module, name) for module in (ts, tl_loss, tt, td, ti) if hasattr(module, name))


def _tasks(cases):
    """(vocab, dtype, kernel name, Launch, variant name, absent arguments) of every compile."""
    from kltriton.kernels.divergence import triton as td
    from kltriton.kernels.invariant import triton as ti
    from kltriton.kernels.loss import triton as tl_loss
    from kltriton.kernels.stream import triton as ts
    from kltriton.kernels.truncation import triton as tt

    for vocab, dtype in cases:
        for module in (ts, tl_loss, tt, td, ti):
            for kernel_name, launch, name, absent in module.launches(vocab, BYTES[dtype]):
                yield vocab, dtype, kernel_name, launch, name, absent


def _compile_and_analyse(task, arch):
    vocab, dtype, kernel_name, launch, name, absent = task
    constants = dict({a: None for a in absent}, **launch.constexprs)
    compiled = compile_kernel(_kernel(kernel_name), dtype, vocab, constants, launch.options, arch)
    row = dict(kernel=kernel_name, variant=name, vocab=vocab, dtype=dtype, arch=f"sm_{arch}",
               constexprs=launch.constexprs, **launch.options)
    threads = 32 * launch.options["num_warps"]
    row.update(analyse(compiled, max(1, launch.elements_per_iteration // threads)))
    return row


def report(vocabs=VOCABS, dtypes=DTYPES, cases=None, arch=90, jobs=1):
    """Rows for every kernel variant at each (vocab, dtype) (or the given ``cases``), compiled by
    ``jobs`` processes."""
    tasks = list(_tasks(cases or list(itertools.product(vocabs, dtypes))))
    if jobs > 1:
        import concurrent.futures
        import functools
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = list(pool.map(functools.partial(_compile_and_analyse, arch=arch), tasks))
    else:
        rows = [_compile_and_analyse(task, arch) for task in tasks]
    for row in rows:
        print(_line(row), flush=True)
    return rows


def _line(row):
    return (f"{row['kernel']:28s} {row['variant']:18s} {row['vocab']:7d} {row['dtype']:5s} "
            f"reg {row['registers']:3d} spill {row['spill_bytes']:3d} smem {row['shared_bytes']:5d} "
            f"inst/elem {str(row['instructions_per_element']):>6s} bar {row['loop_barriers']} "
            f"shfl {row['loop_shuffles']} ldg {row['loop_load_bits']} stg {row['loop_store_bits']}")


def problems(rows):
    """Regressions the CPU test guards against: spills, lost 128-bit loads where V % 16 == 0,
    a barrier inside a forward vocab loop."""
    found = []
    for r in rows:
        where = f"{r['kernel']} {r['variant']} V={r['vocab']} {r['dtype']}"
        if r["spill_bytes"] or r["spill_instructions"]:
            found.append(f"{where}: spills ({r['spill_bytes']} bytes local memory)")
        reads_logits = r["kernel"] != "_stream_combine_kernel"
        # the truncation family's census reads 4 entries per thread in every dtype (8-byte loads in 16-bit ones)
        census = r["kernel"] == "_truncated_forward_kernel" and "+floor" not in r["variant"] and r["dtype"] != "fp32"
        if reads_logits and not census and r["vocab"] % 16 == 0 and r["loop_load_bits"] and max(r["loop_load_bits"]) < 128:
            found.append(f"{where}: no 128-bit loads in the vocab loop ({r['loop_load_bits']})")
        if "backward" not in r["kernel"] and r["loop_barriers"]:
            found.append(f"{where}: {r['loop_barriers']} barriers inside the vocab loop")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks static", description=__doc__)
    parser.add_argument("--out", type=Path, help="directory for the JSON (default: print only)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90)")
    parser.add_argument("--quick", action="store_true", help=f"only (vocab, dtype) in {QUICK}")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    if "kltriton.kernels.stream.triton" in sys.modules:
        raise RuntimeError("import the Triton kernels after TRITON_INTERPRET=0 (run in a fresh process)")
    import triton

    rows = report(cases=QUICK if args.quick else None, arch=args.arch, jobs=args.jobs)
    found = problems(rows)
    for p in found:
        print("PROBLEM:", p)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = args.out / f"static_sm{args.arch}_triton{triton.__version__}_{stamp}.json"
        path.write_text(json.dumps({"triton": triton.__version__, "arch": args.arch, "problems": found,
                                    "rows": rows}, indent=1))
        print(f"wrote {len(rows)} rows to {path}")
    return 1 if found else 0
