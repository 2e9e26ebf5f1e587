"""TRL's experimental trainers that still build the ``[B, T, V]`` logits (CPO / SimPO, ORPO): with
``kltriton.integrations.trl.apply()`` their ``selective_log_softmax`` is kltriton's drop-in, and three training steps
log the same metrics as plain TRL."""
import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from helpers import CallCounter  # noqa: E402
from kltriton import dropins  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from trl_support import tiny_llama  # noqa: E402

PROMPTS = ["the cat sat on", "a dog ran and", "the big red", "then a small"]
CHOSEN = [" the mat", " then sat", " cat ran", " dog sat on the log"]
REJECTED = [" a log", " a big dog", " blue mat and", " red"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(path)
    return path


def _trainer_classes(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's warning on importing trl.experimental
        if name == "cpo":
            from trl.experimental.cpo import CPOConfig, CPOTrainer, cpo_trainer
            return CPOConfig, CPOTrainer, cpo_trainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer, orpo_trainer
        return ORPOConfig, ORPOTrainer, orpo_trainer


def _train(name, model_dir, out_dir, **overrides):
    """Three fp32 optimizer steps of the trainer on a tiny preference set; the per-step logs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_class, trainer_class, _ = _trainer_classes(name)
    data = Dataset.from_dict({"prompt": PROMPTS * 2, "chosen": CHOSEN * 2, "rejected": REJECTED * 2})
    args = config_class(output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                        per_device_train_batch_size=4, max_steps=3, learning_rate=0.05, logging_steps=1,
                        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, max_length=16, **overrides)
    trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=data,
                            processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("name, overrides", [("cpo", {}), ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.5}),
                                             ("orpo", {})])
def test_full_logits_trainer_trains_the_same_with_kltriton(name, overrides, model_dir, tmp_path, monkeypatch):
    trl_logs = _train(name, model_dir, tmp_path / "trl", **overrides)
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    _, _, module = _trainer_classes(name)
    with kl_trl.apply():
        assert module.selective_log_softmax is dropins.selective_log_softmax
        kl_logs = _train(name, model_dir, tmp_path / "kltriton", **overrides)
    assert module.selective_log_softmax is not dropins.selective_log_softmax  # undone
    assert logprobs.calls >= 3, logprobs.calls  # every step's log-probs came from kltriton
    # The test can fail: training moved the log-probs.
    assert trl_logs[0]["logps/chosen"] != trl_logs[-1]["logps/chosen"]
    assert len(trl_logs) == len(kl_logs) == 3
    # The two runs differ in fp32 rounding only (TRL's CPU path: log_softmax + gather in torch; kltriton: one
    # streaming pass); per-token log-probs agree to ~1e-6 and three steps of lr 0.05 carry that to ~1e-5 relative.
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        assert set(a) == set(b), (step, set(a) ^ set(b))
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (step, key, a[key], b[key])


def test_entropy_and_logprob_helpers_are_swapped_everywhere_and_restored():
    from trl.trainer import utils as trl_utils

    originals = {name: getattr(trl_utils, name) for name in kl_trl._LOGIT_HELPERS}
    logits = torch.randn(2, 5, 23)
    index = torch.randint(0, 23, (2, 5))
    with kl_trl.apply():
        for name in kl_trl._LOGIT_HELPERS:
            assert getattr(trl_utils, name) is getattr(dropins, name)
        ours = trl_utils.selective_log_softmax_and_entropy(logits, index)
    assert {name: getattr(trl_utils, name) for name in kl_trl._LOGIT_HELPERS} == originals
    theirs = trl_utils.selective_log_softmax_and_entropy(logits, index)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-6)
