"""Drop-ins for torchrl's LLM KL transforms, KL controllers and GRPO losses, computed with kltriton's kernels.

Change ``from torchrl.envs.llm.transforms.kl import KLComputation, RetrieveKL, KLRewardTransform``
(and ``from torchrl.data.llm.utils import AdaptiveKLController``, ``from torchrl.objectives.llm import GRPOLoss,
DAPO, CISPOLoss``) to ``from kltriton.adapters.torchrl import ...``: same constructor arguments, keys, output
layouts and construction errors (tested against torchrl 0.13 and 0.14; the losses against 0.14,
``torchrl_losses.py``). ``use_ray_service=True`` returns the
Ray variant (``kltriton.adapters.torchrl_ray``, needs Ray, the ``[ray]`` extra).

Only torchrl's public API is used: a model's logits come from its ``get_dist(...).logits``.

Layouts: an entry is read once into packed rows (``Packed``: ``values [N, ...]`` plus per-sample
lengths) whatever its layout (one padded ``[B, T, ...]`` tensor, a strided nested tensor, or the
per-sample tensors of a lazily stacked tensordict), computed on, and written back once: padded
stays padded, anything else is written as a strided nested tensor, as torchrl does.

Log-probs follow torchrl's convention: entry ``t`` of ``("log_probs", "full")`` is the log-prob of
token ``t`` of ``("tokens", "full")``, 0 on padding and on the first token of each sample.
"""
import contextlib
import warnings
from typing import NamedTuple, Optional, Tuple

import torch

from kltriton._install import pip_install

try:
    from tensordict import TensorDictBase
    from torchrl.data import Unbounded
    from torchrl.envs import Transform
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("kltriton.adapters.torchrl needs torchrl and tensordict: "
                      f"{pip_install('torchrl')}") from err

from kltriton import controllers, token_kl, token_logprobs
from kltriton import estimators
from kltriton._values import check_float

TOKENS = ("tokens", "full")
ATTENTION_MASK = ("masks", "all_attention_mask")
ASSISTANT_MASK = ("masks", "all_assistant_mask")
PADDING_SIDES = ("left", "right")

__all__ = ["AdaptiveKLController", "CISPOLoss", "ConstantKLController", "DAPO", "GRPOLoss", "KLComputation",
           "KLRewardTransform", "RetrieveKL"]


# ---------------------------------------------------------------------------------------------
# One layout path: any entry <-> packed rows
# ---------------------------------------------------------------------------------------------

class Packed(NamedTuple):
    """An entry as packed rows: ``values [N, *rest]`` hold the samples back to back, ``lengths`` their
    row counts. ``padded`` entries came as one ``[B, T, *rest]`` tensor (every length ``T``) and go
    back as one; the others go back as a strided nested tensor."""
    values: torch.Tensor
    lengths: Tuple[int, ...]
    padded: bool


def _pack(value) -> Packed:
    """``Packed`` of a padded tensor (a view, no copy), a nested tensor or a list of per-sample tensors."""
    if isinstance(value, torch.Tensor) and not value.is_nested:
        batch, length = value.shape[:2]
        return Packed(value.reshape(batch * length, *value.shape[2:]), (length,) * batch, True)
    items = list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)
    if not items:
        raise ValueError("cannot read an entry with no samples")
    return Packed(torch.cat(items), tuple(item.shape[0] for item in items), False)


def _unpack(rows: Packed):
    """The entry of ``rows`` in its layout: ``[B, T, *rest]`` if padded, else a strided nested tensor."""
    if rows.padded:
        length = rows.lengths[0] if rows.lengths else 0
        return rows.values.view(len(rows.lengths), length, *rows.values.shape[1:])
    return _nested(list(rows.values.split(rows.lengths)))


def _nested(items):
    """torchrl's layout for unpadded outputs, without PyTorch's "prototype stage" warning about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
        return torch.nested.as_nested_tensor(items, layout=torch.strided)


def _read(td: TensorDictBase, key) -> Optional[Packed]:
    """The entry at ``key`` as ``Packed``; ``None`` when missing."""
    value = td.get(key, None, as_list=True)
    return None if value is None else _pack(value)


def _write(td: TensorDictBase, key, rows: Packed) -> None:
    td.set(key, _unpack(rows))


def _to(rows: Packed, device) -> Packed:
    return rows if device is None else rows._replace(values=rows.values.to(device))


def _positions(lengths) -> torch.Tensor:
    """``[N]``: the index of each packed row inside its sample."""
    lengths = torch.tensor(lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)


def _check_same_lengths(gen: Packed, ref: Packed, gen_name: str, ref_name: str) -> None:
    """torchrl's per-sample shape check between two log-prob entries."""
    if len(gen.lengths) != len(ref.lengths):
        raise ValueError(f"Batch size mismatch: {gen_name} has {len(gen.lengths)} samples, "
                         f"{ref_name} has {len(ref.lengths)} samples")
    for i, (n, m) in enumerate(zip(gen.lengths, ref.lengths)):
        if n != m:
            raise ValueError(f"Sample {i} has different shapes: {gen_name}[{i}] has {n} tokens, "
                             f"{ref_name}[{i}] has {m}")


