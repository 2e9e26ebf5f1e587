"""Triton backend of the ``stream`` family (row helpers: ``kltriton.kernels.triton_rows``).

Forward: one program streams a row (policy and reference in the same loop) into a per-lane state and
stores its statistics; nothing of size ``[N, V]`` is written and a row is read once. Rows longer than
``CHUNK_BLOCKS`` tiles are split across programs (a number that depends on ``V`` only: batch invariance)
whose states a small second kernel merges. Backward recomputes the probabilities from the saved fp32
log-sum-exp on a (row, vocab block) grid, on the gradient basis. See ``kltriton.kernels.stream`` for the
contract and ``python -m benchmarks static`` for what each variant compiles to. Absent optional tensors
are passed as ``None``: Triton specializes the kernel on them (a compile-time constant), so a variant
without a reference never carries its pointer or its code.
"""
import torch
import triton
import triton.language as tl

from kltriton.kernels import constants, statistics
from kltriton.kernels import triton_rows as rows
from kltriton.kernels.layout import triton as layout
from kltriton.kernels.row_views import num_rows
from kltriton.kernels.statistics import StreamStats


def _combine_launch(split: int, request: int) -> rows.Launch:
    return rows.Launch(dict(WANT=request, SPLIT=split, SPLIT_P2=triton.next_power_of_2(split)),
                     dict(num_warps=1, enable_fp_fusion=True), 1)


def backward_launch(vocab: int) -> rows.Launch:
    block = rows.backward_block(vocab)
    return rows.Launch(dict(BLOCK_V=block), rows.options(), block, triton.cdiv(vocab, block))


def _forward_launch(vocab: int, elem_bytes: int, request: int) -> rows.Launch:
    tile = rows.forward_tile(vocab, elem_bytes, bool(request & constants.REF))
    return tile._replace(constexprs=dict(tile.constexprs, WANT=request))


def requests():
    """Every request a forward variant serves: any set of the request bits, those that read the reference only with
    the reference's own (``constants.NEEDS_REF``), the head's (``constants.HEAD``) only without them."""
    bits = constants.request_bits()
    return [r for r in range(bits + 1) if r & ~bits == 0 and (r & constants.REF or not r & constants.NEEDS_REF)
            and not (r & constants.HEAD and r & constants.NEEDS_REF)]


def _variant_name(prefix, flags):
    return prefix + "".join(f"+{name}" for name, on in flags if on)


def launches(vocab: int, elem_bytes: int):
    """(kernel name, Launch, variant name, absent arguments) of every kernel ``forward`` / ``backward``
    launches for this vocab and logits element size (for ``benchmarks/static.py``)."""
    out = []
    for request in requests():
        bit_names = {}  # one name per bit: its first statistic's ("reflogp" for ref_logp and ref_lse)
        for s, bit in constants.STATISTICS:
            bit_names.setdefault(bit, s.replace("_", ""))
        bit_names[constants.HEAD] = "head"  # is_top1, sum_logits, log_sum_sq_probs, max_logit
        name = _variant_name("fwd", [(bit_name, bit and request & bit) for bit, bit_name in bit_names.items()])
        absent = [f"{s}_ptr" for s in statistics.NAMES if not statistics.present(request, s)]
        absent += [] if request & constants.REF else ["ref_ptr"]
        launch = _forward_launch(vocab, elem_bytes, request)
        out.append(("_stream_forward_kernel", launch, name, absent + ([] if launch.grid_split > 1 else ["partial_ptr"])))
        if launch.grid_split > 1:
            out.append(("_stream_combine_kernel", _combine_launch(launch.grid_split, request), name, absent))
    optional = constants.BASIS_BITS
    for terms in range(sum(optional.values()) + 1):
        name = _variant_name("bwd", [(term.replace("_", ""), terms & bit) for term, bit in optional.items()])
        launch = backward_launch(vocab)
        launch = launch._replace(constexprs=dict(launch.constexprs, TERMS=terms))
        absent = [] if terms & constants.BASIS_NEEDS_REF else ["ref_ptr", "ref_lse_ptr"]
        out.append(("_stream_backward_kernel", launch, name, absent + list(UPSTREAM_POINTERS) + ["floor_ptr"]))
    # From the upstream gradients: of the log-prob (and the entropy), of the full KL, of the forward KL.
    for gradients, terms in ((("g_logp",), 0), (("g_logp", "g_entropy", "entropy"), constants.P_LOGP),
                             (("g_full_kl", "full_kl"), constants.P_LOGP | constants.P_LOGQ), (("g_forward_kl",), constants.Q)):
        launch = backward_launch(vocab)
        launch = launch._replace(constexprs=dict(launch.constexprs, TERMS=terms))
        absent = [] if terms & constants.BASIS_NEEDS_REF else ["ref_ptr", "ref_lse_ptr"]
        absent += [f"{p}_ptr" for p in ("g_logp", "g_entropy", "g_full_kl", "g_forward_kl", "entropy", "full_kl")
                   if p not in gradients]
        out.append(("_stream_backward_kernel", launch, "bwd-" + "+".join(g for g in gradients if g.startswith("g_")),
                    absent + ["basis_ptr", "floor_ptr"]))
    return out


