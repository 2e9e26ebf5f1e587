"""Kernel families and their backends.

A *family* is a contract: the functions a backend implements for one kind of kernel, with shapes and
semantics, written in ``kltriton/kernels/<family>/__init__.py``. Each backend implements it in
``kltriton/kernels/<family>/<backend>.py`` (``reference``, ``triton``, ``cpp``); a backend without that file
does not run the family. ``kltriton.dispatch`` resolves ``(family, backend)`` to that module (the ``linear``
family it composes from the backend's ``stream``, ``loss`` and ``divergence`` modules); the custom ops in
``kltriton/ops/`` are the only callers.

Every family takes the per-row ``target`` of ``kltriton.kernels.constants`` (a label, ``SKIP`` or
``OUT_OF_RANGE``), built from labels / masks / packed layouts by ``kltriton._inputs``.

Families:

| family     | what it computes |
|------------|------------------|
| ``stream`` | per-row softmax statistics streamed over ``[..., V]`` logits (log-prob, entropy, reference log-prob, exact KL) and their gradient |
| ``linear`` | the ``stream`` statistics of logits given as ``hidden @ weight.T`` (``LinearLogits``), from GEMM tiles |
| ``loss``   | a policy loss whose logits gradient is written in the forward (statistics, per-row coefficients, gradient) |
| ``invariant`` | the ``stream`` family's log-prob, log-sum-exp and entropy from row maxima and int64 fixed-point sums, independent of how the vocabulary is cut (``kltriton.set_invariant``) |
| ``divergence`` | the generalized JSD's second pass over a student and a teacher row (after both log-sum-exps) and its gradient; a divergence loss with its gradient in the forward |
| ``truncation`` | the kept set of each row (top-k / top-p / min-p recomputed from the row, or the engine's ids replayed) and the statistics of the row restricted to it, and their gradient |

Shared by the families: ``constants.py`` (the one table of values shared with the C++ and Triton code),
``statistics.py`` (the per-row statistics, declared once: bundle, merge, gradient basis), ``triton_rows.py``
(the Triton row helpers), ``row_views.py`` (row addressing), ``cpp_library.py`` (building / loading ``csrc/``).
"""
import torch

from kltriton.kernels.constants import OUT_OF_RANGE, SKIP

__all__ = ["OUT_OF_RANGE", "SKIP", "accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the per-row statistics for logits of ``dtype``: float32, or float64 for float64
    logits (the reference backend's oracle mode)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