def _write_kl(tensordict, kl_key, kl: Packed, coef):
    """``kl`` to ``kl_key``; with ``coef`` (not None), the reward, when there is one, penalized by ``coef * kl``."""
    _write(tensordict, kl_key, kl)
    reward = _read(tensordict, "reward") if coef is not None else None
    if reward is not None:
        _write(tensordict, "reward", _penalized(reward, kl, coef))


def _penalized(reward: Packed, kl: Packed, coef) -> Packed:
    """``reward - coef * kl[..., None]``, sample by sample. A sample's reward is ``[T_i, 1]`` (per token)
    or a single row (``[1, 1]``, or ``[1]`` of a ``[B, 1]`` reward) spread over its tokens."""
    if len(reward.lengths) != len(kl.lengths):
        raise ValueError(f"Batch size mismatch: the reward has {len(reward.lengths)} samples, the kl {len(kl.lengths)}")
    values = reward.values if reward.values.ndim == kl.values.ndim + 1 else None
    if values is None and reward.padded and not kl.padded and reward.values.ndim == kl.values.ndim:
        values = reward.values.unsqueeze(-1)  # torchrl spreads a [B, 1] reward over unpadded samples
    if values is None:
        raise ValueError(f"The rewards have shape {_unpack(reward).shape} but the kl has shape {_unpack(kl).shape}: "
                         "the rewards should have one more (trailing) dimension than the KL.")
    if reward.lengths != kl.lengths:
        if any(n != 1 for n in reward.lengths):
            raise ValueError(f"reward has {reward.lengths} rows per sample where the kl has {kl.lengths}: "
                             "give one reward per token or one per sample")
        values = values.repeat_interleave(torch.tensor(kl.lengths, device=values.device), dim=0)
    return Packed(values - coef * kl.values.unsqueeze(-1), kl.lengths, reward.padded and kl.padded)


def _next_and_step(transform, tensordict):
    """torchrl's ``forward`` of these transforms: step into ``"next"`` when present, else in place."""
    next_td = tensordict.get("next", None)
    if next_td is None:
        return transform._step(tensordict, tensordict)
    return tensordict.set("next", transform._step(tensordict, next_td))


# ---------------------------------------------------------------------------------------------
# KL estimators and argument checks
# ---------------------------------------------------------------------------------------------

def _check_estimator(estimator, logits_available: bool) -> estimators.Estimator:
    if not logits_available and estimators.parse(estimator).needs_ref_logits:
        raise ValueError("estimator='full' needs both models' logits; this transform only sees log-probs")
    return estimators.parse(estimator)


def _check_coef(name, coef):
    """A KL coefficient: a tensor as it is, a number finite (a NaN would poison every reward)."""
    return coef if isinstance(coef, torch.Tensor) else check_float(name, coef)


def _check_padding_side(padding_side) -> str:
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    return padding_side


def _kl_of_logprobs(logp, ref_logp, estimator: estimators.Estimator, kl_clamp):
    """Per-token KL estimate from two log-prob tensors (fp32), by the estimator table of ``kltriton.token_kl``.

    kltriton's public kernels take the policy as logits; torchrl hands these transforms log-probs."""
    return estimator.value(logp.float(), ref_logp.float(), kl_clamp=kl_clamp)


def _check_tokenizer(tokenizer, model) -> None:
    """torchrl takes a ``tokenizer`` for the assistant mask; here the mask and the token ids come from
    the models' own tokenization, so a different tokenizer would be silently ignored: refuse it."""
    own = getattr(model, "tokenizer", None)
    if tokenizer is None or own is None or tokenizer is own:
        return
    if tokenizer.get_vocab() != own.get_vocab():
        raise ValueError("tokenizer differs from the model's tokenizer; the token ids and the assistant mask "
                         "come from the model's own tokenization: pass tokenizer=None or the model's tokenizer")


