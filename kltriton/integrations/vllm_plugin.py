"""kltriton as vLLM's log-prob function: the ``kltriton`` entry point of the ``vllm.general_plugins`` group.

With ``VLLM_PLUGINS=kltriton`` (vLLM 0.32 or 0.33), every log-prob vLLM returns is what ``kltriton.token_logprobs``
returns for the same logits and the request's own knobs, bit for bit, so a trainer that scores the same logits with
kltriton computes the same numbers; what vLLM samples does not change. See ``docs/engine.md``.

- ``logprobs_mode="raw_logprobs"`` (vLLM's default) and prompt log-probs: ``token_logprobs(logits, ids)``.
- ``logprobs_mode="processed_logprobs"``: ``token_logprobs(logits, ids, temperature=T, truncation=Truncation(
  top_k=, top_p=, min_p=))`` with the request's ``SamplingParams`` values as Python numbers (vLLM's fp32 copies
  would change some log-probs), on the logits vLLM tempers (after its penalties and logit processors); greedy
  requests: temperature 1, no truncation, as vLLM.
- ``raw_logits`` / ``processed_logits`` return logits, not log-probs: left as vLLM returns them.

What is hooked (all restored by ``undo()``):

- V1 model runner (vLLM's default on CPU; on CUDA where Model Runner V2 is off): ``GPUModelRunner._sample`` and
  ``_get_prompt_logprobs_dict`` (which requests a step scores), ``Sampler.compute_logprobs`` (raw log-probs),
  ``Sampler.sample`` (processed log-probs, from ``TopKTopPSampler``), ``Sampler.gather_logprobs`` and
  ``gather_specific_token_logprobs`` (the returned values are rescored at the returned ids).
- Model Runner V2 (vLLM's default on CUDA): ``vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs`` (also
  where ``prompt_logprob`` imported it), and for processed log-probs ``Sampler.add_request`` / ``__call__`` /
  ``sample`` and ``SamplingStates.apply_temperature`` (the request's knobs and the logits before temperature).

Not replaced, with a warning and a count: speculative decoding (the rejection sampler's log-probs),
``logprobs=-1`` (the whole vocabulary: ``V`` ids per row).

Where vLLM's sampler and kltriton's truncation keep different sets (a tie at the top-p cut that vLLM's sort
splits, or a cut within rounding), the row's log-probs are kltriton's (the contract) but the engine sampled from
another set: each such row is counted (``counters()["kept_set_mismatches"]``) and logged.
"""
import contextlib
import contextvars
import dataclasses
import logging
import os
import re
from typing import List, Optional

import torch

import kltriton
from kltriton.dropins import NO_IGNORE
from kltriton.integrations._patch import IntegrationError, Patch

logger = logging.getLogger(__name__)

SUPPORTED = ("0.32", "0.33")
PLUGIN_NAME = "kltriton"
_MISMATCH_CHECK_EVERY = 128  # scoring calls between two reads of the (device) mismatch count


