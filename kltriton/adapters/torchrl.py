"""Drop-ins for torchrl's LLM KL transforms and KL controllers, computed with kltriton's kernels.

Change ``from torchrl.envs.llm.transforms.kl import KLComputation, RetrieveKL, KLRewardTransform``
(and ``from torchrl.data.llm.utils import AdaptiveKLController``) to
``from kltriton.adapters.torchrl import ...``: same constructor arguments, keys and output shapes.

Entries are read in any of torchrl's three layouts and written back in the same one:
``"padded"`` (one ``[B, T]`` tensor, rewards ``[B, T, 1]``), ``"nested"`` (a strided nested
tensor) or ``"list"`` (per-sample tensors of a lazily stacked tensordict). Non-padded results are
written as strided nested tensors, as torchrl does.

Log-probs follow torchrl's convention: entry ``t`` of ``("log_probs", "full")`` is the log-prob of
token ``t`` of ``("tokens", "full")``, 0 on padding and on the first token of each sample.
"""
import contextlib
from typing import Optional

import torch

try:
    from tensordict import TensorDictBase
    from torch.nn.utils.rnn import pad_sequence
    from torchrl.data import Unbounded
    from torchrl.envs import Transform
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("kltriton.adapters.torchrl needs torchrl and tensordict: "
                      "pip install kltriton[torchrl]") from err

from kltriton import controllers, estimators
from kltriton.ops.token_kl import token_kl
from kltriton.ops.token_logprobs import token_logprobs

TOKENS = ("tokens", "full")
ATTENTION_MASK = ("masks", "all_attention_mask")
ASSISTANT_MASK = ("masks", "all_assistant_mask")

__all__ = ["AdaptiveKLController", "ConstantKLController", "KLComputation", "KLRewardTransform", "RetrieveKL"]


# ---------------------------------------------------------------------------------------------
# Layouts: a padded tensor, or a list of per-sample tensors (from a nested tensor or a lazy stack)
# ---------------------------------------------------------------------------------------------

def _read(td: TensorDictBase, key):
    """``(layout, value)``: ``("padded", [B, T, ...] tensor)``, ``("nested" | "list", [tensor])``
    or ``(None, None)`` when ``key`` is missing."""
    value = td.get(key, None, as_list=True)
    if value is None:
        return None, None
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return "nested", list(value.unbind(0))
        return "padded", value
    return "list", list(value)


def _write(td: TensorDictBase, key, layout: str, value) -> None:
    if layout == "padded":
        td.set(key, value)
    else:
        td.set(key, torch.nested.as_nested_tensor(list(value), layout=torch.strided))


def _read_as(td: TensorDictBase, key, layout: str):
    """The entry at ``key`` converted to ``layout`` (a lazily stacked output of a padding model
    returns its equal-length rows as a list: they are stacked back). ``None`` when missing."""
    found, value = _read(td, key)
    if value is None or (found == "padded") == (layout == "padded"):
        return value
    return torch.stack(value) if layout == "padded" else list(value.unbind(0))


def _as_list(layout, value):
    return list(value.unbind(0)) if layout == "padded" else value


def _map(fn, layout, *values):
    """Apply an elementwise ``fn`` to same-layout values: once on padded tensors, once on the
    concatenation of the samples otherwise (one launch, not one per sample)."""
    if layout == "padded":
        return fn(*values)
    first = values[0]
    for i, items in enumerate(values[1:], 1):
        if len(items) != len(first):
            raise ValueError(f"batch size mismatch: {len(first)} samples against {len(items)}")
        for j, (a, b) in enumerate(zip(first, items)):
            if a.shape != b.shape:
                raise ValueError(f"sample {j} has different shapes: {tuple(a.shape)} and {tuple(b.shape)}")
    flat = fn(*[torch.cat([t.reshape(-1) for t in items]) if items else items for items in values])
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in first]), first)]


def _kl_from_logprobs(estimator, kl_clamp):
    def kl(logp, ref_logp):
        return estimators.value(estimator, kl_clamp, logp.float(), ref_logp.float(), None)
    return kl