# ---------------------------------------------------------------------------------------------
# Running torchrl LLM wrappers through their public API
# ---------------------------------------------------------------------------------------------

def _logits_reason(model) -> Optional[str]:
    """Why ``model`` cannot give token-aligned logits through its public API, or ``None`` if it can."""
    if getattr(model, "input_mode", None) != "tokens":
        return (f"input_mode={getattr(model, 'input_mode', None)!r}: the model tokenizes the input itself "
                "and its token ids are not public (input_mode='tokens' can use logits)")
    if not callable(getattr(model, "get_dist", None)):
        return f"{type(model).__name__} has no get_dist method"
    return None


def _logits(model, data: TensorDictBase, padding_side: str):
    """``(logits [B, T, V], attention [B, T] bool, tokens [B, T])`` through ``model.get_dist`` (torchrl's
    public route to logits: row ``t`` scores token ``t``); unpadded samples are padded on ``padding_side``."""
    dist = model.get_dist(data.copy(), mask_key=ATTENTION_MASK, as_padded_tensor=True,
                          padding_side=padding_side, padding_value=0.0)
    tokens = data.get(model.input_key, as_padded_tensor=True, padding_side=padding_side, padding_value=0)
    return dist.logits, dist.mask.bool(), tokens


def _scored(attention):
    """Positions with a log-prob: attended and after the first attended token of the sample
    (torchrl gives the first token log-prob 0). Shape of ``attention`` ``[B, T]``."""
    previous = torch.zeros_like(attention)
    previous[:, 1:] = attention[:, :-1]
    return attention & previous


def _from_padded(values, attention, padded: bool) -> Packed:
    """``Packed`` of a ``[B, T]`` result of ``_logits``: as it is when the model pads its output, else the
    attended positions of each sample."""
    if padded:
        return _pack(values)
    return Packed(values[attention], tuple(attention.sum(-1).tolist()), False)


class _Fallback:
    """Remembers, per transform, whether the logits path was given up (warning once)."""

    def __init__(self, fused: bool):
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        self.fused = fused
        self.warned = False

    def use_logits(self, owner, *models) -> bool:
        if not self.fused:
            return False
        reason = next((r for r in map(_logits_reason, models) if r is not None), None)
        if reason is not None:
            self.give_up(owner, reason)
        return self.fused

    def give_up(self, owner, reason: str) -> None:
        self.fused = False
        if not self.warned:
            warnings.warn(f"{type(owner).__name__}: using the models' log-probs instead of their logits ({reason}); "
                          "pass fused=False to silence this warning", stacklevel=4)
            self.warned = True


def _call_logits(fallback: _Fallback, owner, model, data, padding_side):
    """``_logits`` or ``None`` when the model cannot give logits after all (vLLM, SGLang)."""
    try:
        return _logits(model, data, padding_side)
    except NotImplementedError as err:
        fallback.give_up(owner, f"{type(model).__name__}.get_dist: {err}")
        return None


# ---------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------

