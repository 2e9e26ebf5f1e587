"""Drop-ins for torchrl 0.14's LLM GRPO loss family (``torchrl.objectives.llm``: ``GRPOLoss``, ``DAPO``,
``CISPOLoss``), with the policy objective, the entropy bonus and the KL to the reference computed by one
``kltriton.policy_loss`` call on the actor's logits (reached through the masking strategy's ``_get_*_dist``, as
torchrl's own loss does).

Change ``from torchrl.objectives.llm import GRPOLoss, DAPO, CISPOLoss`` to
``from kltriton.adapters.torchrl import GRPOLoss, DAPO, CISPOLoss``: the same constructor, keys and output class.
The output's values equal torchrl's; the gradient of their sum (what a trainer backpropagates) equals torchrl's,
and it is carried by ``loss_objective`` (the fused loss's gradient is one), while ``loss_entropy`` and
``loss_kl_to_ref`` hold the detached values of their terms. The ``entropy`` metric at the positions whose old
log-prob is NaN (scored by torchrl's entropy, not its loss) is computed in torch from those rows' logits.

torchrl's ``CISPOLoss`` is ``-clip(r) * A`` differentiated through the ratio (``loss_type="clipped_ratio"``), not the
``cispo`` of verl and TRL. torchrl's ratio ``exp(log_weight)`` has no log-ratio clamp (verl clamps it at +-20), so
neither has the drop-ins' (``log_ratio_clamp=math.inf``): a log-ratio of +22 with a negative advantage gives
torchrl's loss and gradient. What runs torchrl's own code, with a warning once per module: ``kl_mask_threshold``
(a per-token mask on the new log-probs that changes the denominators), ``kl_to_inference_coeff`` (a second KL
term), ``aggregation`` / ``reduction`` ``"none"`` (per-token losses), token-level masks and composite
distributions.
"""
import math
import warnings

import torch

try:
    from torchrl.objectives.llm import grpo as _grpo
except ImportError as err:  # pragma: no cover - exercised only without the extra
    from kltriton._install import pip_install

    raise ImportError(f"kltriton.adapters.torchrl needs torchrl and tensordict: {pip_install('torchrl')}") from err

import kltriton

__all__ = ["CISPOLoss", "DAPO", "GRPOLoss"]


