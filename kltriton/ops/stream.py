"""The ``stream`` family as differentiable custom ops: ``kltriton::stream_forward`` / ``stream_backward``.

The public ops (``token_logprobs``, ``token_kl``, ``fused_kl_reward``) are plain PyTorch around
``stream()``: label layout in, one kernel call, ``[N]`` arithmetic (estimators, reward shaping)
out, so autograd derives their gradients down to the kernel's statistics and the kernel's own
backward (``stream_backward``, a custom op of its own so ``torch.compile`` traces it) takes them
to the logits. Kernel: ``kltriton.dispatch.implementation("stream", backend)``.
"""
from typing import Optional, Tuple

import torch

from kltriton import dispatch
from kltriton.kernels import accumulation_dtype
from kltriton.kernels.stream import StreamStats
from kltriton.ops._define import define_op


def _forward(
    logits: torch.Tensor,                # [..., V]
    ref_logits: Optional[torch.Tensor],  # [..., V] or None
    target: torch.Tensor,                # [N] int64 (kltriton.kernels.constants)
    temperature: torch.Tensor,           # 0-dim float64
    with_entropy: bool,
    with_full_kl: bool,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(dispatch.implementation("stream", backend).forward(
        logits, ref_logits, target, temperature, with_entropy, with_full_kl))


def _forward_fake(logits, ref_logits, target, temperature, with_entropy, with_full_kl, backend):
    n = target.shape[0]
    new = lambda wanted: logits.new_empty(n if wanted else 0, dtype=accumulation_dtype(logits.dtype))  # noqa: E731
    has_ref = ref_logits is not None
    return new(True), new(True), new(with_entropy), new(has_ref), new(has_ref), new(with_full_kl)


def _backward_kernel(
    logits: torch.Tensor,                # [..., V]
    ref_logits: Optional[torch.Tensor],  # [..., V], read only for the full-KL term
    target: torch.Tensor,                # [N] int64
    temperature: torch.Tensor,           # 0-dim float64
    lse: torch.Tensor,                   # [N]
    ref_lse: Optional[torch.Tensor],     # [N]
    g_logp: torch.Tensor,                # [N]
    g_entropy: Optional[torch.Tensor],   # [N]
    entropy: Optional[torch.Tensor],     # [N]
    g_full_kl: Optional[torch.Tensor],   # [N]
    full_kl: Optional[torch.Tensor],     # [N]
    backend: str,
) -> torch.Tensor:
    as_stats = lambda g: None if g is None else g.to(lse.dtype).contiguous()  # noqa: E731
    return dispatch.implementation("stream", backend).backward(
        logits, ref_logits, target, temperature, lse, ref_lse,
        as_stats(g_logp), as_stats(g_entropy), entropy, as_stats(g_full_kl), full_kl)


stream_backward = define_op(
    "stream_backward", _backward_kernel, outputs=("grad",),
    fake=lambda logits, *rest: logits.new_empty(logits.shape))


def _backward(saved, grads):
    g_logp = grads["logp"] if grads["logp"] is not None else torch.zeros_like(saved.lse)
    g_entropy = grads["entropy"] if saved.with_entropy and grads["entropy"] is not None else None
    g_full_kl = grads["full_kl"] if saved.with_full_kl and grads["full_kl"] is not None else None
    full = g_full_kl is not None
    grad = stream_backward(
        saved.logits, saved.ref_logits if full else None, saved.target, saved.temperature, saved.lse,
        saved.ref_lse if full else None, g_logp, g_entropy, saved.entropy if g_entropy is not None else None,
        g_full_kl, saved.full_kl if full else None, saved.backend)
    return {"logits": grad}


stream_forward = define_op(
    "stream_forward", _forward, outputs=StreamStats._fields, fake=_forward_fake,
    save=("logits", "ref_logits", "target", "temperature", "with_entropy", "with_full_kl", "backend",
          "lse", "ref_lse", "entropy", "full_kl"),
    backward=_backward)


def stream_backend(backend, logits: torch.Tensor) -> str:
    """The backend that runs the ``stream`` family on ``logits`` (``backend=None``: by device)."""
    return dispatch.resolve(backend, "stream", logits.device.type, logits.dtype == torch.float64)


def stream(logits, ref_logits, target, temperature, *, with_entropy=False, with_full_kl=False,
           backend, shard=None) -> StreamStats:
    """Per-row statistics of ``logits`` (and ``ref_logits``) at ``target``, differentiable w.r.t.
    ``logits``; see ``kltriton.kernels.stream`` for shapes. ``ref_logits`` gets no gradient.
    With a ``shard`` (``kltriton.ops.vocab_parallel.VocabShard``) the logits are this rank's vocab
    shard, ``target`` holds global ids, and the statistics are those of the full rows."""
    ref_logits = None if ref_logits is None else ref_logits.detach()
    if shard is not None:
        from kltriton.ops.vocab_parallel import shard_stream  # it builds on this module's ops
        return shard_stream(logits, ref_logits, target, temperature, with_entropy=with_entropy,
                            with_full_kl=with_full_kl, backend=backend, shard=shard)
    return StreamStats(*stream_forward(logits, ref_logits, target, temperature, with_entropy, with_full_kl, backend))