class KLComputation(Transform):
    """KL between two log-prob entries, optionally subtracted from the reward (torchrl's ``KLComputation``).

    Reads ``gen_log_probs_full_key`` and ``ref_log_probs_full_key`` (``[B, T]`` or per-sample ``[T_i]``),
    writes ``kl_key`` (same layout, fp32) and, with ``add_to_reward``, replaces ``"reward"`` (``[B, T, 1]``
    or per-sample ``[T_i, 1]``; a ``[1, 1]`` reward is spread over the sample) by
    ``reward - coeff * kl[..., None]``.

    Args beyond torchrl's: ``estimator`` (``"k1"`` = torchrl's ``logp - ref_logp``, ``"abs"``, ``"k2"``,
    ``"k3"``) and ``kl_clamp``.
    """

    def __init__(self, gen_log_probs_full_key=("log_probs", "full"), ref_log_probs_full_key=("ref_log_probs", "full"),
                 *, kl_key="kl_penalty", add_to_reward: bool = True, coeff: float = 1.0, padding_side: str = "left",
                 estimator: str = "k1", kl_clamp: Optional[float] = None):
        in_keys = [gen_log_probs_full_key, ref_log_probs_full_key] + (["reward"] if add_to_reward else [])
        out_keys = [kl_key] + (["reward"] if add_to_reward else [])
        super().__init__(in_keys=in_keys, out_keys=out_keys)
        self.gen_log_probs_full_key = gen_log_probs_full_key
        self.ref_log_probs_full_key = ref_log_probs_full_key
        self.kl_key = kl_key
        self.add_to_reward = add_to_reward
        self.coeff = _check_coef("coeff", coeff)
        # torchrl keeps padding_side without using it: the output has the layout of the input.
        self.padding_side = _check_padding_side(padding_side)
        self.estimator = _check_estimator(estimator, logits_available=False)
        self.kl_clamp = estimators.check_kl_clamp(kl_clamp)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return _next_and_step(self, tensordict)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        gen = _read(next_tensordict, self.gen_log_probs_full_key)
        ref = _read(next_tensordict, self.ref_log_probs_full_key)
        if gen is None or ref is None:
            raise ValueError(f"Log-probs not found. Expected keys: {self.gen_log_probs_full_key}, "
                             f"{self.ref_log_probs_full_key}")
        _check_same_lengths(gen, ref, "gen_log_probs", "ref_log_probs")
        kl = Packed(_kl_of_logprobs(gen.values, ref.values, self.estimator, self.kl_clamp),
                  gen.lengths, gen.padded and ref.padded)
        _write_kl(next_tensordict, self.kl_key, kl, self.coeff if self.add_to_reward else None)
        return next_tensordict

    def transform_observation_spec(self, observation_spec):
        observation_spec[self.kl_key] = Unbounded(device=observation_spec.device, shape=observation_spec.shape)
        return observation_spec

    def transform_reward_spec(self, reward_spec):
        if self.add_to_reward and "reward" in reward_spec.keys():
            reward_spec["reward"] = reward_spec["reward"].clone()
            reward_spec["reward"].shape = torch.Size((*reward_spec["reward"].shape, -1, 1))
        return reward_spec


def _from_factory(model, factory, name: str):
    """``factory()`` when given (refusing a model as well), else ``model``; torchrl's wording."""
    if factory is None:
        return model
    if model is not None and not (name == "gen_model" and isinstance(model, str) and model == "from_collector"):
        raise ValueError(f"Cannot provide both '{name}' and '{name}_factory'. Choose one.")
    return factory()


def _check_log_prob_model(model, name: str, transform: str, assistant_only: bool) -> None:
    """torchrl's construction checks of a model that must score tokens (RetrieveKL, RetrieveLogProb)."""
    if not getattr(model, "return_log_probs", True):
        raise ValueError(f"The {name} model must have `return_log_probs=True` to use the `{transform}` transform.")
    if getattr(model, "generate", False):
        raise ValueError(f"The {name} model must have `generate=False` to use the `{transform}` transform.")
    input_mode = getattr(model, "input_mode", "history")
    if assistant_only and input_mode != "history":
        raise ValueError(f"The model must have `input_mode='history'` when `assistant_only=True`. Current input_mode "
                         f"is '{input_mode}'. To use input_mode '{input_mode}', set `assistant_only=False`.")


