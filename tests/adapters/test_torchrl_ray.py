"""Ray service variants of the torchrl drop-ins on a real local Ray cluster started here.

Run where only loopback exists, e.g.
``unshare --net sh -c 'ip link set lo up && exec python -m pytest -m ray tests/adapters/test_torchrl_ray.py'``.
"""
import os
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("torchrl")
pytest.importorskip("transformers")

from tensordict import set_list_to_stack  # noqa: E402

import kltriton.adapters.torchrl as ours  # noqa: E402
from torchrl_support import (  # noqa: E402
    KEYS, assert_same_rows, history_data, model_pair, tiny_wrapper, token_data)

pytestmark = pytest.mark.ray
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """A 2-CPU local cluster whose workers import this checkout of kltriton and these test helpers."""
    path = os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "TRITON_INTERPRET": "1"}})
    where = ray.get(ray.remote(lambda: __import__("kltriton").__file__).remote())
    assert where.startswith(str(REPO)), where
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _lists_stack():
    with set_list_to_stack(True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="torchrl")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*models' log-probs")
        yield


def factories(input_mode, pad_output):
    """Picklable model factories: the models are built on the actor, never sent."""
    return dict(gen_model_factory=partial(tiny_wrapper, 0, "log_probs", input_mode, pad_output),
                ref_model_factory=partial(tiny_wrapper, 1, "ref_log_probs", input_mode, pad_output))


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("input_mode,assistant_only", [("tokens", False), ("history", False), ("history", True)])
def test_two_clients_share_one_actor(pad_output, input_mode, assistant_only):
    """Two clients with one actor name share one actor; both get the local transform's numbers."""
    name = f"kl-{input_mode}-{assistant_only}-{pad_output}"
    kwargs = dict(assistant_only=assistant_only, coeff=0.5, kl_clamp=10.0)
    data = (token_data if input_mode == "tokens" else history_data)(pad_output)
    first = ours.RetrieveKL(use_ray_service=True, actor_name=name, num_cpus=1, **factories(input_mode, pad_output),
                            **kwargs)
    second = ours.RetrieveKL(use_ray_service=True, actor_name=name, **factories(input_mode, pad_output), **kwargs)
    assert type(first).__name__ == "RayRetrieveKL"
    assert first._actor._actor_id == second._actor._actor_id == ray.get_actor(name)._actor_id
    local = ours.RetrieveKL(*model_pair(input_mode, pad_output), **kwargs)(data.copy())
    for client in (first, second):
        out = client(data.copy())
        assert_same_rows(out["next"], local["next"], KEYS, atol=0, rtol=0)
    ray.kill(ray.get_actor(name))


def test_kl_reward_transform_service():
    gen, ref = model_pair("tokens", True)
    data = gen(token_data(True))
    service = ours.KLRewardTransform(use_ray_service=True, actor_name="kl-reward",
                                     ref_model_factory=partial(tiny_wrapper, 1, "ref_log_probs", "tokens", True),
                                     coef=0.2, kl_clamp=1.0)
    local = ours.KLRewardTransform(ref, coef=0.2, kl_clamp=1.0)(data.copy())
    out = service(data.copy())
    assert_same_rows(out["next"], local["next"], ["reward", "kl_penalty", "ref_log_probs"], atol=0, rtol=0)
    ray.kill(ray.get_actor("kl-reward"))


def test_results_come_back_on_the_callers_device():
    """Tensors cross to the actor on CPU (device cleared) and come back on the caller's tensordict device
    (only CPU here: no accelerator on the test machine)."""
    service = ours.RetrieveKL(use_ray_service=True, assistant_only=False, **factories("tokens", True))
    out = service(token_data(True).to("cpu"))
    assert out.device == torch.device("cpu") and out["next"].get("kl_penalty").device.type == "cpu"
    ray.kill(service._actor)


def test_service_arguments():
    with pytest.raises(ValueError, match="Cannot provide both 'ref_model' and 'ref_model_factory'"):
        ours.RetrieveKL(None, tiny_wrapper(1, "ref_log_probs", "tokens", True), use_ray_service=True,
                        gen_model_factory=partial(tiny_wrapper, 0, "log_probs", "tokens", True),
                        ref_model_factory=partial(tiny_wrapper, 1, "ref_log_probs", "tokens", True))
    with pytest.raises(ValueError, match="from_collector"):
        ours.RetrieveKL(use_ray_service=True,
                        ref_model_factory=partial(tiny_wrapper, 1, "ref_log_probs", "tokens", True))
    with pytest.raises(ValueError, match="Must provide exactly one of"):
        ours.KLRewardTransform(use_ray_service=True)
