"""The stream family's per-row statistics, declared once.

Every statistic of a row of logits ``x`` (policy, ``p = softmax(x / T)``) and optionally reference logits
``y`` (``q = softmax(y / T)``) is one ``Statistic`` here, in the order of ``constants.STATISTICS``. From
this table follow:

- ``StreamStats``, the bundle every stream kernel, custom op and merge returns (absent ones ``[0]``);
- ``merge``: the exact statistics of whole rows from those of contiguous vocab pieces (kernel tiles,
  ``LinearLogits`` vocab tiles, vocab-parallel shards), each computed as if its piece were the row;
- ``gradient_basis``: the backward's per-row coefficients on ``constants.GRADIENT_BASIS`` from the
  upstream gradients of the differentiable statistics, so no kernel knows which statistics exist.

A statistic that cannot be merged from pieces this way (a mixture such as a JSD, a threshold such as
top-p) is not a member: it is a family of its own with its own passes.

Merge notation, per row and piece ``k``: ``lse_k`` the piece's log-sum-exp, ``shift_k = lse_k - lse``
(``<= 0``) and ``w_k = exp(shift_k)`` its share of the policy's mass (``ref_shift_k``, ``ref_w_k`` the
reference's). Every merged term is centred on the global value, so no large log-sum-exp cancels against
another; the sum over ``k`` runs in piece order, so a row never depends on other rows.
"""
import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from kltriton.kernels import constants

# ``logp`` / ``ref_logp`` of a piece that does not hold the label (a real log-prob is <= 0 or NaN).
LABEL_ELSEWHERE = float("inf")
# ``is_top1`` of a piece that does not hold the label and lies before it (a real value is 0.0, 1.0 or NaN): a tie with
# such a piece's maximum goes to it (argmax's rule), whatever the order the pieces come in.
PIECE_BEFORE_LABEL = -1.0


class Pieces(NamedTuple):
    """The local statistics of ``K`` vocab pieces of ``N`` rows, and their mass shares."""
    local: dict                        # name -> [K, N] local value (present statistics only)
    shift: torch.Tensor                # [K, N] lse_k - lse
    w: torch.Tensor                    # [K, N] exp(shift)
    ref_shift: Optional[torch.Tensor]  # [K, N] with a reference
    ref_w: Optional[torch.Tensor]


class Basis(NamedTuple):
    """Per-row coefficients (``[N]`` float64, before the division by ``T``) on ``constants.GRADIENT_BASIS``:
    ``grad = label * onehot - p * (p + p_logp * log p + p_logq * log q) - q * q``; None: the term is absent."""
    label: torch.Tensor
    p: torch.Tensor
    p_logp: Optional[torch.Tensor] = None
    p_logq: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None

    def reads_ref(self) -> bool:
        """Whether a term needs the reference logits (and their log-sum-exp): ``log q`` or ``q``."""
        return self.p_logq is not None or self.q is not None


class Statistic(NamedTuple):
    name: str
    request: int     # the request bit that computes it (0: always)
    merge: Callable  # (Pieces) -> [N] value of whole rows
    # (g, value, basis) -> basis with this statistic's gradient term added; None: not differentiable
    # (the reference gets no gradient; lse is saved state).
    gradient: Optional[Callable] = None


