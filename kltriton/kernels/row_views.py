"""Row addressing shared by every backend: ``[..., V]`` logits as ``[A, B, V]`` without a copy."""
import torch


def as_rows3d(logits: torch.Tensor) -> torch.Tensor:
    """View ``logits [..., V]`` as ``[A, B, V]`` with row ``n = a * B + b`` (row-major order).

    Leading dims are merged where their strides allow; a slice such as ``logits[:, :-1]``
    stays a view (``A = batch``, ``B = time``). Only a layout needing three or more
    unmergeable leading dims is copied. The vocab dim is made contiguous if it is not.
    """
    if logits.dim() == 3 and logits.stride(-1) == 1:  # [A, B, V] already, whatever the strides of A and B
        return logits
    vocab = logits.shape[-1]
    if logits.is_contiguous():
        return logits.view(1, -1, vocab) if logits.numel() else logits.reshape(1, num_rows(logits), vocab)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dims = [(size, stride) for size, stride in zip(logits.shape[:-1], logits.stride()[:-1]) if size != 1]
    merged = []
    for size, stride in dims:
        if merged and merged[-1][1] == stride * size:
            outer_size, _ = merged[-1]
            merged[-1] = (outer_size * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 2:
        logits = logits.contiguous()
        merged = [(logits.numel() // max(vocab, 1), vocab)]
    while len(merged) < 2:
        merged.insert(0, (1, 0))
    (a, sa), (b, sb) = merged
    return logits.as_strided((a, b, vocab), (sa, sb, 1))


def num_rows(logits: torch.Tensor) -> int:
    n = 1
    for size in logits.shape[:-1]:
        n *= size
    return n
