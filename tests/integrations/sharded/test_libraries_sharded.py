"""verl 0.9.1, OpenRLHF 0.11.2 and ``kltriton.heads`` (a loop of one's own) on 2 CPU processes (gloo), against
single-process float64 runs of the same model and data:

- verl's FSDP engine (``FSDPEngineWithLMHead``, FSDP2), data parallel and with Ulysses sequence parallelism (each
  packed sequence split over the ranks), with ``use_fused_kernels`` on the ``"kltriton"`` backend (log-probs and
  entropy from the hidden states in the model's forward) and on verl's logits path (its ``logprobs_from_logits``,
  which ``apply()`` sends to kltriton): ``infer_batch``'s log-probs and entropies, and the gradients of a
  ``forward_backward_batch`` with verl's ``sft_loss``. verl 0.9.1 runs on CUDA / NPU / ROCm and packs sequences
  for flash attention: the ranks register a CPU platform and a packed-sequence SDPA under flash attention's name
  (``world.verl_on_cpu``), which verl's Ulysses all-to-all wraps as it wraps flash attention.
- OpenRLHF's ``Actor`` inside a DeepSpeed ZeRO-3 engine: the experience maker's log-probs, a training step's
  log-probs, entropy and ``PolicyLoss``, and the gradients.
- ``kltriton.heads``: ``run_in_forward`` + ``score_with_lm_head`` under FSDP2 (the head alone in its unit, or in
  the root), DDP with ``find_unused_parameters`` and ZeRO-3; ``lm_head_logits`` gathers a frozen head and refuses
  a trainable sharded one; a tensor-parallel head reaches ``LinearLogits`` as ``DTensor`` s.
"""
import pytest

pytest.importorskip("deepspeed")

import compare  # noqa: E402
import launch  # noqa: E402
from conftest import HEADS, OPENRLHF, VERL, installed  # noqa: E402

VERL_CASES = [(layout, fused) for layout in ("fsdp2", "ulysses") for fused in (True, False)]
HEADS_LAYOUTS = ("fsdp2_head", "fsdp2_root", "ddp_unused", "zero3")


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """Both ranks' results of one 2-process launch, by ``(job, layout, fused)``."""
    jobs = [dict(HEADS, layout=layout, **models) for layout in HEADS_LAYOUTS]
    jobs.append(dict(job="tensor_parallel", layout="tp", **models))
    if installed("openrlhf"):
        jobs.append(dict(OPENRLHF, layout="zero3", **models))
    if installed("verl", "tensordict"):
        jobs += [dict(VERL, layout=layout, fused=fused, **models) for layout, fused in VERL_CASES]
        jobs.append(dict(VERL, layout="ulysses", fused=True, roll_locally=True, **models))
    ranks = launch.run(jobs, tmp_path_factory.mktemp("libraries-sharded"), world_size=2)
    results = {}
    for spec, mine, theirs in zip(jobs, ranks[0], ranks[1]):
        variant = "roll_locally" if spec.get("roll_locally") else spec.get("fused")
        results[spec["job"], spec["layout"], variant] = (mine, theirs)
    return results


def verl_differences(reference, ranks):
    """The worst relative differences of the log-probs and entropies over every sequence any rank scored."""
    worst = {"logps": 0.0, "entropy": 0.0}
    for run in ranks:
        for position, sequence in enumerate(run["sequences"]):
            for key in worst:
                worst[key] = max(worst[key], compare.relative(reference[key][sequence], run[key][position]))
    return worst


@pytest.mark.parametrize("layout, fused", VERL_CASES,
                         ids=[f"{layout}-{'fused' if fused else 'logits'}" for layout, fused in VERL_CASES])
def test_verl_engine_equals_one_process_float64(layout, fused, runs, references):
    pytest.importorskip("verl")
    ranks = runs["verl", layout, fused]
    assert ranks[0]["wrapping"] == {"wrapper": "FSDPLlamaForCausalLM", "ulysses": 2 if layout == "ulysses" else 1}
    if layout == "ulysses":  # each rank scored every sequence (its half of each)
        assert ranks[0]["sequences"] == ranks[1]["sequences"] == list(range(8))
    calls = ranks[0]["calls"]["token_logprobs"]
    assert calls >= 2, calls  # infer_batch's and the training step's micro-batches went through kltriton
    if fused:
        assert any("fused_kernels_backend='kltriton'" in line for line in ranks[0]["lines"]), ranks[0]["lines"]
    worst = verl_differences(references["verl"], ranks)
    assert worst["logps"] < compare.FP32["value"] and worst["entropy"] < compare.FP32["value"], worst
    compare.assert_grads_close(references["verl"]["grads"], ranks[0]["grads"], compare.FP32)


def test_verl_ulysses_labels_rolled_locally_are_caught(runs, references):
    """The control: without the engine's globally rolled ``shift_labels`` (verl before #6068) each rank's slice is
    scored on its own first token at the slice boundary, and the comparison sees it."""
    pytest.importorskip("verl")
    worst = verl_differences(references["verl"], runs["verl", "ulysses", "roll_locally"])
    assert worst["logps"] > 1e-2, worst


def test_openrlhf_actor_under_zero3_equals_one_process_float64(runs, references):
    pytest.importorskip("openrlhf")
    ranks, reference = runs["openrlhf", "zero3", None], references["openrlhf"]
    assert ranks[0]["calls"]["token_logprobs"] >= 3, ranks[0]["calls"]  # log-probs (twice) and the entropy
    for key in ("old", "logps", "entropy"):
        got = [x for run in ranks for row in run[key][0] for x in row]
        expected = [x for rank in reference[key] for row in rank for x in row]
        assert compare.relative(expected, got) < compare.FP32["value"], key
    assert abs(sum(run["loss"] for run in ranks) - reference["loss"]) < 1e-6 * max(1.0, abs(reference["loss"]))
    compare.assert_grads_close(reference["grads"], ranks[0]["grads"], compare.FP32)


@pytest.mark.parametrize("layout", HEADS_LAYOUTS)
def test_heads_in_a_loop_of_ones_own(layout, runs, references):
    ranks, reference = runs["heads", layout, None], references["heads"]
    for rank, run in enumerate(ranks):  # each rank's loss on its rows, and the averaged gradient
        assert abs(run["losses"][0] - reference["losses"][rank]) < 1e-5 * abs(reference["losses"][rank])
    compare.assert_grads_close(reference["grads"], ranks[0]["grads"], compare.FP32)
    assert ranks[0]["copy_equal"] and ranks[0]["copy_shape"] == [1001, 32]  # the frozen head, gathered whole
    if layout == "ddp_unused":
        assert ranks[0]["raised"] is None
    else:  # a trainable sharded head read outside its forward: a clear error naming the call to use
        assert "score_with_lm_head" in ranks[0]["raised"], ranks[0]["raised"]


def test_tensor_parallel_head_reaches_linear_logits_as_dtensors(runs):
    """What the DTensor front door receives from ``lm_head_logits`` for a ``ColwiseParallel`` head."""
    run = runs["tensor_parallel", "tp", None][0]
    assert run["weight"] == ["S(0)"] and run["hidden"] == ["R"], run  # str() of Shard(0) and Replicate()
    assert run["weight_local"] == [501, 32] and run["shape"] == [3, 1001], run