UPSTREAM_POINTERS = ("g_logp_ptr", "g_entropy_ptr", "g_full_kl_ptr", "g_forward_kl_ptr", "entropy_ptr", "full_kl_ptr")


@triton.jit
def _stream_forward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    target_ptr,                 # [N] int64: label, SKIP or OUT_OF_RANGE
    logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,  # [N] fp32 statistics, None if absent
    forward_kl_ptr, is_top1_ptr, sum_logits_ptr, log_sum_sq_probs_ptr, max_logit_ptr,
    partial_ptr,                # [N, SPLIT, STATE_SIZE] fp32 per-chunk states (SPLIT > 1), or None
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    WANT: tl.constexpr, SUBTILES: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, SPLIT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Grid ``(N, SPLIT)``: program ``(row, k)`` reduces vocab chunk ``k`` of ``row``. With one chunk it
    stores the statistics; otherwise the chunk's state, merged by ``_stream_combine_kernel``. Program ``(row, 0)`` of
    a skipped row stores its statistics."""
    row, target, inv_temperature, log2e_over_t, x_row, y_row = rows.program_row(
        target_ptr, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer, logits_outer_stride,
        logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
    if target >= 0:  # a skipped row is never read
        if SPLIT == 1:
            x_label, y_label = rows.label_logits(x_row, y_row, target, ref_ptr is not None)  # issued before the loop
            state = rows.stream_chunk(x_row, y_row, 0, vocab, log2e_over_t, WANT, SUBTILES, LANES, VEC, None, target)
            values = rows.finalize(state, x_label, y_label, inv_temperature, WANT)
            rows.store_stats(row, values, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,
                           forward_kl_ptr, is_top1_ptr, sum_logits_ptr, log_sum_sq_probs_ptr,
                           max_logit_ptr)
        else:
            part = tl.program_id(1)
            lo = part * CHUNK
            state = rows.stream_chunk(x_row, y_row, lo, tl.minimum(lo + CHUNK, vocab), log2e_over_t, WANT, SUBTILES, LANES,
                                      VEC, None, target)
            rows.store_state(partial_ptr + (row.to(tl.int64) * SPLIT + part) * rows.STATE_SIZE, state)
    elif tl.program_id(1) == 0:  # whatever SPLIT: the combine kernel merges the scored rows only
        rows.store_stats(row, rows.skipped_stats(target), logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr,
                       full_kl_ptr, forward_kl_ptr, is_top1_ptr, sum_logits_ptr, log_sum_sq_probs_ptr,
                           max_logit_ptr)


@triton.jit
def _stream_combine_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    target_ptr,
    logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,  # as the forward
    forward_kl_ptr, is_top1_ptr, sum_logits_ptr, log_sum_sq_probs_ptr, max_logit_ptr,
    partial_ptr,                # [N, SPLIT, STATE_SIZE] fp32 per-chunk states
    temperature_ptr, temperature_stride,
    WANT: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
):
    """Grid ``(N,)``: merge a scored row's ``SPLIT`` chunk states in chunk order and store its statistics (a skipped
    row's are the forward kernel's)."""
    row, target, inv_temperature, log2e_over_t, x_row, y_row = rows.program_row(
        target_ptr, temperature_ptr, temperature_stride, logits_ptr, logits_rows_per_outer, logits_outer_stride,
        logits_inner_stride, ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
    if target >= 0:
        x_label, y_label = rows.label_logits(x_row, y_row, target, ref_ptr is not None)
        part = tl.arange(0, SPLIT_P2)
        parts = partial_ptr + (row.to(tl.int64) * SPLIT + part) * rows.STATE_SIZE
        state = rows.merge(rows.load_states(parts, part < SPLIT), log2e_over_t, WANT)  # padding parts: empty states
        values = rows.finalize(state, x_label, y_label, inv_temperature, WANT)
        rows.store_stats(row, values, logp_ptr, lse_ptr, entropy_ptr, ref_logp_ptr, ref_lse_ptr, full_kl_ptr,
                       forward_kl_ptr, is_top1_ptr, sum_logits_ptr, log_sum_sq_probs_ptr,
                           max_logit_ptr)


@triton.jit
def _stream_backward_kernel(
    logits_ptr, logits_rows_per_outer, logits_outer_stride, logits_inner_stride,  # [A, B, V] view
    ref_ptr, ref_rows_per_outer, ref_outer_stride, ref_inner_stride,              # same, or None
    grad_ptr,                   # [N, V] contiguous output, logits dtype
    target_ptr,                 # [N] int64
    lse_ptr, ref_lse_ptr,       # [N] fp32 (ref_lse_ptr: with the p_logq or q term, else None)
    basis_ptr,                  # [N, len(GRADIENT_BASIS)] fp32 gradient basis (/ T), absent terms not read; or None:
    g_logp_ptr, g_entropy_ptr, g_full_kl_ptr, g_forward_kl_ptr,  # [N] the upstream gradients (None: none), with
    entropy_ptr, full_kl_ptr,   # [N] the values their terms read: the basis is the row's own (upstream_basis)
    floor_ptr,                  # [N] fp32: the policy's logits below it have no mass (a truncation), or None
    vocab,
    temperature_ptr, temperature_stride,  # float64 [] (stride 0) or [N] (stride 1): data, no recompile
    TERMS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid ``(N, cdiv(V, BLOCK_V))``: one vocab block of one row per program, no reduction. With a floor (the
    truncation family's backward) the policy's logits below it are read as ``-inf``: no gradient there."""
    row = tl.program_id(0)
    offs, in_vocab, grad_row, target, lse, live = rows.gradient_row_block(row, tl.program_id(1), target_ptr, lse_ptr,
                                                                        grad_ptr, vocab, BLOCK_V)
    if live:
        inv_temperature, x = rows.live_row_block(row, offs, in_vocab, temperature_ptr, temperature_stride, logits_ptr,
                                               logits_rows_per_outer, logits_outer_stride, logits_inner_stride)
        if floor_ptr is not None:
            x = rows.below_floor_absent(x, tl.load(floor_ptr + row))
        y = x
        ref_lse = 0.0
        if (rows.BASIS_P_LOGQ | rows.BASIS_Q) & TERMS:
            ref_lse = tl.load(ref_lse_ptr + row)
            y_row = ref_ptr + rows.row_offset(row, ref_rows_per_outer, ref_outer_stride, ref_inner_stride)
            y = tl.load(y_row + offs, mask=in_vocab, other=rows.NEG_INF).to(tl.float32)
        if basis_ptr is not None:
            basis = rows.load_basis(basis_ptr, row, TERMS)
        else:
            basis = rows.upstream_basis(row, g_logp_ptr, g_entropy_ptr, g_full_kl_ptr, g_forward_kl_ptr, entropy_ptr,
                                        full_kl_ptr, temperature_ptr, temperature_stride)
        grad = rows.grad_block(x, y, offs, target, lse, ref_lse, basis, inv_temperature, TERMS)
        tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)
    else:
        tl.store(grad_row + offs, tl.zeros((BLOCK_V,), grad_ptr.dtype.element_ty), mask=in_vocab)


