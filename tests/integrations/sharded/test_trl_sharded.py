"""TRL 1.16 with ``kltriton.integrations.trl.apply()`` on 2 CPU processes (gloo), every layout a user trains with:
``GRPOTrainer``, the heads of ``RLOOTrainer``, ``SFTTrainer``, ``DPOTrainer`` and ``KTOTrainer``, ``GKDTrainer`` and
``DistillationTrainer``, two optimizer steps (SGD) each. The logged loss and
metrics of both steps and the first step's parameter gradients (gathered whole from every wrapper) equal a
single-process float64 run of the same model, data and seed with TRL's own code; the log says kltriton scored,
with no fallback line.

accelerate starts FSDP and DeepSpeed only on accelerators and silently trains plain DDP on CPU: the test processes
relabel accelerate's state as a user with GPUs gets it (``world.relabel_accelerate``), and each result records
the wrapper that ran (``FSDPLlamaForCausalLM`` units, ``DeepSpeedEngine`` stage). Generation is a deterministic
function of the prompt (``world.fake_generate``): one process and two draw different sampling streams, and this
test is about the scoring, not the sampling.
"""
import pytest

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

import compare  # noqa: E402
import launch  # noqa: E402
from conftest import DISTILLATION, DPO, GKD, GRPO, GRPO_ENTROPY_MASK, KTO, RLOO, SFT  # noqa: E402

LAYOUTS = {
    "ddp": "DDP, find_unused_parameters=False",
    "ddp_unused": "DDP, find_unused_parameters=True (transformers' default without gradient checkpointing)",
    "fsdp2": "FSDP2 as accelerate wraps: decoder layers, embedding, [norm, lm_head] unit, root",
    "fsdp2_keep": "the same, reshard_after_forward=False",
    "fsdp2_head": "FSDP2, the LM head alone in its own unit (reshard_after_forward=True)",
    "fsdp2_head_keep": "FSDP2, the LM head alone in its own unit, reshard_after_forward=False",
    "fsdp2_root": "FSDP2, one unit: the root holds the head",
    "fsdp2_mp": "FSDP2, head in its own unit, float64 model computing in float32 (MixedPrecisionPolicy)",
    "fsdp2_bf16": "FSDP2, head in its own unit, MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3 (every parameter partitioned: stage3_param_persistence_threshold=0)",
    "tp_plan": "tensor parallel: transformers' tp_plan='auto' (every layer sharded, the LM head colwise), accelerate's "
               "ParallelismConfig(tp_size=2)",
    "tp_head": "tensor parallel LM head alone: torch parallelize_module(model, mesh, {'lm_head': "
               "ColwiseParallel(output_layouts=Replicate())}), ParallelismConfig(tp_size=2)",
}
TENSOR_PARALLEL = ("tp_plan", "tp_head")
# TRL's own data-side metrics of a tensor-parallel run count each batch once per rank (TRL gathers over every process
# as if each were a data-parallel rank, and the two ranks hold one batch): the token count doubles and the rewards'
# standard deviation is over the duplicated rewards. kltriton computes neither.
TRL_DUPLICATED = ("num_tokens", "rewards/reward_ids/std", "reward_std")
TRAINERS = {"grpo": (GRPO, tuple(LAYOUTS)),
            # the same head as GRPO's (each asked for its trainer's statistics): DDP, FSDP2 with the head in its own unit
            # and ZeRO-3
            "rloo": (RLOO, ("ddp", "fsdp2_head", "zero3")), "sft": (SFT, ("ddp", "fsdp2_head", "zero3")),
            "dpo": (DPO, ("ddp", "fsdp2_head", "zero3")), "kto": (KTO, ("ddp", "fsdp2_head", "zero3")),
            "gkd": (GKD, tuple(k for k in LAYOUTS if k not in ("fsdp2_keep", "fsdp2_bf16"))),
            "distillation": (DISTILLATION, tuple(k for k in LAYOUTS if k not in ("fsdp2_keep", "fsdp2_bf16")))}
CASES = [(trainer, layout) for trainer, (_, layouts) in TRAINERS.items() for layout in layouts]
# TRL's own head with the LM head in its own FSDP2 unit: the control that shows the comparison can fail.
CONTROL = ("grpo", "fsdp2_head")
WRAPPERS = {"ddp": "DistributedDataParallel", "fsdp2": "FSDPLlamaForCausalLM", "zero": "DeepSpeedEngine",
            "tp": "LlamaForCausalLM"}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """``{(trainer, layout): rank 0's result}``, all from one 2-process launch; the control under ``"trl"``."""
    jobs = [dict(TRAINERS[trainer][0], layout=layout, **models) for trainer, layout in CASES]
    jobs.append(dict(GRPO_ENTROPY_MASK, layout="ddp", **models))
    jobs.append(dict(GRPO_ENTROPY_MASK, layout="tp_plan", **models))
    jobs.append(dict(GRPO, layout=CONTROL[1], kltriton=False, **models))
    ranks = launch.run(jobs, tmp_path_factory.mktemp("trl-sharded"), world_size=2)
    results = {(r["name"], r["layout"]): r for r in ranks[0][:-3]}
    results["entropy_mask"], results["entropy_mask_tp"], results["trl"] = ranks[0][-3:]
    for mine, theirs in zip(ranks[0], ranks[1]):  # every rank logged the same (gathered) numbers
        for a, b in zip(mine["logs"], theirs["logs"]):
            assert {k: v for k, v in a.items() if k not in compare.NOT_COMPARED} == \
                {k: v for k, v in b.items() if k not in compare.NOT_COMPARED}, (mine["job"], mine["layout"])
    return results


