"""A trainer head's statistics (``constants.HEAD``: ``is_top1``, ``sum_logits``, ``log_sum_sq_probs``, ``max_logit``)
of every ``stream`` backend against a float64 oracle written here from their definitions, on awkward inputs: ties before and
after the label (across vocab blocks and split-row chunks), ``-inf`` and ``finfo.min`` entries, large magnitudes,
every dtype, a temperature other than 1 and one per row.

Tolerances (every backend accumulates in fp32 whatever the logits' dtype; bf16 / fp16 logits are exact in fp32):
- ``is_top1``: exact (compares logits, never rounded values);
- ``log_sum_sq_probs``: ``64 eps32 (1 + s)`` with ``s`` the largest ``|x| / T`` of the row's entries that carry mass
  (``log p > -100``), as the log-sum-exp's own error;
- ``sum_logits`` (kept times ``LOGIT_SUM_SCALE``): ``1e-5`` of the row's ``sum |x| / T`` (fp32 lane sums of up to
  V / 16 terms) plus ``1e-30``;
- ``max_logit``: exact.
"""
import pytest
import torch

from kltriton import dispatch
from kltriton.kernels import constants, statistics
from kltriton.kernels import triton_rows as rows
from helpers import EPS32, assert_close

VOCABS = (1271, 401, 70_001)  # odd; not a multiple of any block; > 65,536 (Triton splits the row)


def _backend(name):
    """A ``stream`` kernel module of backend ``name``, or a skip where it cannot run here."""
    usable, why = dispatch.availability(name)
    if not usable:
        pytest.skip(f"{name} is not usable here: {why}")
    return dispatch.implementation("stream", name)


def oracle(x, target, temperature):
    """``(is_top1, sum_logits, log_sum_sq_probs, max_logit)`` in float64 by their definitions; 0 on rows not
    scored."""
    x64 = x.double()
    t = temperature.double().reshape(-1, 1) if temperature.dim() else temperature.double()
    z = x64 / t
    scored = target >= 0
    label = target.clamp(min=0)
    is_top1 = (x64.argmax(-1) == label).double()
    total = z.sum(-1)
    log_sum_sq = torch.logsumexp(2 * torch.log_softmax(z, -1), -1)
    zero = torch.zeros((), dtype=torch.float64)
    return tuple(torch.where(scored, v, zero) for v in (is_top1, total, log_sum_sq, x64.amax(-1)))


def tolerances(x, temperature):
    """Per-row ``(atol of log_sum_sq_probs, atol of sum_logits)`` (see the module's docstring)."""
    x64 = x.double()
    t = temperature.double().reshape(-1, 1) if temperature.dim() else temperature.double()
    z = x64 / t
    massive = torch.log_softmax(z, -1) > -100
    scale = torch.where(massive, z.abs(), torch.zeros((), dtype=torch.float64)).amax(-1)
    finite = torch.where(torch.isfinite(z), z.abs(), torch.zeros((), dtype=torch.float64))
    return 64 * EPS32 * (1 + scale), 1e-5 * finite.sum(-1) + 1e-30


def check(module, x, target, temperature):
    stats = module.forward(x, None, target, temperature, constants.HEAD | constants.ENTROPY)
    is_top1, total, log_sum_sq, max_logit = oracle(x, target, temperature)
    sq_atol, sum_atol = tolerances(x, temperature)
    assert torch.equal(stats.is_top1.double(), is_top1), (stats.is_top1, is_top1)
    assert torch.equal(stats.max_logit.double(), max_logit)
    total = total * constants.LOGIT_SUM_SCALE
    sum_atol = sum_atol * constants.LOGIT_SUM_SCALE
    for i in range(x.shape[0]):  # per-row tolerances
        assert_close(stats.log_sum_sq_probs[i:i + 1], log_sum_sq[i:i + 1], sq_atol[i].item(), what=f"row {i} sq")
        assert_close(stats.sum_logits[i:i + 1], total[i:i + 1], sum_atol[i].item(), what=f"row {i} sum")
    return stats