def weighted_sum(w: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k * values_k``; a piece of zero mass adds 0 even where its value is ``inf``/NaN (an all
    ``-inf`` piece has NaN statistics). NaN weights propagate."""
    return torch.where(w == 0, torch.zeros((), dtype=w.dtype, device=w.device), w * values).sum(0)


def _label_logp(label_logp: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The label's global log-prob from the piece that holds it; NaN where no piece does. A piece without
    mass (``shift = -inf``, its local log-probs NaN) gives its label ``-inf``."""
    here = label_logp != LABEL_ELSEWHERE
    zero = torch.zeros((), dtype=shift.dtype, device=shift.device)
    held = torch.where(shift == float("-inf"), shift, label_logp + shift)
    value = torch.where(here, held, zero).sum(0).clamp(max=0)
    return torch.where(here.any(0), value, torch.full((), float("nan"), dtype=shift.dtype, device=shift.device))


def _times(g: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``g * value`` with ``0 * inf`` read as 0: a zero upstream gradient adds nothing even where the
    statistic is infinite (a full KL of ``inf`` where the reference bans a token the policy uses)."""
    return torch.where(g == 0, torch.zeros((), dtype=g.dtype, device=g.device), g * value)


def _add(term: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    return value if term is None else term + value


def _logp_gradient(g, value, basis: Basis) -> Basis:
    """``g * (onehot - p)``."""
    return basis._replace(label=basis.label + g, p=basis.p + g)


def _entropy_gradient(g, value, basis: Basis) -> Basis:
    """``-g * p * (log p + H)``."""
    return basis._replace(p=basis.p + _times(g, value), p_logp=_add(basis.p_logp, g))


def _full_kl_gradient(g, value, basis: Basis) -> Basis:
    """``g * p * (log p - log q - KL)``."""
    return basis._replace(p=basis.p + _times(g, value), p_logp=_add(basis.p_logp, -g), p_logq=_add(basis.p_logq, g))


def _forward_kl_gradient(g, value, basis: Basis) -> Basis:
    """``g * (p - q)``."""
    return basis._replace(p=basis.p - g, q=_add(basis.q, g))


def _kl_pieces(w, local_kl, shift, other_shift):
    """``KL(a || b)`` of whole rows from pieces: ``sum_k w_k (KL_k + shift_k - other_shift_k)`` (``w``, ``shift``: the
    shares of ``a``, ``other_shift``: of ``b``). A piece where ``a`` has mass and ``b`` none adds ``+inf`` (its local
    KL, of a ``b`` that is all ``-inf``, is NaN)."""
    inf = torch.full((), float("inf"), dtype=w.dtype, device=w.device)
    return weighted_sum(w, torch.where(other_shift == float("-inf"), inf, local_kl + shift - other_shift))


def _logsumexp(name):
    return lambda pieces: torch.logsumexp(pieces.local[name], 0)


def _log_sum_sq_probs(pieces: Pieces) -> torch.Tensor:
    """``log sum_v p_v^2`` of whole rows: ``logsumexp_k (local_k + 2 shift_k)`` (a piece's ``p = w_k p_k``); a piece
    without mass (its local value NaN) adds nothing."""
    terms = pieces.local["log_sum_sq_probs"] + 2 * pieces.shift
    return torch.logsumexp(torch.where(pieces.w == 0, torch.full_like(terms, float("-inf")), terms), 0)


def _is_top1(pieces: Pieces) -> torch.Tensor:
    """Whether the label is the whole row's first maximum: it is its own piece's (local 1.0), that piece's max
    (``max_logit``) is above the max of every piece before the label (marked ``PIECE_BEFORE_LABEL``) and at least that
    of every other piece. NaN where no piece holds the label or the row has no distribution (as the kernels)."""
    here = pieces.local["logp"] != LABEL_ELSEWHERE
    local, peak = pieces.local["is_top1"], pieces.local["max_logit"]
    ninf = torch.full((), float("-inf"), dtype=peak.dtype, device=peak.device)
    earlier = ~here & (local == PIECE_BEFORE_LABEL)
    before = torch.where(earlier, peak, ninf).amax(0)
    after = torch.where(~here & ~earlier, peak, ninf).amax(0)
    label_peak = torch.where(here & (local == 1), peak, ninf).amax(0)  # -inf: the label is not its piece's first max
    wins = here.any(0) & (label_peak > before) & (label_peak >= after) & (label_peak > float("-inf"))
    lse = torch.logsumexp(pieces.local["lse"], 0)
    value = wins.to(peak.dtype)
    nan = torch.full((), float("nan"), dtype=peak.dtype, device=peak.device)
    return torch.where(here.any(0) & (lse > float("-inf")) & (lse < float("inf")), value, nan)


SPECS = {
    "logp": Statistic("logp", 0, lambda pc: _label_logp(pc.local["logp"], pc.shift), _logp_gradient),
    "lse": Statistic("lse", 0, _logsumexp("lse")),
    "entropy": Statistic("entropy", constants.ENTROPY,
                         lambda pc: weighted_sum(pc.w, pc.local["entropy"] - pc.shift), _entropy_gradient),
    "ref_logp": Statistic("ref_logp", constants.REF, lambda pc: _label_logp(pc.local["ref_logp"], pc.ref_shift)),
    "ref_lse": Statistic("ref_lse", constants.REF, _logsumexp("ref_lse")),
    "full_kl": Statistic("full_kl", constants.FULL_KL,
                         lambda pc: _kl_pieces(pc.w, pc.local["full_kl"], pc.shift, pc.ref_shift),
                         _full_kl_gradient),
    # KL(q || p): the reference's mass shares weigh the pieces.
    "forward_kl": Statistic("forward_kl", constants.FORWARD_KL,
                            lambda pc: _kl_pieces(pc.ref_w, pc.local["forward_kl"], pc.ref_shift, pc.shift),
                            _forward_kl_gradient),
    # A trainer head's metrics, no gradient: is_top1 (1.0 / 0.0), the sum of the logits / T times
    # constants.LOGIT_SUM_SCALE (the mean is sum / V / scale), log sum p^2, and the row's largest logit (before T),
    # which is_top1's merge reads.
    "is_top1": Statistic("is_top1", constants.HEAD, _is_top1),
    "sum_logits": Statistic("sum_logits", constants.HEAD, lambda pc: pc.local["sum_logits"].sum(0)),
    "log_sum_sq_probs": Statistic("log_sum_sq_probs", constants.HEAD, _log_sum_sq_probs),
    "max_logit": Statistic("max_logit", constants.HEAD, lambda pc: pc.local["max_logit"].amax(0)),
}
STATISTICS: Tuple[Statistic, ...] = tuple(SPECS[name] for name, _ in constants.STATISTICS)
assert all(SPECS[name].request == bit for name, bit in constants.STATISTICS)
NAMES = tuple(s.name for s in STATISTICS)
DIFFERENTIABLE = tuple(s.name for s in STATISTICS if s.gradient is not None)

StreamStats = NamedTuple("StreamStats", [(name, torch.Tensor) for name in NAMES])
StreamStats.__doc__ = ("Per-row statistics ``[N]`` in ``constants.STATISTICS`` order; one not requested is an "
                       "empty ``[0]`` tensor.")
# The return annotation of a custom op that returns ``StreamStats`` (its schema is inferred from it).
StatsTuple = Tuple[(torch.Tensor,) * len(NAMES)]


def request(*, entropy=False, ref=False, full_kl=False, forward_kl=False, head=False) -> int:
    """The request bits of a forward (``full_kl`` and ``forward_kl`` need ``ref``; ``head``, the trainer head's
    ``is_top1`` / ``mean_logits`` / ``log_sum_sq_probs``, is for policy rows only: never with ``ref``)."""
    if (full_kl or forward_kl) and not ref:
        raise ValueError("the full KL needs reference logits")
    if head and ref:
        raise ValueError("the head statistics (is_top1, mean_logits, log_sum_sq_probs) are of the policy alone")
    return ((constants.ENTROPY if entropy else 0) | (constants.REF if ref else 0)
            | (constants.FULL_KL if full_kl else 0) | (constants.FORWARD_KL if forward_kl else 0)
            | (constants.HEAD if head else 0))


def present(request: int, name: str) -> bool:
    """Whether a forward with request ``request`` computes statistic ``name``."""
    bit = SPECS[name].request
    return bit == 0 or bool(request & bit)


def empty_stats(n: int, request: int, new: Callable) -> StreamStats:
    """``StreamStats`` of ``new(n)`` for the statistics ``request`` computes and one ``new(0)`` for all the others
    (each allocation costs the host a microsecond; a registered op's outputs are made distinct by ``ops._define``)."""
    absent = new(0)
    return StreamStats(*(new(n) if here else absent for here in _presence(request)))


@functools.lru_cache(maxsize=None)
def _presence(request: int) -> Tuple[bool, ...]:
    """``present(request, name)`` of every name, in ``NAMES`` order."""
    return tuple(present(request, name) for name in NAMES)


def mark_pieces(local: dict, holds_label: torch.Tensor, before_label: torch.Tensor) -> dict:
    """``local`` (name -> ``[K, N]`` or ``[N]`` values of pieces) with the marks ``merge`` reads: ``LABEL_ELSEWHERE``
    in ``logp`` / ``ref_logp`` where the piece does not hold the row's label (``holds_label``, bool like the values),
    ``PIECE_BEFORE_LABEL`` in ``is_top1`` where it lies before it (``before_label``)."""
    marked = dict(local)
    for name in ("logp", "ref_logp"):
        if name in marked:
            marked[name] = torch.where(holds_label, marked[name], LABEL_ELSEWHERE)
    if "is_top1" in marked:
        marked["is_top1"] = torch.where(before_label, PIECE_BEFORE_LABEL, marked["is_top1"])
    return marked


def merge(local: dict, request: int) -> StreamStats:
    """Whole-row ``StreamStats`` from ``local``: name -> ``[K, N]`` statistics of ``K`` contiguous vocab pieces
    (``logp`` / ``ref_logp``: ``LABEL_ELSEWHERE`` on the pieces that do not hold the label; ``is_top1``:
    ``PIECE_BEFORE_LABEL`` on those that lie before it, ``mark_pieces``). A row whose label lies in
    no piece gets NaN log-probs; a row whose pieces are all ``-inf`` gets ``lse = -inf`` and NaN statistics,
    as the kernels do for a whole row."""
    lse = torch.logsumexp(local["lse"], 0)
    shift = local["lse"] - lse
    ref_shift = None
    if request & constants.REF:
        ref_shift = local["ref_lse"] - torch.logsumexp(local["ref_lse"], 0)
    pieces = Pieces(local, shift, shift.exp(), ref_shift, None if ref_shift is None else ref_shift.exp())
    return StreamStats(*(s.merge(pieces) if present(request, s.name) else shift.new_empty(0) for s in STATISTICS))


def gradient_basis(grads: dict, stats: StreamStats, temperature: torch.Tensor) -> Basis:
    """The backward's per-row coefficients (``[N]`` in the statistics' dtype, divided by ``T``) for upstream
    gradients ``grads``: name -> ``[N]`` gradient of a differentiable statistic (None, or a statistic the
    forward did not compute: no term).
    Computed in float64."""
    zero = torch.zeros_like(stats.lse, dtype=torch.float64)
    basis = Basis(zero, zero)
    for name in DIFFERENTIABLE:
        g, value = grads.get(name), getattr(stats, name)
        if g is not None and value.shape == stats.lse.shape:  # an absent statistic has no gradient term
            basis = SPECS[name].gradient(g.double(), value.double(), basis)
    inv_t = 1.0 / temperature.double()
    return Basis(*(None if c is None else (c * inv_t).to(stats.lse.dtype).contiguous() for c in basis))