# ----------------------------------------------------------------------------------------- multi-id scoring
def _per_column(value, rows: int, columns: int):
    """A knob with one value per row (``[N]`` tensor) as one per ``[N, K]`` position; numbers as they are."""
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        if value.shape[0] != rows:
            raise ValueError(f"per-row knobs must have shape [N] = [{rows}], got {tuple(value.shape)}")
        return value[:, None].expand(rows, columns)
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise ValueError(f"knobs must be numbers, 0-dim or [N] tensors, got shape {tuple(value.shape)}")
    return value


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor, *, temperature=1.0, truncation=None,
                backend: Optional[str] = None) -> torch.Tensor:
    """Log-probs of ``K`` ids per row, as vLLM returns them (the sampled token and the top-k entries).

    Args:
        logits: ``[N, V]``.
        ids: ``[N, K]`` integer token ids in ``[0, V)``.
        temperature: a python float or a floating ``[N]`` tensor (one per row).
        truncation: ``None`` or a ``kltriton.Truncation`` whose knobs are python numbers or ``[N]`` tensors
            (recompute), or whose ``support`` is ``[N, S]`` (replay).
        backend: as for ``kltriton.token_logprobs``.
    Returns:
        fp32 ``[N, K]``: entry ``[n, k]`` is bitwise ``kltriton.token_logprobs(logits[n:n+1], ids[n, k:k+1],
        temperature=T_n, truncation=<row n's knobs>)[0]``.

    One ``token_logprobs`` call, no Python loop: the ``K`` columns read their row through a stride-0 view (no copy
    of the logits), each scored exactly as a single label is, so values are those of the one-label call and do not
    depend on ``K`` or on the other rows. The cost is ``K`` passes over the row (``K`` times the truncation's
    passes in recompute mode).
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"ids must be an integer tensor [N, K], got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != ids.shape[0]:
        raise ValueError(f"logits must be [N, V] with N = ids.shape[0] = {ids.shape[0]}, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    rows, columns = ids.shape
    if truncation is not None:
        if not isinstance(truncation, kltriton.Truncation):
            raise TypeError(f"truncation must be a kltriton.Truncation or None, got {type(truncation).__name__}")
        if truncation.replay:
            support = truncation.support
            truncation = kltriton.Truncation(
                support=support[:, None, :].expand(rows, columns, support.shape[-1]))
        else:
            truncation = kltriton.Truncation(**{name: _per_column(getattr(truncation, name), rows, columns)
                                                for name in ("top_k", "top_p", "min_p")})
    repeated = logits.unsqueeze(1).expand(rows, columns, logits.shape[-1])  # stride 0 over K: no copy
    return kltriton.token_logprobs(repeated, ids.long(), temperature=_per_column(temperature, rows, columns),
                                   truncation=truncation, ignore_index=NO_IGNORE, backend=backend)


# ----------------------------------------------------------------------------------------------- counters
@dataclasses.dataclass
class _Counters:
    rows: int = 0                    # rows rescored (one per scored position)
    logprobs: int = 0                # log-prob values replaced
    checked_rows: int = 0            # rows whose kept set was compared with vLLM's (processed mode)
    unreplaced_steps: int = 0        # steps whose log-probs stayed vLLM's (see the module docstring)
    calls: int = 0
    mismatches: Optional[torch.Tensor] = None  # device count, read every _MISMATCH_CHECK_EVERY calls
    logged_mismatches: int = 0


_counters = _Counters()
_warned = set()


def counters() -> dict:
    """This process's counts since the plugin was applied (or ``reset_counters()``): ``rows`` and ``logprobs``
    rescored, ``checked_rows`` (processed rows whose kept set was compared with vLLM's), ``kept_set_mismatches``
    (rows where vLLM's sampler kept another set than kltriton's truncation: a tie at a threshold), and
    ``unreplaced_steps``. Reads the mismatch count from the device (a sync). vLLM's workers are other processes
    unless the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or TRL's colocated vLLM): there the
    counts are logged (logger ``kltriton.integrations.vllm_plugin``)."""
    mismatches = 0 if _counters.mismatches is None else int(_counters.mismatches.item())
    return {"rows": _counters.rows, "logprobs": _counters.logprobs, "checked_rows": _counters.checked_rows,
            "kept_set_mismatches": mismatches, "unreplaced_steps": _counters.unreplaced_steps}


def reset_counters() -> None:
    global _counters
    _counters = _Counters()


def _unreplaced(reason: str) -> None:
    _counters.unreplaced_steps += 1
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("kltriton vLLM plugin: %s: these log-probs are vLLM's own, not kltriton's", reason)


def _count_mismatches(mismatch: torch.Tensor) -> None:
    """Add the rows of ``mismatch`` ([N] bool) to the device count; read it back (a sync) only every
    ``_MISMATCH_CHECK_EVERY`` calls, and log when it grew."""
    total = mismatch.sum()
    _counters.mismatches = total if _counters.mismatches is None else _counters.mismatches + total
    _counters.checked_rows += mismatch.shape[0]
    _counters.calls += 1
    if _counters.calls % _MISMATCH_CHECK_EVERY == 1:
        seen = int(_counters.mismatches.item())
        if seen > _counters.logged_mismatches:
            _counters.logged_mismatches = seen
            logger.warning("kltriton vLLM plugin: %d of %d processed rows so far had a kept set other than vLLM's "
                           "sampler's (a tie or a rounding at a top-p / min-p threshold): their log-probs are "
                           "kltriton's, the token was sampled from vLLM's set", seen, _counters.checked_rows)


# ------------------------------------------------------------------------------------------ what is scored
@dataclasses.dataclass
class _Source:
    """What vLLM's ``[N, V]`` log-probs ``output`` stand for: kltriton scores ``logits`` with these knobs."""
    output: torch.Tensor                      # kept alive: sources are found by identity
    logits: torch.Tensor                      # [N, V]
    temperature: object = 1.0                 # 1.0 or float64 [N]
    truncation: Optional[kltriton.Truncation] = None
    edges: Optional[torch.Tensor] = None      # [N, 2]: vLLM's lowest kept, highest dropped logit (processed)
    any_dropped: Optional[torch.Tensor] = None  # [N] bool


@dataclasses.dataclass
class _Scope:
    """One scoring step: ``kind`` "sample" (V1), "prompt" (V1) or "v2"; ``params`` the rows' SamplingParams."""
    kind: str
    params: Optional[list] = None
    sources: dict = dataclasses.field(default_factory=dict)
    inside_sample: bool = False
    pre_temperature: Optional[torch.Tensor] = None  # v2: the logits before temperature
    processed: Optional[torch.Tensor] = None        # v2: the processed logits the sampler returned

    def add(self, source: _Source) -> None:
        self.sources[id(source.output)] = source

    def source_of(self, output) -> Optional[_Source]:
        source = self.sources.get(id(output))
        return source if source is not None and source.output is output else None


_scope: contextvars.ContextVar = contextvars.ContextVar("kltriton_vllm_scope", default=None)


@contextlib.contextmanager
def _scoring(scope: _Scope):
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def _knobs(params: List, device, greedy) -> tuple:
    """``(temperature [N] float64, Truncation | None)`` of the rows' SamplingParams, as Python values (exact in
    float64). ``greedy(p)``: whether vLLM samples the row greedily (then temperature 1 and, as SamplingParams
    sets them, no truncation)."""
    temperature = [1.0 if greedy(p) else float(p.temperature) for p in params]
    top_k = [int(p.top_k) for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]

    def as_tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    truncation = None
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p) or any(m > 0.0 for m in min_p):
        truncation = kltriton.Truncation(top_k=as_tensor(top_k, torch.int64), top_p=as_tensor(top_p, torch.float64),
                                         min_p=as_tensor(min_p, torch.float64))
    return as_tensor(temperature, torch.float64), truncation