def tied_rows(vocab, dtype, gen):
    """Rows of fresh random logits with ties placed around the label, and their labels (one case per row):
    the label tied with an earlier index (False), with a later one (True), the unique max (True), below a max
    repeated before and after it (False), the max at index 0 / V - 1, ties across the row's halves (the vocab blocks
    and, for V > 65,536, the split chunks), awkward entries (``-inf``, ``finfo.min``, a row 40x larger)."""
    x = torch.randn(12, vocab, generator=gen) * 3.0
    target = torch.randint(0, vocab, (12,), generator=gen)
    top, far = 50.0, vocab - 7
    x[0, 3], x[0, far], target[0] = top, top, far           # tied with an earlier index: False
    x[1, 3], x[1, far], target[1] = top, top, 3             # tied with a later index: True
    x[2, vocab // 2], target[2] = top, vocab // 2           # the unique max: True
    x[3, [1, 5, far]] = top                                 # a max before and after a lower label: False
    target[3] = 9
    x[4, 0], target[4] = top, 0                             # at index 0: True
    x[5, vocab - 1], target[5] = top, vocab - 1             # at the last index (the tail): True
    x[6, vocab // 2 - 1], x[6, vocab // 2 + 1], target[6] = top, top, vocab // 2 + 1  # across halves: False
    x[7, :] = top                                           # all tied: only index 0 is the argmax
    target[7] = 0 if vocab % 2 else 1
    x[8, 5] = float("-inf")                                 # -inf entries: the sum is -inf
    x[8, target[8]] = 60.0
    x[9, :vocab // 3] = torch.finfo(dtype).min              # finfo.min padding: a finite sum
    x[10] *= 40.0                                           # large magnitudes
    target[11] = constants.SKIP                             # not scored: 0
    return x.to(dtype), target


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", VOCABS)
def test_head_statistics_match_float64(backend, dtype, vocab):
    if backend == "triton" and vocab > 65_536 and dtype != torch.float32:
        pytest.skip("the interpreter is slow; the split row is covered in fp32")
    module = _backend(backend)
    gen = torch.Generator().manual_seed(vocab + 7 * DTYPE_SEED[dtype])
    x, target = tied_rows(vocab, dtype, gen)
    for temperature in (torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.7, dtype=torch.float64),
                        torch.rand(12, generator=gen, dtype=torch.float64) * 2 + 0.25):
        stats = check(module, x, target, temperature)
    assert stats.is_top1[[0, 3, 6]].tolist() == [0.0, 0.0, 0.0]
    assert stats.is_top1[[1, 2, 4, 5]].tolist() == [1.0] * 4
    assert stats.sum_logits[8].item() == float("-inf") and torch.isfinite(stats.sum_logits[9])
    assert stats.is_top1[11].item() == stats.sum_logits[11].item() == stats.log_sum_sq_probs[11].item() == 0.0


DTYPE_SEED = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
def test_rows_without_a_distribution(backend):
    """All ``-inf``: ``sum_logits`` and ``max_logit`` -inf, the other two NaN; a NaN or ``+inf`` logit: NaN; ``OUT_OF_RANGE``: NaN;
    ``SKIP``: 0."""
    module = _backend(backend)
    x = torch.randn(6, 37)
    x[0] = float("-inf")
    x[1, 4] = float("nan")
    x[5, 7] = float("inf")
    target = torch.tensor([3, 3, constants.OUT_OF_RANGE, constants.SKIP, 36, 2])
    stats = module.forward(x, None, target, torch.tensor(1.0, dtype=torch.float64), constants.HEAD)
    assert stats.sum_logits[0].item() == stats.max_logit[0].item() == float("-inf")
    for value in (stats.is_top1, stats.log_sum_sq_probs):
        assert torch.isnan(value[0])
    for value in (stats.is_top1, stats.sum_logits, stats.log_sum_sq_probs, stats.max_logit):
        assert torch.isnan(value[1]) and torch.isnan(value[2]) and value[3].item() == 0.0 and torch.isnan(value[5])
    assert torch.isfinite(stats.log_sum_sq_probs[4]) and stats.is_top1[4].item() in (0.0, 1.0)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_same_answer_as_the_reference(backend):
    """Every backend agrees with the fp32 reference backend: ``is_top1`` bit for bit."""
    module, reference = _backend(backend), _backend("reference")
    gen = torch.Generator().manual_seed(3)
    x, target = tied_rows(4099, torch.bfloat16, gen)
    temperature = torch.tensor(1.3, dtype=torch.float64)
    request = constants.HEAD
    mine, theirs = module.forward(x, None, target, temperature, request), reference.forward(x, None, target, temperature,
                                                                                             request)
    assert torch.equal(mine.is_top1, theirs.is_top1)
    assert torch.equal(mine.lse.isfinite(), theirs.lse.isfinite())


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
def test_vocab_pieces_merge_to_the_whole_row(backend):
    """``statistics.merge`` of contiguous vocab pieces (as LM-head tiles and vocab shards cut a row), given in a
    shuffled order, gives the whole row's head statistics: ``is_top1`` and ``max_logit`` exactly (ties split between
    pieces, a piece of one entry, a piece of all ``-inf``), the sum and ``log_sum_sq_probs`` within the tolerances."""
    module = _backend(backend)
    vocab = 1271
    x, target = tied_rows(vocab, torch.float32, torch.Generator().manual_seed(11))
    x[8, :5] = float("-inf")  # a piece without mass
    temperature = torch.tensor(0.7, dtype=torch.float64)
    request = constants.HEAD | constants.ENTROPY
    whole = module.forward(x, None, target, temperature, request)
    cuts = [0, 5, 300, 301, 636, 1264, 1265, vocab]
    parts, holds, before = [], [], []
    for v0, v1 in zip(cuts[:-1], cuts[1:]):
        inside = (target >= v0) & (target < v1)
        local = torch.where(target >= 0, torch.where(inside, target - v0, 0), target)
        parts.append(module.forward(x[:, v0:v1].contiguous(), None, local, temperature, request))
        holds.append(inside)
        before.append(target >= v1)
    order = torch.randperm(len(parts), generator=torch.Generator().manual_seed(5))
    local = {name: torch.stack([getattr(parts[k], name) for k in order]) for name in statistics.NAMES
             if statistics.present(request, name)}
    marked = statistics.mark_pieces(local, torch.stack([holds[k] for k in order]),
                                    torch.stack([before[k] for k in order]))
    merged = statistics.merge(marked, request)
    scored = target >= 0
    assert torch.equal(merged.is_top1[scored], whole.is_top1[scored])
    assert torch.equal(merged.max_logit[scored], whole.max_logit[scored])
    sq_atol, sum_atol = tolerances(x, temperature)
    for i in torch.nonzero(scored).squeeze(1).tolist():
        assert_close(merged.sum_logits[i:i + 1], whole.sum_logits[i:i + 1],
                     2 * sum_atol[i].item() * constants.LOGIT_SUM_SCALE, what=f"sum {i}")
        assert_close(merged.log_sum_sq_probs[i:i + 1], whole.log_sum_sq_probs[i:i + 1], 2 * sq_atol[i].item(),
                     what=f"sq {i}")


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [9000, 9001])  # 16-byte loads / scalar loads; two full Triton tiles and a tail
def test_is_top1_at_tile_boundaries(backend, dtype, vocab):
    """Ties placed at the Triton forward's tile edges (the full tiles skip the per-entry before-label mask; the label's
    own tile is read again up to the label): a label first or last in a full tile, first in the tail, the tie one entry
    before it in the previous tile or in its own, or just after it."""
    module = _backend(backend)
    block = rows.forward_tile(vocab, torch.tensor([], dtype=dtype).element_size(), False).elements_per_iteration
    assert 2 * block < vocab < 3 * block
    cases = [  # (label, tie, is_top1)
        (0, block, True), (block - 1, 0, False), (block - 1, block, True), (block, block - 1, False),
        (block, block + 1, True), (2 * block - 1, block, False), (2 * block - 1, 2 * block, True),
        (2 * block, 2 * block - 1, False), (2 * block, vocab - 1, True), (vocab - 1, 2 * block, False),
        (block + 5, 3, False), (5, block + 3, True),
    ]
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(len(cases), vocab, generator=gen) * 3.0
    for i, (label, tie, _) in enumerate(cases):
        x[i, [label, tie]] = 50.0
    target = torch.tensor([label for label, _, _ in cases])
    stats = check(module, x.to(dtype), target, torch.tensor(0.7, dtype=torch.float64))
    assert stats.is_top1.tolist() == [1.0 if top else 0.0 for _, _, top in cases]
