"""The ``linear`` family's algorithm, shared by every backend: GEMM tiles of scored rows folded by a
``stream`` kernel (see ``kltriton.kernels.linear`` for the contract).

Rows are projected in tiles of a fixed shape ``[rows, vocab_tile]`` (the last token tile is padded
with ``SKIP`` rows), so a row's logits come from a GEMM of the same shape whatever ``N``, its place
or the number of scored rows (batch invariance: BLAS libraries pick other kernels for other shapes).
"""
import os

import torch

from kltriton.kernels import SKIP, OUT_OF_RANGE, accumulation_dtype
from kltriton.kernels.loss import LossRows, LossStats, terms
from kltriton.kernels.merge import NOT_HERE, merge_shards
from kltriton.kernels.rows import as_rows3d
from kltriton.kernels.stream import StreamStats

# Elements of one logits tile: 32 MiB of fp32 on CPU (a tile and its gradient stay well under eager's
# [N, V]), 128 MiB on CUDA (large enough GEMMs for the tensor cores).
DEFAULT_TILE = {"cuda": 1 << 25}
DEFAULT_TILE_CPU = 1 << 23
MIN_ROWS, MAX_ROWS, ROW_MULTIPLE = 64, 1024, 16


def default_tile_elements(device_type: str) -> int:
    env = os.environ.get("KLTRITON_LINEAR_TILE")
    return int(env) if env else DEFAULT_TILE.get(device_type, DEFAULT_TILE_CPU)


