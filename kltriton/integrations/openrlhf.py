"""OpenRLHF (tested with 0.11.2): its log-prob and entropy helpers run on kltriton's fused kernels.

``apply()`` replaces, in ``openrlhf.models.utils`` and in every loaded OpenRLHF module that imported them
by name (``openrlhf.models.actor`` does), and in those imported later:

- ``log_probs_from_logits(logits, labels, temperature=1.0)``: ``kltriton.token_logprobs``. OpenRLHF
  divides the caller's ``logits`` by ``temperature`` in place when it is not 1; kltriton never modifies
  its inputs, so after the call the caller's logits are still unscaled. (OpenRLHF 0.11's ``Actor`` scales
  the logits itself and calls with ``temperature=1.0``, so it sees no difference.)
- ``compute_entropy(logits)``: the entropy from the same streaming pass (OpenRLHF's is a
  ``torch.compile``d softmax over the whole ``[B, T, V]``).

Both return fp32 (the ``Actor`` casts its logits to fp32 first, so it sees no difference).

What stays OpenRLHF's, and why: ``compute_approx_kl``, ``compute_reward`` and ``PolicyLoss`` receive
log-probs or KL values, never logits, so there is no vocab pass left for kltriton to fuse; they run on the
log-probs kltriton produced. The tests check that kltriton's ``token_kl``, ``fused_kl_reward`` and
``policy_loss`` give their values and gradients.

``undo()`` (or leaving ``with apply():``) restores OpenRLHF's functions everywhere.
"""
import torch

from kltriton import dropins
from kltriton.integrations._patch import Integration, Patch



def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """OpenRLHF's ``log_probs_from_logits`` on kltriton: fp32 log-prob of ``labels`` under
    ``softmax(logits / temperature)``; ``logits`` are left as they are (OpenRLHF divides them in place)."""
    return dropins.selective_log_softmax(logits, labels, temperature)


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's ``compute_entropy`` on kltriton: fp32 entropy of ``softmax(logits)``, differentiable."""
    return dropins.entropy_from_logits(logits)


def _install(patch: Patch) -> None:
    """Make OpenRLHF compute log-probs and entropy with kltriton."""
    import openrlhf.models.utils as openrlhf_utils

    patch.swap("openrlhf", patch.resolve(openrlhf_utils, "log_probs_from_logits"), log_probs_from_logits)
    patch.swap("openrlhf", patch.resolve(openrlhf_utils, "compute_entropy"), compute_entropy)


_integration = Integration("OpenRLHF", _install, package="openrlhf", tested="0.11.2")
apply = _integration.apply
undo = _integration.undo