class RetrieveKL(Transform):
    """torchrl's ``RetrieveKL``: both models' log-probs, their KL and the KL-penalized reward.

    With ``input_mode="tokens"`` models, one ``kltriton.token_kl`` kernel reads both models' logits
    (from their public ``get_dist``) and gives both log-probs and the KL with no ``log_softmax``;
    otherwise (``input_mode="history"``/``"text"``, where the model tokenizes itself, or a model with
    no logits such as vLLM) the models' own log-probs are used, with one warning (``fused=False``
    asks for that path and silences it). ``assistant_only=True`` (history models) scores only the
    tokens of the model's ``("masks", "all_assistant_mask")``.

    ``gen_model="from_collector"`` (the default) builds the generation model lazily, on first use, from
    the collector's policy (``collector.policy.get_new_version(generate=False, ...)``), as torchrl does.

    Writes ``gen_log_probs_full_key``, ``ref_log_probs_full_key``, ``kl_key`` (``[B, T]`` when the
    models pad their output, per-sample ``[T_i]`` otherwise; 0 where not scored) and, with
    ``add_to_reward``, ``reward - coeff * kl[..., None]``.

    Args beyond torchrl's: ``estimator``, ``kl_clamp`` (as in ``kltriton.token_kl``) and ``fused``.
    ``history_key`` and ``tokenizer_kwargs`` only take their defaults (the models tokenize with their
    own settings); ``tokenizer``, when given, must be the models' tokenizer.
    """

    def __new__(cls, *args, use_ray_service: bool = False, **kwargs):
        if use_ray_service:
            from kltriton.adapters.torchrl_ray import RayRetrieveKL
            return RayRetrieveKL(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, gen_model="from_collector", ref_model=None, *, gen_model_factory=None, ref_model_factory=None,
                 assistant_only: bool = True, history_key: str = "history", tokenizer_kwargs=None,
                 detach: bool = True, device=None, tokenizer=None, padding_side: str = "left",
                 gen_log_probs_full_key=("log_probs", "full"), ref_log_probs_full_key=("ref_log_probs", "full"),
                 kl_key="kl_penalty", add_to_reward: bool = True, coeff: float = 1.0,
                 use_ray_service: bool = False, estimator: str = "k1", kl_clamp: Optional[float] = None,
                 fused: bool = True):
        gen_model = _from_factory(gen_model, gen_model_factory, "gen_model")
        ref_model = _from_factory(ref_model, ref_model_factory, "ref_model")
        if history_key != "history":
            raise ValueError(f"history_key={history_key!r} is not supported: the models read the history from "
                             "their own input_key; set it on the model wrapper")
        if tokenizer_kwargs is not None:
            raise ValueError("tokenizer_kwargs is not supported: the models apply their own chat template; "
                             "pass the tokenization arguments to the model wrapper")
        add = ["reward"] if add_to_reward else []
        super().__init__(in_keys=add, out_keys=[gen_log_probs_full_key, ref_log_probs_full_key, kl_key] + add)
        self.assistant_only = assistant_only
        self.detach = detach
        self.device = device
        self.tokenizer = tokenizer
        self.padding_side = _check_padding_side(padding_side)
        self.gen_log_probs_full_key = gen_log_probs_full_key
        self.ref_log_probs_full_key = ref_log_probs_full_key
        self.kl_key = kl_key
        self.add_to_reward = add_to_reward
        self.coeff = _check_coef("coeff", coeff)
        self.estimator = _check_estimator(estimator, logits_available=True)
        self.kl_clamp = estimators.check_kl_clamp(kl_clamp)
        self._fallback = _Fallback(fused)
        self.gen_model = self.ref_model = None
        if isinstance(gen_model, str) and gen_model == "from_collector":
            self.__dict__["_pending_ref_model"] = ref_model  # the generation model comes from the collector
            return
        self._set_models(gen_model, ref_model)

    def _set_models(self, gen_model, ref_model) -> None:
        """torchrl's construction checks, in its order and wording, then the models."""
        if hasattr(gen_model, "pad_output") and hasattr(ref_model, "pad_output") \
                and gen_model.pad_output != ref_model.pad_output:
            raise ValueError(f"pad_output mismatch: gen_model.pad_output={gen_model.pad_output}, "
                             f"ref_model.pad_output={ref_model.pad_output}. "
                             "Both models must use the same padding strategy for KL computation.")
        for model, name in ((gen_model, "generation"), (ref_model, "reference")):
            _check_log_prob_model(model, name, "RetrieveKL", assistant_only=False)
        if getattr(gen_model, "log_probs_key", "gen_log_probs") == getattr(ref_model, "log_probs_key", "log_probs"):
            raise ValueError("The generation and reference models must have different `log_prob_key` values "
                             "to use the `RetrieveKL` transform.")
        if gen_model is None:
            raise ValueError("gen_model cannot be None when not using 'from_collector'")
        if ref_model is None:
            raise ValueError("ref_model cannot be None")
        for model in (gen_model, ref_model):
            _check_log_prob_model(model, "", "RetrieveLogProb", self.assistant_only)
            _check_tokenizer(self.tokenizer, model)
        # Plain attributes, not submodules: the models belong to the caller (as in torchrl's RetrieveLogProb
        # the transform never moves or registers them).
        self.__dict__["gen_model"], self.__dict__["ref_model"] = gen_model, ref_model
        self.in_keys = list(gen_model.in_keys) + (["reward"] if self.add_to_reward else [])

    def _init_from_collector(self) -> None:
        """torchrl's lazy initialization: the generation model is the collector's policy, re-configured."""
        if self.gen_model is not None:
            return
        if self.container is None:
            raise ValueError("The container is not set. Please set the container before calling this method.")
        collector = self.collector
        if collector is None:
            raise ValueError("The collector is not set. Please set the collector before calling this method.")
        key = self.gen_log_probs_full_key
        if not isinstance(key, tuple) or key[-1] != "full":
            raise ValueError(f"The gen_log_probs_full_key {key} is not a tuple or does not end with 'full'. "
                             "Please use a tuple with the log_probs_key and 'full' as the last element.")
        ref_model = self.__dict__.pop("_pending_ref_model")
        gen_model = collector.policy.get_new_version(
            generate=False, return_log_probs=True, log_probs_key=key[:-1], input_mode=ref_model.input_mode,
            input_key=(ref_model.input_mode, "full"), pad_output=getattr(ref_model, "pad_output", None))
        self._set_models(gen_model, ref_model)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return _next_and_step(self, tensordict)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        self._init_from_collector()
        return tensordict_reset

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        self._init_from_collector()
        data = tensordict if self.device is None else tensordict.to(self.device)
        grad = torch.no_grad() if self.detach else contextlib.nullcontext()
        with grad:
            result = None
            if self._fallback.use_logits(self, self.gen_model, self.ref_model):
                result = self._kl_from_logits(data)
            if result is None:
                result = self._kl_from_logprobs(data)
        logp, ref_logp, kl = (_to(rows, next_tensordict.device) for rows in result)
        _write(next_tensordict, self.gen_log_probs_full_key, logp)
        _write(next_tensordict, self.ref_log_probs_full_key, ref_logp)
        _write_kl(next_tensordict, self.kl_key, kl, self.coeff if self.add_to_reward else None)
        return next_tensordict

    def _kl_from_logits(self, data):
        """``(logp, ref_logp, kl)`` as ``Packed`` from one ``token_kl`` kernel over both models' logits."""
        gen = _call_logits(self._fallback, self, self.gen_model, data, self.padding_side)
        if gen is None:
            return None
        ref = _call_logits(self._fallback, self, self.ref_model, data, self.padding_side)
        if ref is None:
            return None
        (gen_logits, attention, tokens), (ref_logits, _, _) = gen, ref
        scored = _scored(attention)
        out = token_kl(gen_logits, ref_logits, tokens, mask=scored, estimator=self.estimator, kl_clamp=self.kl_clamp)
        padded = bool(self.gen_model.pad_output)
        return tuple(_from_padded(x, attention, padded) for x in (out.logprobs, out.ref_logprobs, out.kl))

    def _kl_from_logprobs(self, data):
        """``(logp, ref_logp, kl)`` as ``Packed`` from the models' own log-probs (and assistant masks)."""
        if self.estimator.needs_ref_logits:
            raise ValueError("estimator='full' needs both models' logits, which these models cannot give")
        logp = self._model_logprobs(self.gen_model, data)
        ref_logp = self._model_logprobs(self.ref_model, data)
        _check_same_lengths(logp, ref_logp, "gen_log_probs", "ref_log_probs")
        kl = _kl_of_logprobs(logp.values, ref_logp.values, self.estimator, self.kl_clamp)
        return logp, ref_logp, logp._replace(values=kl)

    def _model_logprobs(self, model, data) -> Packed:
        out = model(data.copy())
        logp = _read(out, (model.log_probs_key, "full"))
        if not self.assistant_only:
            return logp
        assistant = _read(out, ASSISTANT_MASK)
        if assistant is None:
            raise KeyError(f"assistant_only=True needs the model output's {ASSISTANT_MASK}")
        return logp._replace(values=logp.values.masked_fill(~assistant.values.bool(), 0.0))

    def transform_observation_spec(self, observation_spec):
        """Registers both log-prob entries and the KL (torchrl registers only the KL, which rollouts reject)."""
        for key in (self.gen_log_probs_full_key, self.ref_log_probs_full_key, self.kl_key):
            observation_spec[key] = Unbounded(device=observation_spec.device, shape=observation_spec.shape)
        return observation_spec

    transform_reward_spec = KLComputation.transform_reward_spec


