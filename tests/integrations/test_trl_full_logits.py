"""TRL's experimental preference trainers that build the ``[B, T, V]`` logits (CPO / SimPO, ORPO): with
``kltriton.integrations.trl.apply()`` their ``concatenated_forward`` scores the hidden states instead (one
``token_logprobs`` pass), and three training steps log the same metrics as plain TRL without the full logits ever
being built; the logit helpers they call elsewhere are kltriton's drop-ins."""
import warnings

import pytest
import torch

pytest.importorskip("trl")

from helpers import CallCounter  # noqa: E402
from kltriton import dropins  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from kltriton.integrations import trl_experimental  # noqa: E402
from trl_support import PREFERENCES, FullLogitsWatch, assert_logs_close, tiny_mixtral  # noqa: E402


def _trainer_classes(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's warning on importing trl.experimental
        if name == "cpo":
            from trl.experimental.cpo import CPOConfig, CPOTrainer
            return CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        return ORPOConfig, ORPOTrainer


def _train(name, model_dir, out_dir, watch_model=None, steps=3, **overrides):
    """``steps`` fp32 optimizer steps of the trainer on a tiny preference set; the per-step logs.
    ``watch_model(model)`` runs before the trainer is built."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_class, trainer_class = _trainer_classes(name)
    args = config_class(output_dir=str(out_dir), report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0,
                        per_device_train_batch_size=4, max_steps=steps, learning_rate=0.05, logging_steps=1,
                        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, max_length=16, **overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if watch_model is not None:
        watch_model(model)
    trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_dict(PREFERENCES),
                            processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("name, overrides", [("cpo", {}), ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.5}),
                                             ("cpo", {"cpo_alpha": 0.0}), ("orpo", {})],
                         ids=["cpo-sigmoid", "simpo", "cpo-without-nll", "orpo"])
def test_preference_trainer_trains_the_same_from_hidden_states(name, overrides, model_dir, tmp_path, monkeypatch,
                                                               caplog):
    trl_watch, watch = FullLogitsWatch(), FullLogitsWatch()
    trl_logs = _train(name, model_dir, tmp_path / "trl", watch_model=trl_watch, **overrides)
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    trainer_class = _trainer_classes(name)[1]
    trl_forward = trainer_class.concatenated_forward
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = _train(name, model_dir, tmp_path / "kltriton", watch_model=watch, **overrides)
    assert trainer_class.concatenated_forward is trl_forward  # undone
    lines = [record.getMessage() for record in caplog.records]
    assert sum(f"{trainer_class.__name__}.concatenated_forward: kltriton.token_logprobs" in line
               for line in lines) == 1, lines
    assert trl_watch.shapes and not watch.shapes, (trl_watch.shapes, watch.shapes)  # no [B, T, V] logits with kltriton
    assert logprobs.calls == 3, logprobs.calls  # one pass per step (ORPO's two label sets agree)
    # The test can fail: training moved the log-probs, and the logits' mean is logged.
    assert trl_logs[0]["logps/chosen"] != trl_logs[-1]["logps/chosen"] and trl_logs[0]["logits/chosen"] != 0
    assert_logs_close(trl_logs, kl_logs, 3)


def test_moe_aux_loss_keeps_trls_forward(tmp_path, caplog):
    """ORPO adds the MoE aux loss from the model's own forward: TRL's ``concatenated_forward`` runs, with a log line."""
    model = tmp_path / "tiny-mixtral"
    tiny_mixtral(model)
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        logs = _train("orpo", model, tmp_path / "moe", steps=1)
    assert len(logs) == 1
    lines = [record.getMessage() for record in caplog.records]
    assert sum("ORPOTrainer.concatenated_forward: TRL's own" in line and "MoE aux loss" in line
               for line in lines) == 1, lines


def test_label_sets_that_disagree_are_scored_twice(model_dir, monkeypatch):
    """``_score_positions`` against the model's own logits: one pass when the two label sets agree wherever both are
    scored, two when they do not; the log-probs and the per-position mean logits as ``log_softmax`` and ``mean``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 18, (2, 7), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -2:] = 0
    labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    labels[:, :2] = -100  # a prompt: the NLL scores it, the log-probs do not
    nll_labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    logp_all = logits[:, :-1].log_softmax(-1)

    def expected(x):
        return logp_all.gather(-1, x.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (x != -100)

    disagreeing = nll_labels.clone()
    disagreeing[0, 3] = (disagreeing[0, 3] + 1) % 18  # both scored there, another token
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    for other, passes in ((nll_labels, 1), (disagreeing, 2)):
        calls = logprobs.calls
        with torch.no_grad():
            logp, nll_logp, mean_logits = trl_experimental._score_positions(model, input_ids, attention_mask, labels,
                                                                            other)
        assert logprobs.calls - calls == passes
        torch.testing.assert_close(logp * (labels != -100), expected(labels), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nll_logp * (other != -100), expected(other), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mean_logits, logits.mean(-1), rtol=1e-5, atol=1e-6)


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