def forward(logits, ref_logits, target, temperature, request) -> StreamStats:
    n, vocab = num_rows(logits), logits.shape[-1]
    stats = statistics.empty_stats(n, request, lambda size: torch.empty(size, dtype=torch.float32,
                                                                        device=logits.device))
    if n == 0:
        return stats
    launch = _forward_launch(vocab, logits.element_size(), request)
    split = launch.grid_split
    partial = (torch.empty((n, split, rows.STATE_SIZE), dtype=torch.float32, device=logits.device)
               if split > 1 else None)
    views = (*rows.view_args(logits), *rows.view_args(ref_logits))
    outputs = (target, *(value if value.numel() else None for value in stats), partial)
    temperature_args = (temperature, 1 if temperature.dim() else 0)
    _stream_forward_kernel[(n, split)](*views, *outputs, vocab, *temperature_args, **launch.constexprs,
                                       **launch.options)
    if split > 1:
        combine = _combine_launch(split, request)
        _stream_combine_kernel[(n,)](*views, *outputs, *temperature_args, **combine.constexprs, **combine.options)
    return stats


def forward_labels(logits, ref_logits, labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, shift, flags,
                   temperature, request):
    """``forward`` at the ``layout`` family's target of the label side (the contract in ``kernels.stream``)."""
    target = layout.target(labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, logits.shape[-1], shift,
                           flags)
    return target, forward(logits, ref_logits, target, temperature, request)


