"""Multi-process tests of kltriton inside sharded trainers (2 CPU processes, gloo over 127.0.0.1).

Each test module starts its ranks once (``launch.run``) for all its cases; the single-process float64 references of
every library that is installed come from one more process (``references``). Marked ``sharded``: CI runs them in
their own step, ``python -m pytest -q -m sharded tests/integrations/sharded``.
"""
import importlib.util

import pytest
import torch

import launch
import world


def pytest_configure(config):
    config.addinivalue_line("markers", "sharded: starts several processes (gloo); CI runs them in their own step")


def pytest_collection_modifyitems(items):
    for item in items:
        if "integrations/sharded/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.sharded)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny random Llamas (vocabulary 1001): the student / policy (hidden 32) and a wider teacher (hidden 48), each
    in float32 and, with the same weights, in float64 (path + "64")."""
    root = tmp_path_factory.mktemp("sharded-models")
    paths = {"model": root / "model", "teacher": root / "teacher"}
    for dtype, suffix in ((torch.float32, ""), (torch.float64, "64")):
        world.tiny_llama(str(paths["model"]) + suffix, seed=0, hidden_size=32, dtype=dtype)
        world.tiny_llama(str(paths["teacher"]) + suffix, seed=1, hidden_size=48, dtype=dtype)
    return {name: str(path) for name, path in paths.items()}


def installed(*packages) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in packages)


# The single-process float64 runs the sharded ones are compared with: the trainers' own code (no kltriton), the
# same model, data and seed, the same global batch.
GRPO = dict(job="grpo", batch=8, steps=2)
# TRL takes the entropy mask's quantile over every rank's tokens: kltriton's integration keeps TRL's loss then.
GRPO_ENTROPY_MASK = dict(GRPO, name="grpo_entropy_mask", top_entropy_quantile=0.5)
RLOO = dict(job="rloo", batch=8, steps=2)
SFT, DPO = (dict(job="offline", name=trainer, trainer=trainer, batch=8, steps=2) for trainer in ("sft", "dpo"))
# KTO's KL term pairs each prompt with another completion of the same device's batch: two ranks' batches of 4 pair
# them otherwise than one batch of 8. Its unpaired APO loss has no KL term, so one process and two agree.
KTO = dict(job="offline", name="kto", trainer="kto", batch=8, steps=2, config={"loss_type": "apo_zero_unpaired"})
GKD = dict(job="gkd", batch=8, steps=2)
DISTILLATION = dict(job="distillation", batch=8, steps=2)
VERL = dict(job="verl", sequences=8, temperature=0.9)
OPENRLHF = dict(job="openrlhf")
HEADS = dict(job="heads")


@pytest.fixture(scope="session")
def references(models, tmp_path_factory):
    """``{job: result}`` of the single-process float64 runs, for the libraries installed."""
    jobs = []
    if installed("trl", "deepspeed"):
        jobs += [GRPO, GRPO_ENTROPY_MASK, RLOO, SFT, DPO, KTO, GKD, DISTILLATION]
    if installed("verl", "tensordict"):
        jobs.append(VERL)
    if installed("openrlhf", "deepspeed"):
        jobs.append(OPENRLHF)
    if installed("deepspeed"):
        jobs.append(HEADS)
    jobs = [dict(job, layout="reference", **models) for job in jobs]
    results = launch.run(jobs, tmp_path_factory.mktemp("references"), world_size=1)[0]
    return {r["name"]: r for r in results}