class _FusedObjective:
    """The forward of torchrl's GRPO family through ``kltriton.policy_loss`` (mixed into each drop-in)."""

    _loss_type = "ppo"

    def _unmapped(self) -> str:
        """Why this module's configuration runs torchrl's own forward, or ``""``."""
        checks = ((self.kl_mask_threshold is not None and self.kl_mask_threshold > 0, "kl_mask_threshold is set"),
                  (self.kl_to_inference_coeff is not None, "kl_to_inference_coeff is set"),
                  (self.aggregation == "none" or self.reduction == "none", "the loss is per token ('none')"),
                  (self.aggregation not in ("token_mean", "prompt_mean", "none"),
                   f"aggregation={self.aggregation!r}"))
        return next((reason for failed, reason in checks if failed), "")

    def _dist(self, tensordict):
        """The actor's distribution for the masking strategy (torchrl's ``_get_cur_log_prob`` without its
        log-prob pass over the vocabulary)."""
        actor = self.actor_network
        for strategy, method in (("sft", "_get_sft_dist"), ("rlhf", "_get_rlhf_dist"),
                                 ("generic", "_get_generic_dist")):
            if self.masking_strategy == strategy and hasattr(actor, method):
                return getattr(actor, method)(tensordict)
        if hasattr(actor, "get_dist"):
            return actor.get_dist(tensordict, logits_key="logits")
        raise NotImplementedError(f"Actor network must have get_dist method or the appropriate method for "
                                  f"masking strategy '{self.masking_strategy}'.")

    def _torchrl(self, tensordict, reason):
        if not getattr(self, "_kltriton_warned", False):
            warnings.warn(f"{type(self).__name__}: torchrl's own loss runs ({reason})", stacklevel=3)
            self._kltriton_warned = True
        return super().forward(tensordict)

    def forward(self, tensordict):
        reason = self._unmapped()
        if reason:
            return self._torchrl(tensordict, reason)
        keys = self.tensor_keys
        if keys.action not in tensordict:
            raise ValueError(f"Action key {keys.action} not in tensordict.")
        tensordict = tensordict.copy()
        advantage = tensordict.get(keys.advantage, None, as_padded_tensor=True)
        if advantage is None:
            raise ValueError(f"Advantage key {keys.advantage} not in tensordict.")
        dist = self._dist(tensordict)
        if not getattr(dist, "position_level_masking", False):
            return self._torchrl(tensordict, "the distribution is not position-masked")
        action = tensordict.get(keys.action, as_padded_tensor=True, padding_side="left", padding_value=-100)
        old = tensordict.get(keys.sample_log_prob, as_padded_tensor=True, padding_side="left", padding_value=0.0)
        if old is None:
            raise KeyError(f"Couldn't find the log-prob {keys.sample_log_prob} in the input data.")
        if old.requires_grad:
            raise RuntimeError(f"tensordict stored {keys.sample_log_prob} requires grad.")
        logits = dist.logits
        mask = dist.mask & torch.isfinite(old)  # torchrl: NaN-padded old log-probs are not scored
        old = torch.where(mask, old, torch.zeros_like(old))
        if advantage.dim() == logits.dim():  # [B, T, 1] (torchrl's trailing feature dim)
            advantage = advantage.squeeze(-1)
        advantage = advantage.expand(mask.shape)
        numel = mask.numel()
        # torchrl's ratio is exp(log_weight), the log-weight not clamped (verl's names clamp it at +-20)
        kwargs = dict(loss_type=self._loss_type, clip_low=float(self.clip_epsilon_low),
                      clip_high=float(self.clip_epsilon_high), log_ratio_clamp=math.inf, mask=mask, old_logprobs=old)
        if self.aggregation == "prompt_mean":  # per-sample masked mean, then the mean over every sample (the KL
            # stays a mean over every position)
            kwargs.update(pg_aggregation="seq-mean-token-mean", entropy_aggregation="seq-mean-token-mean",
                          global_batch_size=float(mask.shape[0]))
        if self.entropy_bonus:
            kwargs["entropy_coef"] = float(self.entropy_coeff)
        with_kl = self.kl_to_ref_coeff is not None and self.kl_to_ref_coeff > 0
        count = float(mask.sum())
        if with_kl:  # torchrl averages the KL over every position, the loss over the scored ones
            ref = tensordict.get(keys.ref_log_probs, as_padded_tensor=True, padding_side=self.ref_log_prob_padding_side,
                                 padding_value=self.ref_log_prob_padding_value)
            if ref is None:
                raise KeyError(f"Couldn't find the ref log-prob {keys.ref_log_probs} in the input data.")
            if ref.dim() == mask.dim() + 1:
                ref = ref.squeeze(-1)
            kwargs.update(ref=torch.where(mask, ref, torch.zeros_like(ref)).float(), kl_estimator="k3",
                          kl_coef=float(self.kl_to_ref_coeff) * count / numel)
        out = kltriton.policy_loss(logits, action.masked_fill(~mask, -100), advantage, **kwargs)
        td = self._output(out, mask, old, count, numel, with_kl)
        if self.entropy_bonus:
            td.set("entropy", self._entropy(out.entropy, mask, dist.mask & ~mask, logits).mean())
        return self.output_type.from_tensordict(td)

    @staticmethod
    def _entropy(entropy, scored, unscored, logits):
        """torchrl's entropy metric: kltriton's at the scored positions, the logits' own at the unscored positions
        that torchrl's distribution keeps (NaN old log-probs, few: computed in torch), 0 at the masked ones (where
        torchrl's masked categorical fills every logit with the dtype's lowest value)."""
        entropy = torch.where(scored, entropy, torch.zeros_like(entropy))
        if unscored.any():
            kept = logits[unscored].float()
            entropy = entropy.masked_scatter(unscored, torch.distributions.Categorical(logits=kept).entropy())
        return entropy

    def _output(self, out, mask, old, count, numel, with_kl):
        """torchrl's output fields from kltriton's but the entropy: the loss terms, ``clip_fraction`` (over every
        position), ``kl_approx``, ``ESS``."""
        from tensordict import TensorDict

        log_weight = torch.where(mask, out.logprobs - old.float(), torch.zeros_like(out.logprobs))
        low, high = math.log1p(-float(self.clip_epsilon_low)), math.log1p(float(self.clip_epsilon_high))
        clip_fraction = ((log_weight < low) | (log_weight > high)).to(log_weight.dtype).mean()
        lw = log_weight[mask]
        ess = (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp() / mask.sum()
        entropy_term = out.metrics["entropy_loss"] * float(self.entropy_coeff) if self.entropy_bonus else None
        kl_term = out.metrics["kl_loss"] * float(self.kl_to_ref_coeff) * count / numel if with_kl else None
        # torchrl's prompt mean keeps the trailing feature dim of its per-token terms
        shape = (1,) if self.aggregation == "prompt_mean" else ()
        td = TensorDict({"loss_objective": self._objective(out.loss, entropy_term, kl_term).reshape(shape)})
        td.set("clip_fraction", clip_fraction)
        td.set("kl_approx", (-log_weight).mean())
        if self.entropy_bonus:
            td.set("loss_entropy", -entropy_term.reshape(shape))
        td.set("ESS", ess)
        if with_kl:
            td.set("loss_kl_to_ref", kl_term)
            td.set("kl_to_ref", out.metrics["kl_loss"] * count / numel)
        return td

    @staticmethod
    def _objective(loss, entropy_term, kl_term):
        """The policy term's value carrying the whole loss's gradient: ``loss - sg(other terms)``."""
        others = torch.zeros((), dtype=loss.dtype, device=loss.device)
        if entropy_term is not None:
            others = others - entropy_term
        if kl_term is not None:
            others = others + kl_term
        return loss - others.detach()


class GRPOLoss(_FusedObjective, _grpo.GRPOLoss):
    """torchrl's ``GRPOLoss`` (PPO's clipped surrogate per token) through ``kltriton.policy_loss``."""
    _loss_type = "ppo"


class DAPO(_FusedObjective, _grpo.DAPO):
    """torchrl's ``DAPO`` (GRPO with asymmetric clipping) through ``kltriton.policy_loss``."""
    _loss_type = "ppo"


class CISPOLoss(_FusedObjective, _grpo.CISPOLoss):
    """torchrl's ``CISPOLoss`` (``-clip(r) * A``) through ``kltriton.policy_loss`` (``loss_type="clipped_ratio"``)."""
    _loss_type = "clipped_ratio"