def _kept_set_edges(processed: torch.Tensor, logits: torch.Tensor):
    """vLLM's kept set of each row (its processed values that are not ``-inf``) by its two edges: ``[N, 2]`` ids
    of the lowest kept and the highest dropped logit, and ``[N]`` whether any is dropped. kltriton's kept set is
    every logit at or above a floor, so the sets are equal exactly when kltriton keeps the first id and drops the
    second (a tie across vLLM's cut fails one of the two)."""
    kept = processed > float("-inf")
    lowest_kept = torch.where(kept, logits, float("inf")).argmin(-1)
    highest_dropped = torch.where(kept, float("-inf"), logits).argmax(-1)
    return torch.stack((lowest_kept, highest_dropped), 1), (~kept).any(-1)


def _processed_source(output, logits, params, greedy) -> _Source:
    temperature, truncation = _knobs(params, logits.device, greedy)
    edges, any_dropped = _kept_set_edges(output, logits)
    return _Source(output, logits, temperature, truncation, edges, any_dropped)


def _rescore(source: _Source, ids: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """kltriton's log-probs of ``ids [N, K]`` for ``source`` (``-inf`` where ``valid`` is False), and the kept-set
    comparison of processed rows, in one ``logprobs_at`` call."""
    ids = ids.long()
    columns = ids if source.edges is None else torch.cat((ids, source.edges), 1)
    values = logprobs_at(source.logits, columns, temperature=source.temperature, truncation=source.truncation)
    if source.edges is not None:
        edges, values = values[:, -2:], values[:, :-2]
        keeps_lowest = edges[:, 0] > float("-inf")
        drops_highest = edges[:, 1] == float("-inf")
        _count_mismatches(~keeps_lowest | (source.any_dropped & ~drops_highest))
    if valid is not None:
        values = values.masked_fill(~valid, float("-inf"))
    _counters.rows += ids.shape[0]
    _counters.logprobs += ids.numel()
    return values.contiguous()


# --------------------------------------------------------------------------------------- V1 model runner
def _install_v1(patch: Patch) -> None:
    from vllm.v1.sample import sampler as v1_sampler
    from vllm.v1.worker import gpu_model_runner

    # vllm_runner / vllm_sampler: vLLM's own methods that the replacements below call (patch.replace, at the end)
    eps = patch.resolve(v1_sampler, "_SAMPLING_EPS")
    greedy = lambda p: p.temperature < eps  # noqa: E731  (V1: Sampler.apply_temperature, InputBatch.greedy_reqs)

    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        metadata = self.input_batch.sampling_metadata
        wants = metadata.max_num_logprobs is not None or bool(metadata.logprob_token_ids)
        if logits is None or not wants:
            return vllm_runner._sample(self, logits, spec_decode_metadata, *args, **kwargs)
        if spec_decode_metadata is not None:
            _unreplaced("speculative decoding (the rejection sampler computes the log-probs)")
            return vllm_runner._sample(self, logits, spec_decode_metadata, *args, **kwargs)
        if metadata.max_num_logprobs == -1:
            _unreplaced("logprobs=-1 (the whole vocabulary)")
        params = [self.requests[req_id].sampling_params for req_id in self.input_batch.req_ids]
        if len(params) != logits.shape[0]:
            _unreplaced(f"a step with {logits.shape[0]} logit rows for {len(params)} requests")
            return vllm_runner._sample(self, logits, spec_decode_metadata, *args, **kwargs)
        with _scoring(_Scope("sample", params)):
            return vllm_runner._sample(self, logits, spec_decode_metadata, *args, **kwargs)

    def _get_prompt_logprobs_dict(self, *args, **kwargs):
        with _scoring(_Scope("prompt")):
            return vllm_runner._get_prompt_logprobs_dict(self, *args, **kwargs)

    def compute_logprobs(logits):
        output = vllm_sampler.compute_logprobs(logits)
        scope = _scope.get()
        if scope is not None and not scope.inside_sample:
            # A sampling step goes on to temper these fp32 logits in place: score a copy.
            kept = logits.clone() if scope.kind == "sample" and logits.dtype == torch.float32 else logits
            scope.add(_Source(output, kept))
        return output

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None, *args, **kwargs):
        scope = _scope.get()
        processed_mode = (logprobs_mode_override or self.logprobs_mode) == "processed_logprobs"
        wants = sampling_metadata.max_num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
        if scope is None or scope.kind != "sample" or not processed_mode or not wants:
            return vllm_sampler.sample(self, logits, sampling_metadata, logprobs_mode_override, *args, **kwargs)
        before_temperature = logits.clone()  # after vLLM's penalties and logit processors
        scope.inside_sample = True
        try:
            sampled, processed = vllm_sampler.sample(self, logits, sampling_metadata, logprobs_mode_override, *args,
                                                     **kwargs)
        finally:
            scope.inside_sample = False
        if processed is not None:
            scope.add(_processed_source(processed, before_temperature, scope.params, greedy))
        return sampled, processed

    def gather_logprobs(logprobs, num_logprobs, token_ids):
        output = vllm_sampler.gather_logprobs(logprobs, num_logprobs, token_ids)
        scope = _scope.get()
        source = None if scope is None else scope.source_of(logprobs)
        return output if source is None else output._replace(logprobs=_rescore(source, output.logprob_token_ids))

    def gather_specific_token_logprobs(self, logprobs, logprob_token_ids, sampled):
        output = vllm_sampler.gather_specific_token_logprobs(self, logprobs, logprob_token_ids, sampled)
        scope = _scope.get()
        source = None if scope is None or output is None else scope.source_of(logprobs)
        if source is None:
            return output
        valid = torch.zeros(output.logprob_token_ids.shape, dtype=torch.bool)
        valid[:, 0] = True  # the sampled token, then each request's own ids (vLLM pads the rest)
        for row, ids in logprob_token_ids.items():
            valid[row, 1:1 + len(ids)] = True
        valid = valid.to(logprobs.device, non_blocking=True)
        return output._replace(logprobs=_rescore(source, output.logprob_token_ids, valid))

    vllm_runner = patch.replace(gpu_model_runner.GPUModelRunner, _sample=_sample,
                                _get_prompt_logprobs_dict=_get_prompt_logprobs_dict)
    vllm_sampler = patch.replace(v1_sampler.Sampler, compute_logprobs=staticmethod(compute_logprobs), sample=sample,
                                 gather_logprobs=staticmethod(gather_logprobs),
                                 gather_specific_token_logprobs=gather_specific_token_logprobs)


