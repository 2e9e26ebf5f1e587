"""kltriton: fused log-probs, KL penalties and KL-shaped rewards straight from the logits.

Importing the package imports neither Triton nor the C++ kernels and never touches CUDA;
backends load on first use.
"""
from kltriton import controllers, dispatch
from kltriton._inputs import set_validation
from kltriton.dropins import logprobs_of_labels, selective_log_softmax
from kltriton.ops.fused_kl_reward import KLReward, fused_kl_reward
from kltriton.ops.linear_logits import LinearLogits
from kltriton.ops.token_kl import KLOutput, token_kl
from kltriton.ops.token_logprobs import token_logprobs

__version__ = "0.1.0"

__all__ = [
    "KLOutput",
    "KLReward",
    "LinearLogits",
    "controllers",
    "dispatch",
    "fused_kl_reward",
    "logprobs_of_labels",
    "selective_log_softmax",
    "set_validation",
    "token_kl",
    "token_logprobs",
]
