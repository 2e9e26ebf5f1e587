"""The ``linear`` family's algorithm, shared by every backend: GEMM tiles of scored rows folded by a
``stream`` kernel (see ``kltriton.kernels.linear`` for the contract).

Rows are projected in tiles of a fixed shape ``[tile_rows, vocab_tile]`` (the last token tile is padded
with ``SKIP`` rows), so a row's logits come from a GEMM of the same shape whatever ``N``, its place
or the number of scored rows (batch invariance: BLAS libraries pick other kernels for other shapes).
"""
import torch

from kltriton._env import env_int

from kltriton.kernels import SKIP, OUT_OF_RANGE, accumulation_dtype, statistics
from kltriton.kernels.divergence.composed import statistics_request as divergence_request
from kltriton.kernels.linear import scaled_and_capped
from kltriton.kernels.loss import LossInputs, statistics_request as loss_request
from kltriton.kernels.row_views import as_rows3d
from kltriton.kernels.statistics import StreamStats

# Elements of one logits tile: 32 MiB of fp32 on CPU (a tile and its gradient stay well under eager's
# [N, V]), 128 MiB on CUDA (large enough GEMMs for the tensor cores).
DEFAULT_TILE = {"cuda": 1 << 25}
DEFAULT_TILE_CPU = 1 << 23
MIN_ROWS, MAX_ROWS, ROW_MULTIPLE = 64, 1024, 16


def default_tile_elements(device_type: str) -> int:
    """``KLTRITON_LINEAR_TILE``, else the device's default (elements of the working tile)."""
    return env_int("KLTRITON_LINEAR_TILE") or DEFAULT_TILE.get(device_type, DEFAULT_TILE_CPU)


