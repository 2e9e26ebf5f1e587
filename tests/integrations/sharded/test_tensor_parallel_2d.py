"""FSDP2 and tensor parallelism together (a 2-D mesh ``(dp, tp) = (2, 2)``, 4 CPU processes, gloo): a tiny Llama
whose LM head is tensor parallel over ``tp`` (``parallelize_module`` with ``ColwiseParallel``) and whose layers, head
and root are ``fully_shard``'ed over ``dp``; ``kltriton.heads`` scores inside the head unit's forward, where the
unsharded weight is the tensor-parallel ``DTensor`` (vocab-parallel over ``tp``), with the style's output hook (it
expects logits) left out. Loss and every parameter's gradient against the float64 model."""
import pytest

import launch

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ranks(models, tmp_path_factory):
    results = launch.run([dict(job="heads_2d", layout="fsdp2_tp", **models)], tmp_path_factory.mktemp("tp-2d"),
                         world_size=4)
    return [rank[0] for rank in results]


def test_fsdp2_and_tensor_parallel_head(ranks):
    for rank, run in enumerate(ranks):
        # the head's parameter: FSDP2's shard over dp (a strided shard) of the tensor-parallel Shard(0) over tp
        assert run["placements"][1] == "S(0)" and "S" in run["placements"][0], run["placements"]
        assert abs(run["loss"] - run["expected"]) <= 1e-6 * abs(run["expected"]), (rank, run["loss"], run["expected"])
        worst = max(run["grads"].values())
        assert worst <= 1e-5, (rank, {k: v for k, v in run["grads"].items() if v > 1e-5})