# ------------------------------------------------------------------------------------------ Model Runner V2
def _install_v2(patch: Patch) -> None:
    import numpy as np
    from vllm.v1.worker.gpu.sample import logprob as v2_logprob
    from vllm.v1.worker.gpu.sample import sampler as v2_sampler
    from vllm.v1.worker.gpu.sample import states as v2_states

    # vllm_sampler / vllm_states: vLLM's own methods that the replacements below call (patch.replace, at the end)
    vllm_compute_token_logprobs = patch.resolve(v2_logprob, "compute_token_logprobs")
    vllm_get_logprobs_dims = patch.resolve(v2_sampler.Sampler, "get_logprobs_dims")
    greedy = lambda p: p.temperature == 0.0  # noqa: E731  (V2: SamplingStates.any_greedy, the temperature kernel)

    def compute_token_logprobs(logits, token_ids):
        """Model Runner V2's ``compute_token_logprobs`` (``[B, V]`` logits, ``[B, K]`` ids -> fp32 ``[B, K]``
        log-probs), by kltriton: the raw logits' log-probs, or for the processed logits of the running
        ``Sampler`` call, those of the logits before temperature under the requests' knobs."""
        scope = _scope.get()
        if scope is not None and scope.kind == "v2" and logits is scope.processed:
            # No logit processing at all (every row greedy or at temperature 1 without knobs): vLLM returned
            # its raw logits as the processed ones.
            before = scope.pre_temperature if scope.pre_temperature is not None else logits
            return _rescore(_processed_source(logits, before, scope.params, greedy), token_ids)
        return _rescore(_Source(logits, logits), token_ids)

    def add_request(self, req_idx, sampling_params, *args, **kwargs):
        vllm_sampler.add_request(self, req_idx, sampling_params, *args, **kwargs)
        self.__dict__.setdefault("_kltriton_params", {})[req_idx] = sampling_params

    def __call__(self, logits, input_batch, *args, **kwargs):
        if (self.logprobs_mode != "processed_logprobs"
                or vllm_get_logprobs_dims(self, input_batch.idx_mapping_np) is None):
            return vllm_sampler.__call__(self, logits, input_batch, *args, **kwargs)
        # one logit row per scheduled token of each request (several with speculative decoding)
        states = np.repeat(input_batch.idx_mapping_np, np.diff(input_batch.cu_num_logits_np))
        known = self.__dict__.get("_kltriton_params", {})
        if any(int(i) not in known for i in states):
            _unreplaced("requests added before the plugin was applied (processed log-probs of their logits as "
                        "vLLM processed them)")
            return vllm_sampler.__call__(self, logits, input_batch, *args, **kwargs)
        with _scoring(_Scope("v2", [known[int(i)] for i in states])):
            return vllm_sampler.__call__(self, logits, input_batch, *args, **kwargs)

    def sample(self, *args, **kwargs):
        sampled, processed = vllm_sampler.sample(self, *args, **kwargs)
        scope = _scope.get()
        if scope is not None and scope.kind == "v2":
            scope.processed = processed
        return sampled, processed

    def apply_temperature(self, logits, *args, **kwargs):
        scope = _scope.get()
        if scope is not None and scope.kind == "v2":
            scope.pre_temperature = logits.clone()  # after vLLM's penalties, bias and logit processors
        return vllm_states.apply_temperature(self, logits, *args, **kwargs)

    patch.swap("vllm", vllm_compute_token_logprobs, compute_token_logprobs)
    vllm_sampler = patch.replace(v2_sampler.Sampler, add_request=add_request, __call__=__call__, sample=sample)
    vllm_states = patch.replace(v2_states.SamplingStates, apply_temperature=apply_temperature)


