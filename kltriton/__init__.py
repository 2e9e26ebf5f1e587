"""kltriton: fused log-probs, KL penalties and KL-shaped rewards straight from the logits.

Importing the package imports neither Triton nor the C++ kernels and never touches CUDA;
backends load on first use.
"""
from kltriton import controllers, dispatch
from kltriton._inputs import set_validation
from kltriton.dropins import (entropy_from_logits, logprobs_of_labels, selective_log_softmax,
                              selective_log_softmax_and_entropy)
from kltriton.functional.fused_kl_reward import KLReward, fused_kl_reward
from kltriton.functional.policy_loss import PolicyLossOutput, policy_loss
from kltriton.functional.token_divergence import token_divergence
from kltriton.functional.token_kl import KLOutput, token_kl
from kltriton.functional.token_logprobs import TokenOutputs, token_logprobs
from kltriton.heads import lm_head_logits, score_with_lm_head
from kltriton.invariant import set_invariant
from kltriton.linear_logits import LinearLogits
from kltriton.ops.layout import check_inputs
from kltriton.topk import TopK
from kltriton.truncation import Truncation

__version__ = "0.1.0"


def empty_cache() -> int:
    """Give the C++ CPU backend's cached ``[N, V]`` gradient buffer back to the OS (the CPU counterpart of
    ``torch.cuda.empty_cache()``); returns the bytes released. The backend keeps the largest freed gradient
    (8 MiB or more) for the next call; ``KLTRITON_CPU_GRAD_CACHE=0`` keeps none. A gradient served from that
    buffer cannot be ``resize_``'d larger."""
    from kltriton.kernels import cpp_library

    return cpp_library.empty_cache()

__all__ = [
    "KLOutput",
    "KLReward",
    "check_inputs",
    "PolicyLossOutput",
    "LinearLogits",
    "controllers",
    "dispatch",
    "empty_cache",
    "entropy_from_logits",
    "fused_kl_reward",
    "lm_head_logits",
    "logprobs_of_labels",
    "policy_loss",
    "score_with_lm_head",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "set_invariant",
    "set_validation",
    "TopK",
    "token_divergence",
    "token_kl",
    "token_logprobs",
    "TokenOutputs",
    "Truncation",
]