class KLRewardTransform(Transform):
    """torchrl's LLM ``KLRewardTransform`` (legacy): ``reward - coef * (log_prob - ref_log_prob)``.

    The current log-probs are read from ``log_prob_key`` of the input; the reference log-probs come
    from ``ref_model`` (``input_mode="tokens"``, as torchrl requires): from its logits through
    ``kltriton.token_logprobs`` (no ``log_softmax``), or from its own log-probs for a model without
    logits (one warning) or with ``fused=False``. With ``assistant_only=True`` only the tokens of
    ``("masks", "all_assistant_mask")``, or those after ``("tokens", "prompt")`` when it is absent, count.

    Writes into the next tensordict ``out_keys`` = ``[reward, "kl_penalty", "ref_log_probs"]``, all with a
    trailing dim of 1 (``[B, T, 1]``, or nested ``[T_i, 1]`` when the model does not pad its output).

    Args beyond torchrl's: ``estimator`` (not ``"full"``: the policy is given as log-probs), ``kl_clamp``,
    ``fused``. ``tokenizer``, when given, must be the reference model's tokenizer.
    """

    DEFAULT_IN_KEYS = ["reward"]

    def __new__(cls, *args, use_ray_service: bool = False, **kwargs):
        if use_ray_service:
            from kltriton.adapters.torchrl_ray import RayKLRewardTransform
            return RayKLRewardTransform(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, ref_model=None, *, ref_model_factory=None, coef=1.0, in_keys=None, out_keys=None,
                 log_prob_key=("log_probs", "full"), device=None, add_to_reward: bool = True, tokenizer=None,
                 assistant_only: bool = True, padding_side: str = "left", use_ray_service: bool = False,
                 estimator: str = "k1", kl_clamp: Optional[float] = None, fused: bool = True):
        if ref_model is None and ref_model_factory is None:
            raise ValueError("Must provide exactly one of 'ref_model' or 'ref_model_factory'.")
        ref_model = _from_factory(ref_model, ref_model_factory, "ref_model")
        in_keys = list(self.DEFAULT_IN_KEYS if in_keys is None else in_keys)
        out_keys = list(in_keys if out_keys is None else out_keys)
        if len(out_keys) == len(in_keys):
            out_keys = out_keys + ["kl_penalty", "ref_log_probs"]
        elif len(out_keys) != len(in_keys) + 2:
            raise ValueError("The out_keys must have the same length as the in_keys "
                             "(plus two additional optional kl entries for logging).")
        if len(in_keys) != 1 or len(out_keys) != 3:
            raise ValueError(f"Only one in_key/out_key is allowed, got in_keys={in_keys}, out_keys={out_keys}.")
        if getattr(ref_model, "generate", False):
            raise ValueError("The actor is configured to generate text, not compute the log-probs.")
        super().__init__(in_keys=in_keys + list(ref_model.in_keys), out_keys=out_keys)
        self.__dict__["ref_model"] = ref_model  # the caller's model, never moved or registered
        self.register_buffer("coef", torch.as_tensor(_check_coef("coef", coef)))
        self.log_prob_full_key = log_prob_key
        self.device = device
        self.add_to_reward = add_to_reward
        self._tokenizer = tokenizer
        self.assistant_only = assistant_only
        self.padding_side = _check_padding_side(padding_side)
        self.estimator = _check_estimator(estimator, logits_available=False)
        self.kl_clamp = estimators.check_kl_clamp(kl_clamp)
        self._fallback = _Fallback(fused)
        if getattr(ref_model, "input_mode", "tokens") != "tokens":
            raise ValueError("The ref_model must be configured to use tokens as input. "
                             "Please set the `input_mode` argument to `tokens`.")
        _check_tokenizer(tokenizer, ref_model)

    @property
    def pad_output(self) -> bool:
        return self.ref_model.pad_output

    @property
    def tokenizer(self):
        return self._tokenizer if self._tokenizer is not None else self.ref_model.tokenizer

    @property
    def action_key(self):
        """The response entry: from the parent env's input mode, else the reference model's input key."""
        parent = self.parent
        if parent is not None:
            return (parent.base_env.input_mode, "full")
        return self.ref_model.in_keys[0]

    def _reset(self, tensordict, tensordict_reset):
        return tensordict_reset

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return _next_and_step(self, tensordict)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.get(self.action_key, None, as_list=True) is None:
            if not self.missing_tolerance:
                raise RuntimeError(f"Action with key {self.action_key} not found data {tensordict}")
            return next_tensordict
        data = tensordict if self.device is None else tensordict.to(self.device)
        logp = _read(data, self.log_prob_full_key)
        if logp is None:
            raise KeyError(f"the current log-probs {self.log_prob_full_key} are missing from the input")
        with torch.no_grad():
            ref_logp = self._ref_logprobs(data)
        _check_same_lengths(logp, ref_logp, "log_prob", "ref_log_prob")
        if self.assistant_only:
            mask = self._response_mask(data).values.bool()
            logp = logp._replace(values=logp.values.masked_fill(~mask, 0.0))
            ref_logp = ref_logp._replace(values=ref_logp.values.masked_fill(~mask, 0.0))
        padded = bool(self.pad_output)
        kl = Packed(_kl_of_logprobs(logp.values, ref_logp.values, self.estimator, self.kl_clamp), logp.lengths, padded)
        kl = _to(kl, next_tensordict.device)
        if self.add_to_reward:
            reward = _read(next_tensordict, self.in_keys[0])
            if reward is None:
                reward = Packed(torch.zeros_like(kl.values).unsqueeze(-1), kl.lengths, padded)
            _write(next_tensordict, self.out_keys[0], _penalized(reward, kl, self.coef.to(kl.values.device)))
        _write(next_tensordict, self.out_keys[1], kl._replace(values=kl.values.unsqueeze(-1)))
        ref_logp = Packed(ref_logp.values.float().unsqueeze(-1), kl.lengths, padded)
        _write(next_tensordict, self.out_keys[2], _to(ref_logp, next_tensordict.device))
        return next_tensordict

    def _ref_logprobs(self, data) -> Packed:
        """The reference log-probs as ``Packed``: from the logits in one kernel, else the model's own."""
        padded = bool(self.pad_output)
        if self._fallback.use_logits(self, self.ref_model):
            found = _call_logits(self._fallback, self, self.ref_model, data, self.padding_side)
            if found is not None:
                logits, attention, tokens = found
                return _from_padded(token_logprobs(logits, tokens, mask=_scored(attention)), attention, padded)
        out = self.ref_model(data.copy())
        return _read(out, (self.ref_model.log_probs_key, "full"))

    def _response_mask(self, data) -> Packed:
        """The assistant mask, else the attention mask after the prompt (torchrl's fallback)."""
        mask = _read(data, ASSISTANT_MASK)
        if mask is not None:
            return mask
        attention = data.get(ATTENTION_MASK, None, as_list=True)
        prompt = data.get(("tokens", "prompt"), None, as_list=True)
        if attention is None or prompt is None:
            raise KeyError(f"assistant_only=True needs {ASSISTANT_MASK}, or {ATTENTION_MASK} and ('tokens', 'prompt')")
        attention = _pack(attention)
        if isinstance(prompt, torch.Tensor) and not prompt.is_nested:
            prompt_lengths = [prompt.shape[-1]] * len(attention.lengths)
        else:
            prompt_lengths = [p.shape[-1] for p in prompt]
        after_prompt = _positions(attention.lengths) >= torch.tensor(prompt_lengths).repeat_interleave(
            torch.tensor(attention.lengths))
        return attention._replace(values=attention.values.bool() & after_prompt.to(attention.values.device))