def _subtract_kl(reward_layout, reward, kl_layout, kl, coef):
    """``reward - coef * kl[..., None]`` per sample; ``(layout, new reward)``."""
    if reward_layout == "padded" and kl_layout == "padded":
        if reward.ndim != kl.ndim + 1:
            raise ValueError(f"reward has shape {tuple(reward.shape)} but the kl has shape {tuple(kl.shape)}: "
                             "the reward must have one more (trailing) dimension than the kl")
        return "padded", reward - coef * kl.unsqueeze(-1)
    rewards, kls = _as_list(reward_layout, reward), _as_list(kl_layout, kl)
    if len(rewards) != len(kls):
        raise ValueError(f"batch size mismatch: {len(rewards)} rewards against {len(kls)} kl samples")
    out = []
    for r, k in zip(rewards, kls):
        if r.ndim != k.ndim + 1:
            raise ValueError(f"reward has shape {tuple(r.shape)} but the kl has shape {tuple(k.shape)}: "
                             "the reward must have one more (trailing) dimension than the kl")
        out.append(r - coef * k.unsqueeze(-1))
    return "nested", out


def _next_and_step(transform, tensordict):
    """torchrl's ``forward`` of these transforms: step into ``"next"`` when present, else in place."""
    next_td = tensordict.get("next", None)
    if next_td is None:
        return transform._step(tensordict, tensordict)
    return tensordict.set("next", transform._step(tensordict, next_td))


# ---------------------------------------------------------------------------------------------
# Running LLMWrapperBase-style models
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _logits_switched_on(model):
    """torchrl's ``TransformersWrapper`` (0.14) puts its logits in the output only inside
    ``get_dist``, which flips ``_in_get_dist_call`` and adds ``"logits"`` to ``out_keys``; do the same."""
    model._in_get_dist_call = True
    model.out_keys.append("logits")
    try:
        yield
    finally:
        model._in_get_dist_call = False
        model.out_keys.remove("logits")


def _run(model, tensordict, want_logits: bool, detach: bool):
    """Output tensordict of ``model`` on a copy of ``tensordict``, holding a token-aligned ``"logits"``
    entry (row ``t`` predicts token ``t``) when ``want_logits`` and the model can give one."""
    grad = torch.no_grad() if detach else contextlib.nullcontext()
    with grad:
        if want_logits and hasattr(model, "_in_get_dist_call"):
            with _logits_switched_on(model):
                return model.forward(tensordict.copy(), logits_only=True)
        return model(tensordict.copy())


def _model_layout(model, out) -> str:
    """``"padded"`` for a model that pads its output (``pad_output``), else ``"nested"``; a model
    without ``pad_output`` is judged by its output."""
    pad_output = getattr(model, "pad_output", None)
    if pad_output is None:
        key = "logits" if _has_logits(out) else (model.log_probs_key, "full")
        return "padded" if _read(out, key)[0] == "padded" else "nested"
    return "padded" if pad_output else "nested"


def _has_logits(out) -> bool:
    return "logits" in out.keys()


def _scored_mask(attention_mask):
    """Positions with a log-prob: attended and preceded by an attended token (torchrl gives the
    first token of a sample log-prob 0). Shape of ``attention_mask``."""
    attention_mask = attention_mask.bool()
    previous = torch.zeros_like(attention_mask)
    previous[..., 1:] = attention_mask[..., :-1]
    return attention_mask & previous


def _masks(out, tensordict, layout, assistant_only):
    """Scored-position masks in ``layout``: attended, not first and, if asked, assistant tokens."""
    attention = _read_as(out, ATTENTION_MASK, layout)
    if attention is None:
        raise KeyError(f"the model output has no {ATTENTION_MASK} entry")
    if layout == "padded":
        scored = _scored_mask(attention)
    else:
        scored = [_scored_mask(a) for a in attention]
    if not assistant_only:
        return scored
    assistant = _assistant_mask(out, tensordict, layout)
    if layout == "padded":
        return scored & assistant
    return [s & a for s, a in zip(scored, assistant)]


def _assistant_mask(out, tensordict, layout):
    """Bool ``("masks", "all_assistant_mask")`` in ``layout``, from the model output or the data."""
    value = _read_as(out, ASSISTANT_MASK, layout)
    if value is None:
        value = _read_as(tensordict, ASSISTANT_MASK, layout)
    if value is None:
        raise KeyError(f"assistant_only=True needs an {ASSISTANT_MASK} entry (from the model or the data); "
                       "pass assistant_only=False to score every token")
    return value.bool() if layout == "padded" else [v.bool() for v in value]