def backward(logits, ref_logits, target, temperature, lse, ref_lse, basis, floor=None) -> torch.Tensor:
    """The family's backward; ``floor`` (``[N]`` fp32, the truncation family's): the policy's logits below it have no
    mass."""
    coefficients, terms = rows.stacked_basis(basis)
    return _backward(logits, ref_logits if basis.reads_ref() else None, target, temperature, lse, ref_lse, terms,
                     (coefficients,) + (None,) * 6, floor)


def backward_upstream(logits, ref_logits, target, temperature, lse, ref_lse, upstream, out=None) -> torch.Tensor:
    terms = rows.upstream_terms(upstream)
    with_ref = bool(terms & constants.BASIS_NEEDS_REF)
    return _backward(logits, ref_logits if with_ref else None, target, temperature, lse, ref_lse, terms,
                     (None, *upstream), None, out)


def _backward(logits, ref_logits, target, temperature, lse, ref_lse, terms, coefficients, floor, out=None):
    """``coefficients``: the stacked basis and six Nones, or None and the ``Upstream`` tensors; ``out``: where to
    write the gradient (contiguous, shaped and typed like ``logits``; it may be ``logits``: each program reads its
    block before it writes it), else a new tensor."""
    n, vocab = num_rows(logits), logits.shape[-1]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out
    if n == 0:
        return grad
    with_ref = ref_logits is not None
    launch = backward_launch(vocab)
    _stream_backward_kernel[(n, launch.grid_split)](
        *rows.view_args(logits), *rows.view_args(ref_logits), grad, target,
        lse, ref_lse if with_ref else None, *coefficients, floor, vocab, temperature, 1 if temperature.dim() else 0,
        TERMS=terms, **launch.constexprs, **launch.options,
    )
    return grad