# ---------------------------------------------------------------------------------------------
# KL controllers with torchrl's signatures
# ---------------------------------------------------------------------------------------------

class _ModelCoefficient:
    """A controller of ``kltriton.controllers`` (``self.controller``) whose coefficient, ``.coef`` / ``.value``, is
    also written to ``model.kl_coef`` when torchrl's ``model=`` is given."""

    def __init__(self, controller, model):
        self.controller, self.model = controller, model
        self._write()

    @property
    def coef(self) -> float:
        return self.controller.value

    value = coef

    def _write(self):
        if self.model is not None:
            self.model.kl_coef = self.coef


class AdaptiveKLController(_ModelCoefficient):
    """torchrl's ``AdaptiveKLController(init_kl_coef=, target=, horizon=, model=None)`` on
    ``kltriton.controllers.AdaptiveKLController``.

    ``update(kl_values)`` takes torchrl's logged reward terms ``-coef * kl`` (a list of floats or a
    tensor) and returns the new coefficient, also kept in ``.coef`` / ``.value`` and written to
    ``model.kl_coef`` when a model is given.
    """

    def __init__(self, *, init_kl_coef: float, target: float, horizon: int, model=None):
        super().__init__(controllers.AdaptiveKLController(init_kl_coef, target, horizon), model)
        self.target, self.horizon = self.controller.target, self.controller.horizon

    def update(self, kl_values) -> float:
        self.controller.update_from_reward_kl(kl_values)
        self._write()
        return self.coef


class ConstantKLController(_ModelCoefficient):
    """torchrl's ``ConstantKLController(kl_coef=, model=None)``: ``update`` changes nothing."""

    def __init__(self, *, kl_coef: float = None, model=None):
        super().__init__(controllers.ConstantKLController(kl_coef), model)

    def update(self, kl_values=None) -> float:
        return self.coef


# The GRPO loss family (torchrl.objectives.llm) lives in its own module.
from kltriton.adapters.torchrl_losses import CISPOLoss, DAPO, GRPOLoss  # noqa: E402
