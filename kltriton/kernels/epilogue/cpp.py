"""C++ backend of the ``epilogue`` family: ``torch.ops.kltriton_cpp.kl_reward`` / ``kl_reward_backward``
(``csrc/epilogue.cpp``)."""
import torch

from kltriton import estimators
from kltriton.kernels import cpp_library
from kltriton.kernels.epilogue import KlReward


def _estimator(name):
    est = estimators.parse(name)
    return est.base, est.straight_through


def kl_reward(values, ref_logp, ref_given, target, rows, estimator, kl_clamp, shaping, score_clip) -> KlReward:
    cpp_library.load()
    base, straight = _estimator(estimator)
    coef, rewards, scores = shaping if shaping is not None else (None, None, None)
    return KlReward(*torch.ops.kltriton_cpp.kl_reward(
        values.logp, values.full_kl, ref_logp, ref_given, target, rows.num_seqs, rows.seq_len, rows.cu_seqlens, base,
        straight, kl_clamp, coef, rewards, scores, score_clip))


def kl_reward_backward(values, ref_logp, ref_given, target, rows, estimator, kl_clamp, coef, count, g_kl, g_reward,
                       g_kl_per_seq):
    cpp_library.load()
    base, straight = _estimator(estimator)
    return tuple(torch.ops.kltriton_cpp.kl_reward_backward(
        values.logp, values.full_kl, ref_logp, ref_given, target, rows.num_seqs, rows.seq_len, rows.cu_seqlens, base,
        straight, kl_clamp, coef, count, g_kl, g_reward, g_kl_per_seq))