def _kl_from_logits(gen_out, ref_out, scored, layout, estimator, kl_clamp):
    """``(kl, logp, ref_logp)`` in ``layout`` from both models' logits, in one kernel."""
    gen_logits, ref_logits = _read_as(gen_out, "logits", layout), _read_as(ref_out, "logits", layout)
    tokens = _read_as(gen_out, TOKENS, layout)
    if layout == "padded":
        return tuple(token_kl(gen_logits, ref_logits, tokens, mask=scored, estimator=estimator, kl_clamp=kl_clamp))
    lengths = [t.numel() for t in tokens]
    packed = token_kl(torch.cat(list(gen_logits)), torch.cat(list(ref_logits)), torch.cat(tokens),
                      mask=torch.cat(scored), estimator=estimator, kl_clamp=kl_clamp)
    return tuple(list(x.split(lengths)) for x in packed)


def _apply_mask(layout, values, mask):
    if layout == "padded":
        return values.masked_fill(~mask, 0.0)
    return [v.masked_fill(~m, 0.0) for v, m in zip(values, mask)]


# ---------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------

class KLComputation(Transform):
    """KL between two log-prob entries, optionally subtracted from the reward (torchrl's
    ``KLComputation``), for padded tensors, nested tensors and lazily stacked lists alike.

    Reads ``gen_log_probs_full_key`` and ``ref_log_probs_full_key`` (``[B, T]`` or per-sample
    ``[T_i]``), writes ``kl_key`` (same shapes, fp32) and, with ``add_to_reward``, replaces
    ``"reward"`` (``[B, T, 1]`` or ``[T_i, 1]``) by ``reward - coeff * kl[..., None]``.

    Args beyond torchrl's: ``estimator`` (``"k1"`` = torchrl's ``logp - ref_logp``, or ``"abs"``,
    ``"k2"``, ``"k3"``; ``"full"`` needs logits) and ``kl_clamp``.
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
        self.coeff = coeff
        self.padding_side = padding_side
        self.estimator = estimators.canonical(estimator)
        if self.estimator == "full":
            raise ValueError("estimator='full' needs logits; KLComputation only sees log-probs (use RetrieveKL)")
        self.kl_clamp = estimators.check_kl_clamp(kl_clamp)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return _next_and_step(self, tensordict)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        layout, gen = _read(next_tensordict, self.gen_log_probs_full_key)
        ref_layout, ref = _read(next_tensordict, self.ref_log_probs_full_key)
        if gen is None or ref is None:
            raise ValueError(f"log-probs not found: expected {self.gen_log_probs_full_key} and "
                             f"{self.ref_log_probs_full_key}")
        if layout != ref_layout:
            layout, gen, ref = "nested", _as_list(layout, gen), _as_list(ref_layout, ref)
        elif layout == "padded" and gen.shape != ref.shape:
            raise ValueError(f"log-prob shapes differ: {tuple(gen.shape)} and {tuple(ref.shape)}")
        kl = _map(_kl_from_logprobs(self.estimator, self.kl_clamp), layout, gen, ref)
        _write(next_tensordict, self.kl_key, layout, kl)
        if self.add_to_reward:
            reward_layout, reward = _read(next_tensordict, "reward")
            if reward is not None:
                _write(next_tensordict, "reward", *_subtract_kl(reward_layout, reward, layout, kl, self.coeff))
        return next_tensordict

    def transform_observation_spec(self, observation_spec):
        observation_spec[self.kl_key] = Unbounded(device=observation_spec.device, shape=observation_spec.shape)
        return observation_spec

    def transform_reward_spec(self, reward_spec):
        if self.add_to_reward:
            reward_spec["reward"] = reward_spec["reward"].clone()
            reward_spec["reward"].shape = torch.Size((*reward_spec["reward"].shape, -1, 1))
        return reward_spec


def _from_factory(model, factory, name):
    if factory is not None:
        if model is not None and not isinstance(model, str):
            raise ValueError(f"Cannot provide both '{name}' and '{name}_factory'. Choose one.")
        return factory()
    return model


class RetrieveKL(Transform):
    """torchrl's ``RetrieveKL``: both models' log-probs, their KL and the KL-penalized reward.

    When both models can return logits (torchrl's ``TransformersWrapper``, or any
    ``LLMWrapperBase``-style module whose output holds a ``"logits"`` entry aligned with
    ``("tokens", "full")``), one ``kltriton.token_kl`` kernel reads both models' logits and gives
    both log-probs and the KL, with no ``log_softmax``; otherwise (or with ``fused=False``) the models'
    own log-probs are used. ``assistant_only=True`` scores only the tokens of
    ``("masks", "all_assistant_mask")`` (from the model output or the data).

    Writes ``gen_log_probs_full_key``, ``ref_log_probs_full_key``, ``kl_key`` (``[B, T]`` when the
    models pad their output, per-sample ``[T_i]`` otherwise; 0 where not scored) and, with
    ``add_to_reward``, ``reward - coeff * kl[..., None]``.

    Args beyond torchrl's: ``estimator``, ``kl_clamp`` (as in ``kltriton.token_kl``), ``fused``.
    Not supported: ``gen_model="from_collector"`` and ``use_ray_service=True``.
    """

    def __init__(self, gen_model=None, ref_model=None, *, gen_model_factory=None, ref_model_factory=None,
                 assistant_only: bool = True, history_key: str = "history", tokenizer_kwargs=None,
                 detach: bool = True, device=None, tokenizer=None, padding_side: str = "left",
                 gen_log_probs_full_key=("log_probs", "full"), ref_log_probs_full_key=("ref_log_probs", "full"),
                 kl_key="kl_penalty", add_to_reward: bool = True, coeff: float = 1.0,
                 use_ray_service: bool = False, estimator: str = "k1", kl_clamp: Optional[float] = None,
                 fused: bool = True):
        gen_model = _from_factory(gen_model, gen_model_factory, "gen_model")
        ref_model = _from_factory(ref_model, ref_model_factory, "ref_model")
        if gen_model is None or isinstance(gen_model, str):
            raise ValueError("gen_model must be given (or gen_model_factory); 'from_collector' is not supported")
        if ref_model is None:
            raise ValueError("ref_model cannot be None")
        if use_ray_service:
            raise ValueError("use_ray_service=True is not supported by the kltriton drop-in")
        for name, model in (("generation", gen_model), ("reference", ref_model)):
            if not getattr(model, "return_log_probs", True) or getattr(model, "generate", False):
                raise ValueError(f"The {name} model must have return_log_probs=True and generate=False")
        if getattr(gen_model, "pad_output", None) != getattr(ref_model, "pad_output", None):
            raise ValueError("gen_model and ref_model must use the same pad_output")
        add = ["reward"] if add_to_reward else []
        super().__init__(in_keys=list(gen_model.in_keys) + add,
                         out_keys=[gen_log_probs_full_key, ref_log_probs_full_key, kl_key] + add)
        self.gen_model, self.ref_model = gen_model, ref_model
        self.assistant_only = assistant_only
        self.detach = detach
        self.device = device
        self.tokenizer = tokenizer
        self.padding_side = padding_side
        self.gen_log_probs_full_key = gen_log_probs_full_key
        self.ref_log_probs_full_key = ref_log_probs_full_key
        self.kl_key = kl_key
        self.add_to_reward = add_to_reward
        self.coeff = coeff
        self.estimator = estimators.canonical(estimator)
        self.kl_clamp = estimators.check_kl_clamp(kl_clamp)
        self.fused = fused

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return _next_and_step(self, tensordict)

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        source = tensordict if self.device is None else tensordict.to(self.device)
        gen_out = _run(self.gen_model, source, self.fused, self.detach)
        ref_out = _run(self.ref_model, source, self.fused, self.detach)
        layout = _model_layout(self.gen_model, gen_out)
        if _has_logits(gen_out) and _has_logits(ref_out):
            scored = _masks(gen_out, source, layout, self.assistant_only)
            kl, logp, ref_logp = _kl_from_logits(gen_out, ref_out, scored, layout, self.estimator, self.kl_clamp)
        else:
            if self.estimator == "full":
                raise ValueError("estimator='full' needs both models to return logits")
            logp = _read_as(gen_out, (self.gen_model.log_probs_key, "full"), layout)
            ref_logp = _read_as(ref_out, (self.ref_model.log_probs_key, "full"), layout)
            if self.assistant_only:
                assistant = _assistant_mask(gen_out, source, layout)
                logp, ref_logp = _apply_mask(layout, logp, assistant), _apply_mask(layout, ref_logp, assistant)
            kl = _map(_kl_from_logprobs(self.estimator, self.kl_clamp), layout, logp, ref_logp)
        device = next_tensordict.device
        if device is not None:
            move = (lambda x: x.to(device)) if layout == "padded" else (lambda x: [t.to(device) for t in x])  # noqa: E731
            kl, logp, ref_logp = move(kl), move(logp), move(ref_logp)
        _write(next_tensordict, self.gen_log_probs_full_key, layout, logp)
        _write(next_tensordict, self.ref_log_probs_full_key, layout, ref_logp)
        _write(next_tensordict, self.kl_key, layout, kl)
        if self.add_to_reward:
            reward_layout, reward = _read(next_tensordict, "reward")
            if reward is not None:
                _write(next_tensordict, "reward", *_subtract_kl(reward_layout, reward, layout, kl, self.coeff))
        return next_tensordict

    transform_observation_spec = KLComputation.transform_observation_spec
    transform_reward_spec = KLComputation.transform_reward_spec


class KLRewardTransform(Transform):
    """torchrl's LLM ``KLRewardTransform`` (legacy): ``reward - coef * (log_prob - ref_log_prob)``.

    The current log-probs are read from ``log_prob_key`` of the input; the reference log-probs
    come from ``ref_model``: from its logits through ``kltriton.token_logprobs`` when it can
    return them (no ``log_softmax``), else from its own log-probs. Masking: assistant tokens
    (``("masks", "all_assistant_mask")``, or the response after ``("tokens", "prompt")`` when absent)
    with ``assistant_only=True``.

    Writes into the next tensordict ``out_keys`` = ``[reward, "kl_penalty", "ref_log_prob"]``, all with
    a trailing dim of 1 (``[B, T, 1]``, or nested ``[T_i, 1]`` when the model does not pad its output).
    """

    DEFAULT_IN_KEYS = ["reward"]

    def __init__(self, ref_model=None, *, ref_model_factory=None, coef=1.0, in_keys=None, out_keys=None,
                 log_prob_key=("log_probs", "full"), device=None, add_to_reward: bool = True, tokenizer=None,
                 assistant_only: bool = True, padding_side: str = "left", use_ray_service: bool = False,
                 estimator: str = "k1", fused: bool = True):
        ref_model = _from_factory(ref_model, ref_model_factory, "ref_model")
        if ref_model is None:
            raise ValueError("Must provide exactly one of 'ref_model' or 'ref_model_factory'.")
        if use_ray_service:
            raise ValueError("use_ray_service=True is not supported by the kltriton drop-in")
        if getattr(ref_model, "generate", False):
            raise ValueError("The reference model must have generate=False to compute log-probs.")
        if getattr(ref_model, "input_mode", "tokens") != "tokens":
            raise ValueError("The ref_model must be configured with input_mode='tokens'.")
        in_keys = list(self.DEFAULT_IN_KEYS if in_keys is None else in_keys)
        out_keys = list(in_keys if out_keys is None else out_keys)
        if len(out_keys) == len(in_keys):
            out_keys = out_keys + ["kl_penalty", "ref_log_prob"]
        if len(in_keys) != 1 or len(out_keys) != 3:
            raise ValueError(f"Only one in_key/out_key is allowed, got in_keys={in_keys}, out_keys={out_keys}.")
        super().__init__(in_keys=in_keys + list(ref_model.in_keys), out_keys=out_keys)
        self.__dict__["ref_model"] = ref_model  # not a submodule, as in torchrl
        self.register_buffer("coef", torch.as_tensor(coef))
        self.log_prob_full_key = log_prob_key
        self.device = device
        self.add_to_reward = add_to_reward
        self._tokenizer = tokenizer
        self.assistant_only = assistant_only
        self.padding_side = padding_side
        self.estimator = estimators.canonical(estimator)
        if self.estimator == "full":
            raise ValueError("estimator='full' needs the policy logits; KLRewardTransform sees policy log-probs")
        self.fused = fused

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
                raise RuntimeError(f"Action with key {self.action_key} not found in {tensordict}")
            return next_tensordict
        source = tensordict if self.device is None else tensordict.to(self.device)
        out = _run(self.ref_model, source, self.fused, True)
        layout = _model_layout(self.ref_model, out)
        padded = layout == "padded"
        if _has_logits(out):
            logits, tokens = _read_as(out, "logits", layout), _read_as(out, TOKENS, layout)
            scored = _masks(out, source, layout, False)
            if padded:
                ref_logp = token_logprobs(logits, tokens, mask=scored)
            else:
                ref_logp = list(token_logprobs(torch.cat(logits), torch.cat(tokens),
                                               mask=torch.cat(scored)).split([t.numel() for t in tokens]))
        else:
            ref_logp = _read_as(out, (self.ref_model.log_probs_key, "full"), layout)
        cur_layout, logp = _read(source, self.log_prob_full_key)
        if logp is None:
            raise KeyError(f"the current log-probs {self.log_prob_full_key} are missing from the input")
        ref_logp, logp = _as_list(layout, ref_logp), _as_list(cur_layout, logp)
        if self.assistant_only:
            mask = self._response_mask(source)
            ref_logp = [r.masked_fill(~m.bool(), 0.0) for r, m in zip(ref_logp, mask)]
            logp = [c.masked_fill(~m.bool(), 0.0) for c, m in zip(logp, mask)]
        kl = _map(_kl_from_logprobs(self.estimator, None), "list", logp, ref_logp)
        kl = self._layout(kl, padded)
        ref_logp = self._layout([r.float() for r in ref_logp], padded)
        kl_layout = "padded" if padded else "nested"
        if self.add_to_reward:
            reward_layout, reward = _read(next_tensordict, self.in_keys[0])
            if reward is None:
                reward_layout, reward = kl_layout, _zeros_like_layout(kl_layout, kl)
            elif reward_layout == "padded" and not padded:  # one reward per sample, spread over its tokens
                reward_layout, reward = "nested", [r.expand(*k.shape, 1) for r, k in zip(reward, kl)]
            reward_layout, reward = _subtract_kl(reward_layout, reward, kl_layout, kl, self.coef)
            _write(next_tensordict, self.out_keys[0], reward_layout, reward)
        unsqueeze = (lambda x: x.unsqueeze(-1)) if padded else (lambda x: [t.unsqueeze(-1) for t in x])  # noqa: E731
        _write(next_tensordict, self.out_keys[1], kl_layout, unsqueeze(kl))
        _write(next_tensordict, self.out_keys[2], kl_layout, unsqueeze(ref_logp))
        return next_tensordict

    def _response_mask(self, tensordict):
        """Per-sample masks: the assistant mask, else everything after the prompt."""
        layout, mask = _read(tensordict, ASSISTANT_MASK)
        if mask is not None:
            return _as_list(layout, mask)
        layout, attention = _read(tensordict, ATTENTION_MASK)
        prompt_layout, prompt = _read(tensordict, ("tokens", "prompt"))
        if attention is None or prompt is None:
            raise KeyError(f"assistant_only=True needs {ASSISTANT_MASK}, or {ATTENTION_MASK} and ('tokens', 'prompt')")
        masks = [m.bool().clone() for m in _as_list(layout, attention)]
        lengths = [prompt.shape[-1]] * len(masks) if prompt_layout == "padded" else [p.shape[-1] for p in prompt]
        for m, n in zip(masks, lengths):
            m[..., :n] = False
        return masks

    def _layout(self, values, padded):
        if padded:
            return pad_sequence(values, batch_first=True, padding_value=0.0, padding_side=self.padding_side)
        return values


def _zeros_like_layout(layout, kl):
    if layout == "padded":
        return torch.zeros_like(kl).unsqueeze(-1)
    return [torch.zeros_like(k).unsqueeze(-1) for k in kl]


# ---------------------------------------------------------------------------------------------
# KL controllers with torchrl's signatures
# ---------------------------------------------------------------------------------------------

class AdaptiveKLController:
    """torchrl's ``AdaptiveKLController(init_kl_coef=, target=, horizon=, model=None)`` on
    ``kltriton.controllers.AdaptiveKLController``.

    ``update(kl_values)`` takes torchrl's logged reward terms ``-coef * kl`` (a list of floats or a
    tensor) and returns the new coefficient, also kept in ``.coef`` / ``.value`` and written to
    ``model.kl_coef`` when a model is given.
    """

    def __init__(self, *, init_kl_coef: float, target: float, horizon: int, model=None):
        self.controller = controllers.AdaptiveKLController(init_kl_coef, target, horizon)
        self.model = model
        self.target, self.horizon = self.controller.target, self.controller.horizon
        if model is not None:
            model.kl_coef = self.coef

    @property
    def coef(self) -> float:
        return self.controller.value

    value = coef

    def update(self, kl_values) -> float:
        coef = self.controller.update_from_reward_kl(kl_values)
        if self.model is not None:
            self.model.kl_coef = coef
        return coef


class ConstantKLController:
    """torchrl's ``ConstantKLController(kl_coef=, model=None)``: ``update`` changes nothing."""

    def __init__(self, *, kl_coef: float = None, model=None):
        self.controller = controllers.ConstantKLController(kl_coef)
        self.model = model
        if model is not None:
            model.kl_coef = self.coef

    @property
    def coef(self) -> float:
        return self.controller.value

    value = coef

    def update(self, kl_values=None) -> float:
        return self.coef
