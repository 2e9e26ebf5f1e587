"""verl (tested with 0.9.1): its log-prob and entropy helpers run on kltriton's fused kernels.

``apply()`` replaces, in ``verl.utils.torch_functional`` and in every loaded verl module that imported
them by name (and in those imported later):

- ``logprobs_from_logits(logits, labels, inplace_backward=True)``: ``kltriton.token_logprobs``.
  ``inplace_backward`` (flash-attn's option to write the gradient into the logits) is accepted and
  ignored: kltriton never writes into its inputs.
- ``entropy_from_logits(logits)`` and ``entropy_from_logits_with_chunking(logits, chunk_size)``: the
  entropy from the same streaming pass (no ``[N, V]`` softmax, so no chunking is needed).

Both return fp32 whatever the logits' dtype (verl returns the logits' dtype for bf16 logits).

What stays verl's, and why: ``core_algos.kl_penalty``, ``agg_loss`` and the registered policy losses
receive log-probs, never logits, so there is no vocab pass left for kltriton to fuse; they run on the
log-probs kltriton produced, and their gradient flows back through kltriton's backward. The tests check
that kltriton's ``token_kl`` (every verl KL name) and ``policy_loss`` give verl's values and gradients.

``undo()`` (or leaving ``with apply():``) restores verl's functions everywhere.
"""
import torch

from kltriton import dropins
from kltriton.integrations._patch import Integration, Patch



def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """verl's ``logprobs_from_logits`` on kltriton: fp32 log-prob of ``labels`` (every position scored)."""
    return dropins.logprobs_of_labels(logits, labels)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits`` on kltriton: fp32 entropy of ``softmax(logits)``, differentiable."""
    return dropins.entropy_from_logits(logits)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl's chunked entropy on kltriton; ``chunk_size`` is accepted and not needed."""
    return dropins.entropy_from_logits(logits)


def _install(patch: Patch) -> None:
    """Make verl compute log-probs and entropy with kltriton."""
    import verl.utils.torch_functional as verl_F

    patch.swap("verl", patch.resolve(verl_F, "logprobs_from_logits"), logprobs_from_logits)
    patch.swap("verl", patch.resolve(verl_F, "entropy_from_logits"), entropy_from_logits)
    patch.swap("verl", patch.resolve(verl_F, "entropy_from_logits_with_chunking"), entropy_from_logits_with_chunking)


_integration = Integration("verl", _install, package="verl", extra="verl", tested="0.9.1")
apply = _integration.apply
undo = _integration.undo