@pytest.mark.parametrize("trainer, layout", CASES, ids=[f"{trainer}-{layout}" for trainer, layout in CASES])
def test_trainer_equals_one_process_float64(trainer, layout, runs, references):
    run, reference = runs[trainer, layout], references[trainer]
    tolerance = compare.BF16 if layout == "fsdp2_bf16" else compare.FP32
    # the layout is the one named: accelerate relabelled, the wrapper and its units as intended
    wrapping = run["wrapping"]
    assert wrapping["wrapper"] == next(w for prefix, w in WRAPPERS.items() if layout.startswith(prefix)), wrapping
    if layout.startswith("zero"):
        assert wrapping["zero_stage"] == int(layout[-1]), wrapping
    if layout == "fsdp2_root":
        assert wrapping["fsdp_units"] == ["<root>"], wrapping
    elif layout.startswith("fsdp2"):
        assert "lm_head" in wrapping["fsdp_units"] and "model.layers.0" in wrapping["fsdp_units"], wrapping
    # kltriton scored, and said so; no fallback
    assert not [line for line in run["lines"] if "TRL's own" in line or "keeps TRL's" in line], run["lines"]
    scored = {"grpo": "GRPOTrainer loss: kltriton.policy_loss", "gkd": "GKDTrainer loss: kltriton.token_divergence",
              "distillation": "DistillationTrainer loss: kltriton.token_divergence",
              "rloo": "scores its log_probs and entropy with kltriton's LM head"}.get(
                  trainer, "with kltriton's LM head")
    assert any(scored in line for line in run["lines"]), run["lines"]
    counted = {"grpo": "policy_loss", "gkd": "token_divergence", "distillation": "token_divergence"}.get(
        trainer, "token_logprobs")
    assert run["calls"][counted] >= 2, run["calls"]
    if layout in TENSOR_PARALLEL:  # vocab-parallel from the DTensor head: no logits built, not even a shard's
        assert run["logits_built"] == 0, run["logits_built"]
    # the numbers
    reference_logs, logs = reference["logs"], run["logs"]
    if layout in TENSOR_PARALLEL:
        reference_logs, logs = ([{k: v for k, v in log.items() if k not in TRL_DUPLICATED} for log in each]
                                for each in (reference_logs, logs))
    compare.assert_logs_close(reference_logs, logs, tolerance)
    compare.assert_grads_close(reference["grads"], run["grads"], tolerance)


def test_entropy_mask_over_ranks(runs, references):
    """``top_entropy_quantile < 1`` on two data-parallel ranks: TRL's threshold is the quantile over both ranks'
    tokens; kltriton's loss takes it over the data-parallel group (``entropy_quantile_group``) and equals the
    one-process run, with no fallback."""
    run = runs["entropy_mask"]
    assert not [line for line in run["lines"] if "TRL's own" in line], run["lines"]
    assert any("GRPOTrainer loss: kltriton.policy_loss" in line for line in run["lines"]), run["lines"]
    assert run["calls"]["policy_loss"] >= 2 and run["calls"]["token_logprobs"] >= 2, run["calls"]
    compare.assert_logs_close(references["grpo_entropy_mask"]["logs"], run["logs"], compare.FP32)
    compare.assert_grads_close(references["grpo_entropy_mask"]["grads"], run["grads"], compare.FP32)


def test_entropy_mask_under_tensor_parallel(runs, references):
    """The same on two tensor-parallel ranks (one batch, no data parallelism): the quantile is over the batch once
    (TRL's own gathers every process's tokens, the batch twice)."""
    run = runs["entropy_mask_tp"]
    assert any("GRPOTrainer loss: kltriton.policy_loss" in line for line in run["lines"]), run["lines"]
    assert run["logits_built"] == 0 and run["calls"]["policy_loss"] >= 2, (run["logits_built"], run["calls"])
    reference_logs, logs = ([{k: v for k, v in log.items() if k not in TRL_DUPLICATED} for log in each]
                            for each in (references["grpo_entropy_mask"]["logs"], run["logs"]))
    compare.assert_logs_close(reference_logs, logs, compare.FP32)
    compare.assert_grads_close(references["grpo_entropy_mask"]["grads"], run["grads"], compare.FP32)


def test_the_comparison_can_fail(runs, references):
    """TRL's own fused head with the LM head in its own FSDP2 unit reads the shard with ``full_tensor()`` outside
    the head's forward: each rank keeps its own lm_head gradient (unreduced), and the comparison catches it. The
    reference itself moved: the second step has a KL and clipped tokens."""
    differences = compare.grad_differences(references["grpo"]["grads"], runs["trl"]["grads"])
    assert differences["lm_head.weight"] > 0.1, differences["lm_head.weight"]
    second = references["grpo"]["logs"][1]
    assert second["kl"] > 1e-3 and second["clip_ratio/region_mean"] > 0, second
