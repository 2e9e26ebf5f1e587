"""The ``linear`` family's algorithm, shared by every backend: GEMM tiles of scored rows folded by a
``stream`` kernel (see ``kltriton.kernels.linear`` for the contract).

Rows are projected in tiles of a fixed shape ``[tile_rows, vocab_tile]`` (the last token tile is padded
with ``SKIP`` rows), so a row's logits come from a GEMM of the same shape whatever ``N``, its place
or the number of scored rows (batch invariance: BLAS libraries pick other kernels for other shapes).
"""
import torch

from kltriton._env import env_int

from kltriton.kernels import SKIP, OUT_OF_RANGE, accumulation_dtype, statistics
from kltriton.kernels.loss import LossInputs, wanted as loss_wanted
from kltriton.kernels.rows import as_rows3d
from kltriton.kernels.statistics import NOT_HERE, StreamStats

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
    """``(forward, backward)`` of the ``linear`` family on top of the ``stream`` module ``stream``."""

    def forward(policy, ref, target, temperature, wanted, tile_elements) -> StreamStats:
        n, vocab = target.numel(), _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        out = statistics.empty_stats(n, wanted, lambda size: torch.zeros(size, dtype=acc, device=target.device))
        tile_rows, vocab_tile = plan(vocab, tile_elements)
        buffer = torch.empty(tile_rows * vocab_tile, dtype=acc, device=target.device)
        ref_buffer = torch.empty_like(buffer) if ref is not None else None
        for idx, padded, m in _scored_tiles(target, target >= 0, tile_rows):
            tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
            pol = _TileSide(policy, padded, acc)
            rfs = _TileSide(ref, padded, acc) if ref is not None else None
            stats = _vocab_tiled_forward(pol, rfs, tgt, temp, wanted, vocab, vocab_tile, buffer, ref_buffer)
            for dst, src in zip(out, stats):
                if dst.numel():
                    dst[idx] = src[:m]
        bad = target == OUT_OF_RANGE
        for name in ("logp", "entropy", "ref_logp", "full_kl"):
            dst = getattr(out, name)
            if dst.numel():
                dst.masked_fill_(bad, float("nan"))
        return out

    def _vocab_tiled_forward(pol, rfs, tgt, temp, wanted, vocab, vocab_tile, buffer, ref_buffer):
        """Each vocab tile as its own row piece through the stream kernel, merged by ``statistics.merge``.
        A label outside every tile (``tgt >= vocab``) gives ``NOT_HERE`` log-probs."""
        parts, held = [], []
        for v0 in range(0, vocab, vocab_tile):
            v1 = min(v0 + vocab_tile, vocab)
            local, inside = _local_target(tgt, v0, v1 - v0)
            ref_tile = rfs.logits(v0, v1, ref_buffer) if rfs is not None else None
            parts.append(stream.forward(pol.logits(v0, v1, buffer), ref_tile, local, temp, wanted))
            held.append(inside)
        inside = torch.stack(held)
        pieces = {name: torch.stack([getattr(p, name) for p in parts]) for name in statistics.NAMES
                  if statistics.present(wanted, name)}
        for name in ("logp", "ref_logp"):
            if name in pieces:
                pieces[name] = torch.where(inside, pieces[name], NOT_HERE)
        if len(parts) == 1:
            return StreamStats(*(pieces[name][0] if name in pieces else getattr(parts[0], name)
                                 for name in statistics.NAMES))
        return statistics.merge(pieces, wanted)

    def backward(policy, ref, target, temperature, lse, ref_lse, basis, want_x, want_weight, want_bias,
                 tile_elements):
        vocab = _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        dense = policy.weight is None
        d_x = torch.zeros(policy.x.shape, dtype=policy.x.dtype, device=policy.x.device) if want_x else None
        d_x_rows = d_x.view(-1, d_x.shape[-1]) if want_x else None
        want_weight = want_weight and not dense
        want_bias = want_bias and not dense and policy.bias is not None
        d_weight = torch.zeros(policy.weight.shape, dtype=acc, device=lse.device) if want_weight else None
        d_bias = torch.zeros(vocab, dtype=acc, device=lse.device) if want_bias else None
        with_logq = basis.p_logq is not None
        tile_rows, vocab_tile = plan(vocab, tile_elements)
        buffer = torch.empty(tile_rows * vocab_tile, dtype=acc, device=lse.device)
        ref_buffer = torch.empty_like(buffer) if with_logq else None
        ok = (target >= 0) & torch.isfinite(lse)
        for idx, padded, m in _scored_tiles(target, ok, tile_rows):
            tgt, temp = _tile_target(target, padded, m), _temp(temperature, padded)
            pol = _TileSide(policy, padded, acc)
            rfs = _TileSide(ref, padded, acc) if with_logq else None
            tile_basis = type(basis)(*(None if c is None else c[padded] for c in basis))
            tile_lse = lse[padded]
            tile_ref_lse = ref_lse[padded] if with_logq else None
            d_tile = torch.zeros(tile_rows, d_x.shape[-1], dtype=acc, device=lse.device) if want_x else None
            for v0 in range(0, vocab, vocab_tile):
                v1 = min(v0 + vocab_tile, vocab)
                tile = pol.logits(v0, v1, buffer)
                ref_tile = rfs.logits(v0, v1, ref_buffer) if with_logq else None
                local, inside = _local_target(tgt, v0, v1 - v0)
                # The label term belongs to the tile (and shard) that holds the label.
                here = tile_basis._replace(label=torch.where(inside, tile_basis.label, 0))
                grad = stream.backward(tile, ref_tile, local, temp, tile_lse, tile_ref_lse, here)
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

    return forward, backward


def whole_rows(vocab: int, tile_elements: int) -> int:
    """Rows of a working tile that holds whole rows (``loss_forward`` needs a row's statistics before
    its gradient): as many as the budget allows (up to ``MAX_ROWS``), a multiple of 16, at least 16
    (above the budget when ``16 * vocab`` is)."""
    return max(ROW_MULTIPLE, min(MAX_ROWS, tile_elements // vocab) // ROW_MULTIPLE * ROW_MULTIPLE)


def bind_loss(loss):
    """``loss_forward`` of the ``linear`` family on top of the ``loss`` module ``loss``."""

    def loss_forward(policy, ref, target, temperature, inputs, hp, loss_type, estimator, entropy_grad, want_x,
                     want_weight, want_bias, tile_elements, with_entropy=True):
        n, vocab = target.numel(), _vocab(policy)
        acc = accumulation_dtype(policy.x.dtype)
        device = target.device
        has_ref = ref is not None
        stats = statistics.empty_stats(n, loss_wanted(has_ref, estimator, with_entropy),
                                       lambda size: torch.zeros(size, dtype=acc, device=device))
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
            pol = _TileSide(policy, padded, acc)
            tile = pol.logits(0, vocab, buffer)
            ref_tile = _TileSide(ref, padded, acc).logits(0, vocab, ref_buffer) if has_ref else None
            tile_in = LossInputs(*(None if t is None else t[padded] for t in inputs))
            part, grad = loss.forward(tile, ref_tile, tgt, temp, tile_in, hp, loss_type, estimator, entropy_grad,
                                      with_grad, with_entropy)
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
            del grad  # freed before the next tile's gradient is allocated: one gradient tile at a time
        bad = target == OUT_OF_RANGE
        for name in ("logp", "entropy", "ref_logp", "full_kl"):
            dst = getattr(stats, name)
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