# ------------------------------------------------------------------------------------------ apply / register
_current: Optional[Patch] = None
_installed: List[Patch] = []  # every Patch the plugin's changes were recorded on (apply()'s and integrations')


def check_version(version: Optional[str] = None) -> str:
    """``version`` (default: the installed vLLM's) if the plugin supports it, else a ``RuntimeError``."""
    if version is None:
        import vllm

        version = vllm.__version__
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or f"{match[1]}.{match[2]}" not in SUPPORTED:
        raise RuntimeError(f"kltriton's vLLM plugin supports vLLM {' and '.join(SUPPORTED)} (it replaces internal "
                           f"sampler functions of those versions), but vLLM {version} is installed. Install vllm "
                           f"0.32 or 0.33, or take 'kltriton' out of VLLM_PLUGINS (vLLM then returns its own "
                           f"log-probs).")
    return version


def install(patch: Patch) -> None:
    """Record the plugin's changes on ``patch`` (made by ``patch.commit()``): for integrations that apply it with
    their own changes (``kltriton.integrations.trl``)."""
    check_version()
    _install_v1(patch)
    _install_v2(patch)
    _installed[:] = [p for p in _installed if p.active] + [patch]


def apply() -> Patch:
    """Make this process's vLLM return kltriton's log-probs; returns the ``Patch`` (``.undo()``, or ``with``).
    All or nothing: an ``IntegrationError`` (nothing changed) when a hooked function is missing."""
    global _current
    if active():
        raise RuntimeError("kltriton's vLLM plugin is already applied (by apply(), VLLM_PLUGINS=kltriton or an "
                           "integration); undo that first")
    patch = Patch("vLLM")
    try:
        install(patch)
    except (AttributeError, ImportError) as err:
        raise IntegrationError(f"kltriton's vLLM plugin cannot patch this vLLM: it lacks {err}. Nothing was "
                               "changed.") from err
    patch.commit()
    reset_counters()
    _current = patch
    return patch


def undo() -> None:
    """Undo the current ``apply()`` (no-op when none is active)."""
    if _current is not None:
        _current.undo()


def active() -> bool:
    """Whether this process's vLLM returns kltriton's log-probs (by ``apply()``, the entry point or an
    integration)."""
    return any(patch.active for patch in _installed)


def register() -> None:
    """The ``vllm.general_plugins`` entry point, called by vLLM in each of its processes. Applies the plugin only
    when ``VLLM_PLUGINS`` names ``kltriton``: vLLM loads every installed general plugin when ``VLLM_PLUGINS`` is
    unset, and installing kltriton must not change an engine's numbers unasked."""
    named = [name.strip() for name in os.environ.get("VLLM_PLUGINS", "").split(",")]
    if PLUGIN_NAME not in named:
        logger.debug("kltriton vLLM plugin installed but not named in VLLM_PLUGINS: vLLM keeps its log-probs")
        return
    if not active():
        apply()
        logger.info("kltriton vLLM plugin: vLLM's log-probs are kltriton.token_logprobs' (pid %d)", os.getpid())