def plan(vocab: int, tile_elements: int):
    """``(rows, vocab_tile)`` of the working tile: as many rows as the budget allows for whole
    rows (``MIN_ROWS``..``MAX_ROWS``, a multiple of 16), the vocab split when a row does not fit."""
    rows = min(MAX_ROWS, max(MIN_ROWS, tile_elements // vocab)) // ROW_MULTIPLE * ROW_MULTIPLE
    return rows, min(vocab, max(1, tile_elements // rows))


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


class _Rows:
    """One token tile of a side: the gathered rows and the GEMM operands they need."""

    def __init__(self, side, idx, acc):
        self.side, self.acc = side, acc
        self.x = _take(side.x.detach(), idx)
        if side.weight is not None:
            self.x = _operand(self.x, acc)

    def weight(self, v0, v1):
        return _operand(self.side.weight.detach()[v0:v1], self.acc)

    def logits(self, v0, v1, buffer):
        """The ``[rows, v1 - v0]`` logits tile, in ``buffer``'s storage."""
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


def _scored_tiles(target, ok, rows):
    """``(idx, padded_idx, m)`` per token tile of the rows where ``ok``; one host sync (the count)."""
    scored = torch.nonzero(ok).squeeze(1)
    for start in range(0, scored.numel(), rows):
        idx = scored[start:start + rows]
        m = idx.numel()
        yield idx, torch.cat([idx, idx[:1].expand(rows - m)]), m


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
    """``(forward, backward)`` of the ``linear`` family on top of the ``stream`` module ``stream``."""

    def forward(policy, ref, target, temperature, with_entropy, with_full_kl, tile_elements) -> StreamStats:
        n, vocab = target.numel(), _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        new = lambda wanted: torch.zeros(n if wanted else 0, dtype=acc, device=target.device)  # noqa: E731
        has_ref = ref is not None
        out = StreamStats(new(True), new(True), new(with_entropy), new(has_ref), new(has_ref), new(with_full_kl))
        rows, vocab_tile = plan(vocab, tile_elements)
        buffer = torch.empty(rows * vocab_tile, dtype=acc, device=target.device)
        ref_buffer = torch.empty_like(buffer) if has_ref else None
        for idx, padded, m in _scored_tiles(target, target >= 0, rows):
            tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
            pol = _Rows(policy, padded, acc)
            rfs = _Rows(ref, padded, acc) if has_ref else None
            stats = _vocab_tiled_forward(pol, rfs, tgt, temp, with_entropy, with_full_kl, vocab, vocab_tile,
                                         buffer, ref_buffer)
            for dst, src in zip(out, stats):
                if dst.numel():
                    dst[idx] = src[:m]
        bad = target == OUT_OF_RANGE
        for dst in (out.logp, out.entropy, out.ref_logp, out.full_kl):
            if dst.numel():
                dst.masked_fill_(bad, float("nan"))
        return out

    def _vocab_tiled_forward(pol, rfs, tgt, temp, with_entropy, with_full_kl, vocab, vocab_tile, buffer, ref_buffer):
        """Each vocab tile as its own row piece through the stream kernel, merged by ``merge_shards``
        (one tile: the kernel's statistics as they are). A label outside every tile (``tgt >= vocab``)
        gives ``NOT_HERE`` log-probs."""
        parts, held = [], []
        for v0 in range(0, vocab, vocab_tile):
            v1 = min(v0 + vocab_tile, vocab)
            local, inside = _local_target(tgt, v0, v1 - v0)
            ref_tile = rfs.logits(v0, v1, ref_buffer) if rfs is not None else None
            parts.append(stream.forward(pol.logits(v0, v1, buffer), ref_tile, local, temp, with_entropy, with_full_kl))
            held.append(inside)
        inside = torch.stack(held)

        def held_here(logp):
            return torch.where(inside, logp, NOT_HERE)

        if len(parts) == 1:
            only = parts[0]
            return only._replace(logp=held_here(only.logp[None])[0],
                                 ref_logp=held_here(only.ref_logp[None])[0] if rfs is not None else only.ref_logp)

        def stacked(name):
            return torch.stack([getattr(p, name) for p in parts]) if getattr(parts[0], name).numel() else None

        return merge_shards(stacked("lse"), held_here(stacked("logp")), stacked("entropy"), stacked("ref_lse"),
                            held_here(stacked("ref_logp")) if rfs is not None else None, stacked("full_kl"))

    def backward(policy, ref, target, temperature, lse, ref_lse, g_logp, g_entropy, entropy, g_full_kl, full_kl,
                 want_x, want_weight, want_bias, tile_elements):
        vocab = _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        dense = policy.weight is None
        d_x = torch.zeros(policy.x.shape, dtype=policy.x.dtype, device=policy.x.device) if want_x else None
        d_x_rows = d_x.view(-1, d_x.shape[-1]) if want_x else None
        want_weight = want_weight and not dense
        want_bias = want_bias and not dense and policy.bias is not None
        d_weight = torch.zeros(policy.weight.shape, dtype=acc, device=lse.device) if want_weight else None
        d_bias = torch.zeros(vocab, dtype=acc, device=lse.device) if want_bias else None
        full = g_full_kl is not None
        rows, vocab_tile = plan(vocab, tile_elements)
        buffer = torch.empty(rows * vocab_tile, dtype=acc, device=lse.device)
        ref_buffer = torch.empty_like(buffer) if full else None
        pick = lambda t, padded: None if t is None else t[padded]  # noqa: E731
        ok = (target >= 0) & torch.isfinite(lse)
        for idx, padded, m in _scored_tiles(target, ok, rows):
            tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
            pol = _Rows(policy, padded, acc)
            rfs = _Rows(ref, padded, acc) if full else None
            stats = [pick(t, padded) for t in (lse, ref_lse if full else None, g_logp, g_entropy, entropy,
                                               g_full_kl, full_kl)]
            d_rows = None
            if want_x:
                d_rows = torch.zeros(rows, d_x.shape[-1], dtype=acc, device=lse.device)
            for v0 in range(0, vocab, vocab_tile):
                v1 = min(v0 + vocab_tile, vocab)
                tile = pol.logits(v0, v1, buffer)
                ref_tile = rfs.logits(v0, v1, ref_buffer) if full else None
                local, inside = _local_target(tgt, v0, v1 - v0)
                grad = stream.backward(tile, ref_tile, local, temp, *stats)
                # The kernel added the label term g_logp / T at column 0 of rows whose label is in
                # another vocab tile or shard (it needs a label): take it back out.
                wrong = (local >= 0) & ~inside
                extra = torch.where(wrong, stats[2] / temp, 0).to(acc)
                grad.scatter_add_(1, local.clamp(min=0)[:, None], -extra[:, None])
                _chain(policy, tile, grad)
                if dense:
                    if want_x:
                        d_rows[:, v0:v1] = grad
                    continue
                if want_x:
                    _add_mm(d_rows, grad, pol.weight(v0, v1))
                if want_weight:
                    _add_mm(d_weight[v0:v1], grad.T, pol.x)
                if want_bias:
                    d_bias[v0:v1] += grad.sum(0)
            if want_x:
                d_x_rows[idx] = d_rows[:m].to(d_x.dtype)
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        return d_x, cast(d_weight, policy.weight), cast(d_bias, policy.bias)

    return forward, backward


def whole_rows(vocab: int, tile_elements: int) -> int:
    """Rows of a working tile that holds whole rows (``loss_forward`` needs a row's statistics before
    its gradient): as many as the budget allows (up to ``MAX_ROWS``), a multiple of 16, at least 16
    (above the budget when ``16 * vocab`` is)."""
    return max(ROW_MULTIPLE, min(MAX_ROWS, tile_elements // vocab) // ROW_MULTIPLE * ROW_MULTIPLE)


def bind_loss(loss):
    """``loss_forward`` of the ``linear`` family on top of the ``loss`` module ``loss``."""

    def loss_forward(policy, ref, target, temperature, rows, bounds, loss_type, estimator, entropy_grad, want_x,
                     want_weight, want_bias, tile_elements):
        n, vocab = target.numel(), _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        device = target.device
        has_ref, full = ref is not None, terms.split_estimator(estimator)[0] == "full"
        new = lambda wanted: torch.zeros(n if wanted else 0, dtype=acc, device=device)  # noqa: E731
        stats = LossStats(new(True), new(True), new(has_ref), new(full))
        d_x = torch.zeros(policy.x.shape, dtype=policy.x.dtype, device=device) if want_x else None
        d_x_rows = d_x.view(-1, d_x.shape[-1]) if want_x else None
        d_weight = torch.zeros(policy.weight.shape, dtype=acc, device=device) if want_weight else None
        want_bias = want_bias and policy.bias is not None
        d_bias = torch.zeros(vocab, dtype=acc, device=device) if want_bias else None
        with_grad = want_x or want_weight or want_bias
        tile_rows = whole_rows(vocab, tile_elements)
        buffer = torch.empty(tile_rows * vocab, dtype=acc, device=device)
        ref_buffer = torch.empty_like(buffer) if has_ref else None
        for idx, padded, m in _scored_tiles(target, target >= 0, tile_rows):
            tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
            pol = _Rows(policy, padded, acc)
            tile = pol.logits(0, vocab, buffer)
            ref_tile = _Rows(ref, padded, acc).logits(0, vocab, ref_buffer) if has_ref else None
            tile_in = LossRows(*(None if t is None else t[padded] for t in rows))
            part, grad = loss.forward(tile, ref_tile, tgt, temp, tile_in, bounds, loss_type, estimator, entropy_grad,
                                      with_grad)
            for dst, src in zip(stats, part):
                if dst.numel():
                    dst[idx] = src[:m]
            if not with_grad:
                continue
            _chain(policy, tile, grad)
            if want_x:
                d_x_rows[idx] = _mm(grad, pol.weight(0, vocab), acc)[:m].to(d_x.dtype)
            if want_weight:
                _add_mm(d_weight, grad.T, pol.x)
            if want_bias:
                d_bias += grad.sum(0)
        bad = target == OUT_OF_RANGE
        for dst in (stats.logp, stats.entropy, stats.ref_logp, stats.full_kl):
            if dst.numel():
                dst.masked_fill_(bad, float("nan"))
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        return stats, d_x, cast(d_weight, policy.weight), cast(d_bias, policy.bias)

    return loss_forward


def _chain(side, tile, grad):
    """The logits gradient -> the gradient of the projection: softcap then scale, in place (``tile``
    holds ``y = c * tanh(z / c)``, whose derivative is ``1 - (y / c)**2``)."""
    if side.softcap is not None:
        grad.mul_(tile.div_(side.softcap).square_().neg_().add_(1))
    if side.scale is not None:
        grad.mul_(side.scale)