def plan(vocab: int, tile_elements: int):
    """``(tile_rows, vocab_tile)`` of the working tile: as many rows as the budget allows for whole
    rows (``MIN_ROWS``..``MAX_ROWS``, a multiple of 16), the vocab split when a row does not fit."""
    tile_rows = min(MAX_ROWS, max(MIN_ROWS, tile_elements // vocab)) // ROW_MULTIPLE * ROW_MULTIPLE
    return tile_rows, min(vocab, max(1, tile_elements // tile_rows))


def _vocab(side) -> int:
    return side.x.shape[-1] if side.weight is None else side.weight.shape[0]


def _take(x, idx):
    """Rows ``idx`` of ``x [..., D]`` as ``[len(idx), D]`` (leading dims read in place)."""
    rows3d = as_rows3d(x)
    width = rows3d.shape[1]
    return rows3d[idx // width, idx % width]


def _operand(t, acc):
    """A GEMM operand: in ``acc`` on CPU (no mixed-dtype GEMM there); CUDA half tensors stay half
    and the GEMMs accumulate into ``acc`` through ``out_dtype``."""
    return t if t.dtype == acc or t.is_cuda else t.to(acc)


def _mm(a, b, acc, out=None):
    """``a @ b`` in ``acc`` (fp32 accumulation for CUDA half operands)."""
    if a.dtype == acc and b.dtype == acc:
        return torch.mm(a, b, out=out)
    return torch.mm(a.to(b.dtype), b, out_dtype=acc, out=out)


def _add_mm(acc_out, a, b):
    """``acc_out += a @ b``."""
    if a.dtype == acc_out.dtype and b.dtype == acc_out.dtype:
        acc_out.addmm_(a, b)
    else:
        acc_out.add_(_mm(a, b, acc_out.dtype))


class _TileSide:
    """One token tile of a side: the gathered rows and the GEMM operands they need."""

    def __init__(self, side, idx, acc):
        self.side, self.acc = side, acc
        self.x = _take(side.x.detach(), idx)
        if side.weight is not None:
            self.x = _operand(self.x, acc)

    def weight(self, v0, v1):
        return _operand(self.side.weight.detach()[v0:v1], self.acc)

    def logits(self, v0, v1, buffer):
        """The ``[tile_rows, v1 - v0]`` logits tile, in ``buffer``'s storage."""
        side = self.side
        out = buffer.view(-1)[: self.x.shape[0] * (v1 - v0)].view(self.x.shape[0], v1 - v0)
        if side.weight is None:
            return out.copy_(self.x[:, v0:v1])
        _mm(self.x, self.weight(v0, v1).T, self.acc, out=out)
        if side.bias is not None:
            out.add_(side.bias.detach()[v0:v1])
        if side.scale is not None:
            out.mul_(side.scale)
        if side.softcap is not None:
            out.div_(side.softcap).tanh_().mul_(side.softcap)
        return out


def _project(side, rows, out):
    """``out = `` the logits of ``side``'s LM head on ``rows [tile_rows, H]`` (bias, scale and softcap applied in
    place), all of the vocabulary."""
    weight = _operand(side.weight.detach(), out.dtype)
    if side.bias is not None and rows.dtype == out.dtype and weight.dtype == out.dtype:
        torch.addmm(side.bias.detach().to(out.dtype), rows, weight.T, out=out)
    else:
        _mm(rows, weight.T, out.dtype, out=out)
        if side.bias is not None:
            out.add_(side.bias.detach())
    if side.scale is not None:
        out.mul_(side.scale)
    if side.softcap is not None:
        out.div_(side.softcap).tanh_().mul_(side.softcap)
    return out


def one_tile(policy, ref, n: int, tile_elements: int) -> bool:
    """Whether a call is one working tile of whole rows: an LM-head policy without a reference side whose ``n`` rows
    fit the tile's ``tile_rows``. Its forward keeps the tile (``one_tile_forward``) for the backward, which writes
    the logits gradient over it (``one_tile_backward``): one GEMM, one ``stream`` kernel each way, no host sync."""
    if policy.weight is None or ref is not None:
        return False
    vocab = _vocab(policy)
    tile_rows, vocab_tile = plan(vocab, tile_elements)
    return n <= tile_rows and vocab_tile == vocab


def one_tile_operand(policy, tile_rows: int):
    """``(rows [N, H], out [tile_rows, H])``: the policy's hidden states as rows, and the uninitialized buffer of the
    one-tile path's GEMM operand (``_operand``'s dtype: CUDA half stays half), which the layout family's
    ``scored_rows`` fills."""
    x = policy.x.detach()
    dtype = x.dtype if x.is_cuda else accumulation_dtype(x.dtype)
    return (x.reshape(x.shape[:-1].numel(), x.shape[-1]),
            torch.empty((tile_rows, x.shape[-1]), dtype=dtype, device=x.device))


def bind_one_tile(stream, layout):
    """``(forward, backward)`` of the one-tile path (``one_tile``) on the ``stream`` and ``layout`` modules."""

    def forward(policy, target, temperature, request, tile_elements, rows=None):
        """``(StreamStats, tile)``: the statistics of the policy's rows, projected as rows ``[0, N)`` of one
        ``[tile_rows, V]`` tile (the GEMM's shape fixed: batch invariance; the unscored positions' rows zero), and
        that tile (fp32; its rows past ``N`` hold the logits of zero rows, never read). ``rows``: the GEMM's operand
        made with the target (``_inputs.Layout.scored_rows``), or None: made here."""
        n, vocab = target.numel(), _vocab(policy)
        tile_rows, _ = plan(vocab, tile_elements)
        if rows is None:
            rows = _rows(policy, target, tile_rows)
        tile = _project(policy, rows, torch.empty((tile_rows, vocab), dtype=accumulation_dtype(policy.x.dtype),
                                                  device=target.device))
        return stream.forward(tile[:n], None, target, temperature, request), tile

    def _rows(policy, target, tile_rows):
        """The GEMM's ``[tile_rows, H]`` operand: the scored rows of the policy's hidden states, the others zero."""
        rows, out = one_tile_operand(policy, tile_rows)
        return layout.scored_rows(rows, target, out)

    def backward(policy, tile, target, temperature, lse, upstream, want_x, want_weight, want_bias):
        """``(d_x, d_weight, d_bias)`` from the forward's ``tile``: the logits gradient written over its first ``N``
        rows (the upstream gradients' basis made in the kernel), chained through softcap and scale, then
        ``d_x = grad @ weight`` over the whole tile (the GEMM's shape fixed) and ``d_weight = grad.T @ x``,
        ``d_bias = grad.sum(0)`` over the ``N`` rows. None where not asked."""
        n = target.numel()
        grad = stream.backward_upstream(tile[:n], None, target, temperature, lse, None, upstream, out=tile[:n])
        if policy.softcap is not None or policy.scale is not None:  # the chain needs the logits: recompute them
            _chain(policy, _project(policy, _rows(policy, target, tile.shape[0]), torch.empty_like(tile))[:n], grad)
        weight = _operand(policy.weight.detach(), tile.dtype)
        d_x = _mm(tile, weight, tile.dtype)[:n].view(policy.x.shape).to(policy.x.dtype) if want_x else None
        x = policy.x.detach().reshape(n, policy.x.shape[-1])
        d_weight = _mm(grad.T, _operand(x, tile.dtype), tile.dtype).to(policy.weight.dtype) if want_weight else None
        d_bias = grad.sum(0).to(policy.bias.dtype) if want_bias and policy.bias is not None else None
        return d_x, d_weight, d_bias

    return forward, backward


def _scored_tiles(target, ok, tile_rows):
    """``(idx, padded_idx, m)`` per token tile of the rows where ``ok``; one host sync (the count)."""
    scored = torch.nonzero(ok).squeeze(1)
    for start in range(0, scored.numel(), tile_rows):
        idx = scored[start:start + tile_rows]
        m = idx.numel()
        yield idx, torch.cat([idx, idx[:1].expand(tile_rows - m)]), m


def _tile_target(target, padded, m):
    tgt = target[padded].clone()
    tgt[m:] = SKIP
    return tgt


def _local_target(tgt, v0, width):
    """Targets inside the vocab tile ``[v0, v0 + width)``: the label's column, else column 0 (rows
    whose label is elsewhere, in another tile or on another vocab shard, still need the tile's
    statistics); ``SKIP`` stays."""
    inside = (tgt >= v0) & (tgt < v0 + width)
    return torch.where(tgt >= 0, torch.where(inside, tgt - v0, 0), tgt), inside


def _temp(temperature, padded):
    return temperature if temperature.dim() == 0 else temperature[padded]


def bind(stream):
    """``(forward, backward, column_forward, column_backward)`` of the ``linear`` family on top of the ``stream``
    module ``stream``."""

    def forward(policy, ref, target, temperature, request, tile_elements) -> StreamStats:
        return _forward(policy, ref, target, temperature, request, tile_elements)[0]

    def column_forward(policy, target, temperature, request, ids, tile_elements):
        """``(StreamStats, column_logits)``: ``forward`` of the policy alone, and its logits (scale and softcap
        applied) at ``ids [N, K]`` (``-1`` padding: ``-inf``; 0 on unscored rows) gathered from the same tiles."""
        return _forward(policy, None, target, temperature, request, tile_elements, ids)

    def _forward(policy, ref, target, temperature, request, tile_elements, ids=None):
        n, vocab = target.numel(), _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        out = statistics.empty_stats(n, request, lambda size: torch.zeros(size, dtype=acc, device=target.device))
        columns = None if ids is None else torch.zeros(ids.shape, dtype=acc, device=target.device)
        tile_rows, vocab_tile = plan(vocab, tile_elements)
        buffer = torch.empty(tile_rows * vocab_tile, dtype=acc, device=target.device)
        ref_buffer = torch.empty_like(buffer) if ref is not None else None
        for idx, padded, m in _scored_tiles(target, target >= 0, tile_rows):
            tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
            pol = _TileSide(policy, padded, acc)
            rfs = _TileSide(ref, padded, acc) if ref is not None else None
            tile_ids = None if ids is None else ids[padded]
            stats, tile_columns = _vocab_tiled_forward(pol, rfs, tgt, temp, request, vocab, vocab_tile, buffer,
                                                       ref_buffer, tile_ids)
            for dst, src in zip(out, stats):
                if dst.numel():
                    dst[idx] = src[:m]
            if ids is not None:
                columns[idx] = tile_columns[:m]
        _nan_at_out_of_range(out, target)
        if ids is not None:
            columns.masked_fill_((target >= 0)[:, None] & (ids < 0), float("-inf"))
        return out, columns

    def _vocab_tiled_forward(pol, rfs, tgt, temp, request, vocab, vocab_tile, buffer, ref_buffer, ids):
        """Each vocab tile as its own row piece through the stream kernel, merged by ``statistics.merge``, and the
        tiles' logits at ``ids`` (None: none). A label outside every tile (``tgt >= vocab``) gives
        ``statistics.LABEL_ELSEWHERE`` log-probs."""
        parts, held, before = [], [], []
        columns = None if ids is None else torch.zeros(ids.shape, dtype=buffer.dtype, device=buffer.device)
        for v0 in range(0, vocab, vocab_tile):
            v1 = min(v0 + vocab_tile, vocab)
            local, inside = _local_target(tgt, v0, v1 - v0)
            ref_tile = rfs.logits(v0, v1, ref_buffer) if rfs is not None else None
            tile = pol.logits(v0, v1, buffer)
            parts.append(stream.forward(tile, ref_tile, local, temp, request))
            held.append(inside)
            before.append(tgt >= v1)
            if ids is not None:
                here, cols = _tile_columns(ids, v0, v1)
                columns = torch.where(here, tile.gather(1, cols), columns)
        pieces = {name: torch.stack([getattr(p, name) for p in parts]) for name in statistics.NAMES
                  if statistics.present(request, name)}
        pieces = statistics.mark_pieces(pieces, torch.stack(held), torch.stack(before))
        if len(parts) == 1:
            return StreamStats(*(pieces[name][0] if name in pieces else getattr(parts[0], name)
                                 for name in statistics.NAMES)), columns
        return statistics.merge(pieces, request), columns

    def column_backward(policy, target, temperature, lse, c_p, ids, c_columns, want_x, want_weight, want_bias,
                        tile_elements):
        """``(d_x, d_weight, d_bias)`` of the logits gradient ``c_columns`` at ``ids`` ``- p * c_p`` (``[N]``, ``[N, K]``,
        already divided by ``T``; ids ``-1`` or outside this weight: none): the ``stream`` backward's ``p`` term on
        each tile, its ``K`` columns set to ``c_k - p_k c_p`` from the tile (rounded once), then the GEMMs."""

        def tile_grad(tile, ref_tile, local, inside, temp, padded, idx, m, v0):
            tile_lse, tile_c_p = lse[padded], c_p[padded]
            basis = statistics.Basis(torch.zeros_like(tile_c_p), tile_c_p)
            grad = stream.backward(tile, None, local, temp, tile_lse, None, basis)
            here, cols = _tile_columns(ids[padded], v0, v0 + tile.shape[1])
            here &= (local >= 0)[:, None] & torch.isfinite(tile_lse)[:, None]
            t = temp if temp.dim() == 0 else temp[:, None]
            p = torch.exp(tile.gather(1, cols).double() / t - tile_lse.double()[:, None])
            values = c_columns[padded].double() - p * tile_c_p.double()[:, None]
            rows = torch.arange(cols.shape[0], device=cols.device)[:, None].expand_as(cols)
            grad[rows[here], cols[here]] = values[here].to(grad.dtype)
            return grad

        return gradient_tiles(policy, None, target, temperature, (target >= 0) & torch.isfinite(lse),
                              plan(_vocab(policy), tile_elements), (want_x, want_weight, want_bias), tile_grad)

    def backward(policy, ref, target, temperature, lse, ref_lse, basis, want_x, want_weight, want_bias,
                 tile_elements):
        with_ref = basis.reads_ref()

        def tile_grad(tile, ref_tile, local, inside, temp, padded, idx, m, v0):
            tile_basis = type(basis)(*(None if c is None else c[padded] for c in basis))
            # The label term belongs to the tile (and shard) that holds the label.
            here = tile_basis._replace(label=torch.where(inside, tile_basis.label, 0))
            return stream.backward(tile, ref_tile, local, temp, lse[padded], ref_lse[padded] if with_ref else None,
                                   here)

        return gradient_tiles(policy, ref if with_ref else None, target, temperature, (target >= 0) & torch.isfinite(lse),
                              plan(_vocab(policy), tile_elements), (want_x, want_weight, want_bias), tile_grad)

    return forward, backward, column_forward, column_backward


def _tile_columns(ids, v0, v1):
    """``(here, cols)``: which of ``ids [R, K]`` lie in the vocab tile ``[v0, v1)`` and their columns in it (0
    elsewhere)."""
    here = (ids >= v0) & (ids < v1)
    return here, torch.where(here, ids - v0, torch.zeros_like(ids))


def whole_rows(vocab: int, tile_elements: int) -> int:
    """Rows of a working tile that holds whole rows (``loss_forward`` needs a row's statistics before
    its gradient): as many as the budget allows (up to ``MAX_ROWS``), a multiple of 16, at least 16
    (above the budget when ``16 * vocab`` is)."""
    return max(ROW_MULTIPLE, min(MAX_ROWS, tile_elements // vocab) // ROW_MULTIPLE * ROW_MULTIPLE)


def bind_loss(loss):
    """``loss_forward`` of the ``linear`` family on top of the ``loss`` module ``loss``."""

    def loss_forward(policy, ref, target, temperature, inputs, hyperparameters, loss_type, estimator, entropy_grad, want_x,
                     want_weight, want_bias, tile_elements, with_entropy=True):
        acc = accumulation_dtype(policy.x.dtype)
        stats = statistics.empty_stats(target.numel(), loss_request(ref is not None, estimator, with_entropy),
                                       lambda size: torch.zeros(size, dtype=acc, device=target.device))
        with_grad = want_x or want_weight or want_bias

        def tile_grad(tile, ref_tile, local, inside, temp, padded, idx, m, v0):
            tile_in = LossInputs(*(None if t is None else t[padded] for t in inputs))
            part, grad = loss.forward(tile, ref_tile, local, temp, tile_in, hyperparameters, loss_type, estimator, entropy_grad,
                                      with_grad, with_entropy)
            for dst, src in zip(stats, part):
                if dst.numel():
                    dst[idx] = src[:m]
            return grad if with_grad else None

        vocab = _vocab(policy)
        grads = gradient_tiles(policy, ref, target, temperature, target >= 0,
                               (whole_rows(vocab, tile_elements), vocab), (want_x, want_weight, want_bias), tile_grad)
        _nan_at_out_of_range(stats, target)
        return (stats, *grads)

    return loss_forward


def bind_divergence(divergence):
    """``(jsd_forward, jsd_backward, loss_forward)`` of the ``linear`` family on the ``divergence`` backend module
    ``divergence`` (its JSD pass and gradient, and its ``loss_forward`` on its own ``stream`` kernels)."""

    def jsd_forward(policy, ref, target, temperature, lse, ref_lse, beta, tile_elements):
        """``(jsd, kl_student)`` ``[N]``: the JSD pass on each vocab tile with the whole rows' log-sum-exps, the
        tiles' sums added in vocab order."""
        n, vocab = target.numel(), _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        out = [torch.zeros(n, dtype=acc, device=target.device) for _ in range(2)]
        tile_rows, vocab_tile = plan(vocab, tile_elements)
        buffer = torch.empty(tile_rows * vocab_tile, dtype=acc, device=target.device)
        ref_buffer = torch.empty_like(buffer)
        for idx, padded, m in _scored_tiles(target, target >= 0, tile_rows):
            tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
            pol, rfs = _TileSide(policy, padded, acc), _TileSide(ref, padded, acc)
            for v0 in range(0, vocab, vocab_tile):
                v1 = min(v0 + vocab_tile, vocab)
                local, _ = _local_target(tgt, v0, v1 - v0)
                parts = divergence.forward(pol.logits(v0, v1, buffer), rfs.logits(v0, v1, ref_buffer), local, temp,
                                           lse[padded], ref_lse[padded], beta)
                for dst, part in zip(out, parts):
                    dst[idx] += part[:m]
        for dst in out:
            dst.masked_fill_(target == OUT_OF_RANGE, float("nan"))
        return tuple(out)

    def jsd_backward(policy, ref, target, temperature, lse, ref_lse, beta, kl_student, coef, want_x, want_weight,
                     want_bias, tile_elements):
        """``(d_x, d_weight, d_bias)`` of the JSD gradient with per-row ``coef`` (``kltriton.kernels.divergence``)."""

        def tile_grad(tile, ref_tile, local, inside, temp, padded, idx, m, v0):
            return divergence.backward(tile, ref_tile, local, temp, lse[padded], ref_lse[padded], beta,
                                       kl_student[padded], coef[padded])

        ok = (target >= 0) & torch.isfinite(lse) & torch.isfinite(ref_lse)
        return gradient_tiles(policy, ref, target, temperature, ok, plan(_vocab(policy), tile_elements),
                              (want_x, want_weight, want_bias), tile_grad)

    def loss_forward(policy, ref, target, temperature, kind, beta, weight, entropy, want_x, want_weight, want_bias,
                     tile_elements):
        """``(StreamStats, divergence, d_x, d_weight, d_bias)``: ``divergence.loss_forward`` on tiles of whole rows
        (the statistics, the divergence and the loss's logits gradient of a tile), then the gradient's GEMMs: three
        GEMMs per tile and no second pass, as ``bind_loss``."""
        n = target.numel()
        acc = accumulation_dtype(policy.x.dtype)
        new = lambda size: torch.zeros(size, dtype=acc, device=target.device)  # noqa: E731
        stats = statistics.empty_stats(n, divergence_request(kind, entropy), new)
        values = new(n)
        with_grad = want_x or want_weight or want_bias

        def tile_grad(tile, ref_tile, local, inside, temp, padded, idx, m, v0):
            part, value, grad = divergence.loss_forward(tile, ref_tile, local, temp, kind, beta, weight[padded],
                                                        entropy, with_grad)
            for dst, src in zip((*stats, values), (*part, value)):
                if dst.numel():
                    dst[idx] = src[:m]
            return grad if with_grad else None

        vocab = _vocab(policy)
        grads = gradient_tiles(policy, ref, target, temperature, target >= 0, (whole_rows(vocab, tile_elements), vocab),
                               (want_x, want_weight, want_bias), tile_grad)
        _nan_at_out_of_range(stats, target)
        values.masked_fill_(target == OUT_OF_RANGE, float("nan"))
        return (stats, values, *grads)

    return jsd_forward, jsd_backward, loss_forward


def _column_chunks(side, ids, ok, tile_elements):
    """``(rows, ids, weight_rows)`` per chunk of the rows where ``ok``: the rows' ``[c, K]`` ids (padding ``-1`` read
    as 0) and, for a projection, their ``[c, K, H]`` weight rows in the accumulation dtype. A chunk's size depends
    on ``K`` and ``H`` only (batch invariance); one host sync (the count)."""
    acc = accumulation_dtype(side.x.dtype)
    k = ids.shape[-1]
    width = 1 if side.weight is None else side.weight.shape[1]
    step = max(1, tile_elements // max(k * width, 1))
    chosen = torch.nonzero(ok).squeeze(1)
    for start in range(0, chosen.shape[0], step):
        rows = chosen[start:start + step]
        cols = ids[rows].clamp(min=0)
        yield rows, cols, None if side.weight is None else _operand(side.weight.detach()[cols], acc)


def _entries(x, rows, cols):
    """The index of the entries ``[rows, cols]`` (``rows [c]`` flat row indices, ``cols [c, K]``) of ``x [..., V]``."""
    lead = x.shape[:-1]
    rows = rows[:, None].expand_as(cols)
    index = []
    for size in reversed(lead):
        index.append(rows % size)
        rows = rows // size
    return (*reversed(index), cols)


def _column_values(side, rows, cols, weight_rows):
    """``[c, K]`` logits of ``side`` at the columns ``cols`` of the rows ``rows`` (scale and softcap applied)."""
    acc = accumulation_dtype(side.x.dtype)
    if side.weight is None:
        return side.x.detach()[_entries(side.x, rows, cols)].to(acc)
    z = (weight_rows * _operand(_take(side.x.detach(), rows), acc)[:, None, :]).sum(-1)
    if side.bias is not None:
        z = z + side.bias.detach()[cols].to(acc)
    return scaled_and_capped(z, side.scale, side.softcap)


def column_logits(side, ids, ok, tile_elements):
    """``[N, K]`` logits of ``side`` (a ``Side``: dense logits or a projection) at ``ids [N, K]`` for the rows where
    ``ok`` (0 elsewhere; padding ids ``-1`` give ``-inf``), in the accumulation dtype: a ``K``-column gather, never a
    logits tile (``O(N K H)`` work for a projection, over the scored rows: one host read, their count). Dense
    logits: one gather over every row, no host read."""
    acc = accumulation_dtype(side.x.dtype)
    if side.weight is None:
        rows = torch.arange(ids.shape[0], device=ids.device)
        out = torch.where(ok[:, None], side.x.detach()[_entries(side.x, rows, ids.clamp(min=0))].to(acc), 0)
    else:
        out = torch.zeros(ids.shape, dtype=acc, device=ids.device)
        for rows, cols, weight_rows in _column_chunks(side, ids, ok, tile_elements):
            out[rows] = _column_values(side, rows, cols, weight_rows)
    return out.masked_fill_(ok[:, None] & (ids < 0), float("-inf"))


def set_columns(grad, ids, ok, values):
    """``grad[n, ids[n, k]] = values[n, k]`` for the rows where ``ok`` and the ids ``>= 0`` (``grad [..., V]``
    contiguous, in place; the ids of a row distinct, as ``TopK`` makes them): a dense logits gradient whose ``K``
    columns were computed elsewhere, rounded to its dtype once. One scatter over every entry, no host read: an entry
    that writes nothing writes again what its row's first written entry writes (or, in a row without one, column
    0's own value), so that every write to a column is the same."""
    write = ok[:, None] & (ids >= 0)
    flat = grad.view(-1, grad.shape[-1])
    src = values.to(grad.dtype)
    first = write.to(torch.int8).argmax(1, keepdim=True)
    any_write = write.any(1, keepdim=True)
    column = torch.where(any_write, ids.gather(1, first), 0)
    value = torch.where(any_write, src.gather(1, first), flat[:, :1])
    flat.scatter_(1, torch.where(write, ids, column), torch.where(write, src, value))


def _nan_at_out_of_range(stats, target):
    """NaN statistics (the log-sum-exps aside) at the rows scored on a label outside ``[0, V)``, in place."""
    bad = target == OUT_OF_RANGE
    for name in statistics.NAMES:
        dst = getattr(stats, name)
        if dst.numel() and not name.endswith("lse"):
            dst.masked_fill_(bad, float("nan"))


def gradient_tiles(policy, ref, target, temperature, ok, shape, needs_grad, tile_grad):
    """``(d_x, d_weight, d_bias)`` of the policy side from the logits gradient of each working tile.

    The rows where ``ok`` are projected in tiles of ``shape = (tile_rows, vocab_tile)`` (the reference's too, when
    ``ref`` is a ``Side``); ``tile_grad(tile, ref_tile, local, inside, temp, padded, idx, m, v0)`` returns the
    tile's fp32 logits gradient ``[tile_rows, width]`` (None: no gradient; it may record per-row outputs for the
    rows ``idx``, the first ``m`` of the token tile ``padded``), with ``local`` / ``inside`` the tile's targets and
    whether it holds the label (``_local_target``), ``v0`` its first vocab id. The gradient is chained through softcap and scale, then
    ``d_x = grad @ weight``, ``d_weight = grad.T @ x``, ``d_bias = grad.sum(0)`` accumulated in fp32, one gradient
    tile at a time. ``needs_grad``: ``(want_x, want_weight, want_bias)``; None where not request or absent (for a dense
    policy, ``d_x`` is the logits gradient)."""
    vocab = _vocab(policy)
    acc = accumulation_dtype(policy.x.dtype)
    device = target.device
    dense = policy.weight is None
    want_x, want_weight, want_bias = needs_grad
    want_weight = want_weight and not dense
    want_bias = want_bias and not dense and policy.bias is not None
    d_x = torch.zeros(policy.x.shape, dtype=policy.x.dtype, device=device) if want_x else None
    d_x_rows = d_x.view(-1, d_x.shape[-1]) if want_x else None
    d_weight = torch.zeros(policy.weight.shape, dtype=acc, device=device) if want_weight else None
    d_bias = torch.zeros(vocab, dtype=acc, device=device) if want_bias else None
    tile_rows, vocab_tile = shape
    buffer = torch.empty(tile_rows * vocab_tile, dtype=acc, device=device)
    ref_buffer = torch.empty_like(buffer) if ref is not None else None
    for idx, padded, m in _scored_tiles(target, ok, tile_rows):
        tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
        pol = _TileSide(policy, padded, acc)
        rfs = _TileSide(ref, padded, acc) if ref is not None else None
        d_tile = torch.zeros(tile_rows, d_x.shape[-1], dtype=acc, device=device) if want_x else None
        for v0 in range(0, vocab, vocab_tile):
            v1 = min(v0 + vocab_tile, vocab)
            tile = pol.logits(v0, v1, buffer)
            ref_tile = rfs.logits(v0, v1, ref_buffer) if rfs is not None else None
            local, inside = _local_target(tgt, v0, v1 - v0)
            grad = tile_grad(tile, ref_tile, local, inside, temp, padded, idx, m, v0)
            if grad is None:
                continue
            _chain(policy, tile, grad)
            if dense and want_x:
                d_tile[:, v0:v1] = grad
            if not dense and want_x:
                _add_mm(d_tile, grad, pol.weight(v0, v1))
            if want_weight:
                _add_mm(d_weight[v0:v1], grad.T, pol.x)
            if want_bias:
                d_bias[v0:v1] += grad.sum(0)
            del grad  # freed before the next tile's gradient is allocated: one gradient tile at a time
        if want_x:
            d_x_rows[idx] = d_tile[:m].to(d_x.dtype)
    cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
    return d_x, cast(d_weight, policy.weight), cast(d_bias, policy.bias)


def _chain(side, tile, grad):
    """The logits gradient -> the gradient of the projection: softcap then scale, in place (``tile``
    holds ``y = c * tanh(z / c)``, whose derivative is ``1 - (y / c)**2``)."""
    if side.softcap is not None:
        grad.mul_(tile.div_(side.softcap).square_().neg_().add_(1))
    if side.scale is not None:
        grad.mul_(side.scale)
