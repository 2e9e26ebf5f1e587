"""C++ backend of the ``loss`` family: ``torch.ops.kltriton_cpp.loss_forward`` / ``loss_scale_``.

One pass per row (``csrc/loss_forward.cpp``): the row's statistics, its loss derivative and gradient basis,
then its gradient while the row is still in cache. CPU tensors in float32 / bfloat16 / float16. The fused
row kernel takes one dtype: reference logits in another dtype run the two-pass composition of the C++
stream kernels (``composed.py``).
"""
import torch

from kltriton import estimators
from kltriton.kernels import constants, cpp_library
from kltriton.kernels.layout import cpp as layout
from kltriton.kernels.loss import LossTerms, composed, reference_logp
from kltriton.kernels.row_views import as_rows3d
from kltriton.kernels.statistics import StreamStats
from kltriton.kernels.stream import cpp as stream



def _f32(tensor):
    """``tensor`` as the kernels read it: flat contiguous float32 (as it is when it is that already)."""
    if tensor is None:
        return None
    if tensor.dtype != torch.float32 or tensor.dim() != 1 or not tensor.is_contiguous():
        tensor = tensor.reshape(-1).to(torch.float32).contiguous()
    return tensor.detach() if tensor.requires_grad else tensor


def _f64(tensor):
    """``tensor`` as contiguous float64 (the hyperparameters)."""
    return tensor if tensor.dtype == torch.float64 and tensor.is_contiguous() else tensor.to(torch.float64).contiguous()


def forward(logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator, entropy_grad, with_grad,
            with_entropy=True):
    if ref_logits is not None and ref_logits.dtype != logits.dtype:
        return composed.forward(stream, logits, ref_logits, target, temperature, inputs, hyperparameters, loss_type, estimator,
                                entropy_grad, with_grad, with_entropy)
    cpp_library.load()
    est = estimators.parse(estimator) if estimator else None
    outs = torch.ops.kltriton_cpp.loss_forward(
        stream.rows3d(logits), stream.rows3d(ref_logits), target,
        temperature, _f32(inputs.old_logp), _f32(inputs.advantages), _f32(inputs.w_pg), _f32(inputs.w_kl),
        _f32(inputs.w_ent), _f32(inputs.ref_logp), _f64(hyperparameters), loss_type,
        est.base if est else "", bool(est and est.straight_through), bool(entropy_grad), bool(with_grad),
        bool(with_entropy))
    return StreamStats(*outs[:-1]), outs[-1]


def forward_labels(logits, ref_logits, labels2d, mask2d, cu_seqlens, checked_temperature, ignore_index, shift, flags,
                   weights, temperature, old_logp, ref_logp, hyperparameters, loss_type, estimator, entropy_grad,
                   with_grad, with_entropy):
    """One op (``loss_forward_labels``); reference logits in another dtype take the composition of the three."""
    if ref_logits is not None and ref_logits.dtype != logits.dtype:
        return composed.forward_labels(layout.target_weights, forward, terms, logits, ref_logits, labels2d, mask2d,
                                       cu_seqlens, checked_temperature, ignore_index, shift, flags, weights,
                                       temperature, old_logp, ref_logp, hyperparameters, loss_type, estimator,
                                       entropy_grad, with_grad, with_entropy)
    layout.check_weights_dtype(weights)
    cpp_library.load()
    est = estimators.parse(estimator) if estimator else None
    target, *outs = torch.ops.kltriton_cpp.loss_forward_labels(
        stream.rows3d(logits), stream.rows3d(ref_logits), labels2d, mask2d, cu_seqlens, checked_temperature,
        ignore_index, shift, flags, constants.AGGREGATIONS.index(weights.aggregation), weights.num_tokens,
        weights.num_seqs_agg, weights.horizon, weights.advantages, weights.per_sequence, weights.kl_coef,
        weights.entropy_coef, temperature, old_logp, ref_logp, _f64(hyperparameters), loss_type,
        est.base if est else "", bool(est and est.straight_through), bool(entropy_grad), bool(with_grad),
        bool(with_entropy))
    stats_end = len(StreamStats._fields)
    return target, StreamStats(*outs[:stats_end]), outs[stats_end], LossTerms(*outs[stats_end + 1:])


def terms(stats, target, inputs, hyperparameters, loss_type, estimator) -> LossTerms:
    cpp_library.load()
    est = estimators.parse(estimator) if estimator else None
    n = target.numel()
    present = lambda t: t if t.numel() == n and n else None  # noqa: E731
    ref = reference_logp(stats, inputs)
    return LossTerms(*torch.ops.kltriton_cpp.loss_terms(
        stats.logp, ref, stats.ref_logp.shape != stats.logp.shape, present(stats.full_kl), present(stats.entropy),
        target, inputs.old_logp, inputs.advantages, inputs.w_pg, inputs.w_kl, inputs.w_ent,
        inputs.w_pg if inputs.w_agg is None else inputs.w_agg, _f64(hyperparameters), loss_type,
        est.base if est else "", bool(est and est.straight_through)))


def coefficients(logp, ref_logp, inputs, hyperparameters, loss_type, estimator, full_kl=None):
    """``d loss / d logp`` per row from the C++ ``row_g_logp`` (for the parity test of the three
    implementations, ``tests/kernels/test_loss_coefficients.py``)."""
    cpp_library.load()
    est = estimators.parse(estimator) if estimator else None
    return torch.ops.kltriton_cpp.loss_coefficients(
        _f32(logp), _f32(ref_logp), _f32(inputs.old_logp), _f32(inputs.advantages), _f32(inputs.w_pg),
        _f32(inputs.w_kl), _f32(full_kl), _f64(hyperparameters), loss_type, est.base if est else "",
        bool(est and est.straight_through))


def accumulate_(grad, logits, target, temperature, lse, basis):
    cpp_library.load()
    torch.ops.kltriton_cpp.loss_accumulate_(grad, as_rows3d(logits.detach()), target, temperature, _f32(lse),
                                            _f32(basis.label), _f32(basis.p), _f32(basis.p_logp))


def scale_(grad, upstream):
    cpp_library.load()
    torch.ops.kltriton_cpp.loss_scale_(grad, upstream)
