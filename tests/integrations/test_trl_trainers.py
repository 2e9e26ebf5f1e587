"""TRL's offline trainers (SFT, DPO, KTO) with ``kltriton.integrations.trl.apply()``: their fused LM head, asked for
the log-probs and the head's metrics (entropy, ``is_top1``, ``mean_logits``, ``log_sum_sq_probs``), is kltriton's;
three fp32 SGD steps log the same metrics as plain TRL, token accuracy exactly, on a model whose LM head rows tie in
pairs (every position's maximum is a tie: ``argmax``'s first-index rule decides the accuracy)."""
import math

import pytest
import torch

pytest.importorskip("trl")

from helpers import CallCounter  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from test_trl import _TrlHeadCounter, tied_model_dir  # noqa: E402,F401  (a fixture: the head's rows tied in pairs)
from trl_support import assert_logs_close, train_offline  # noqa: E402

CONFIGURATIONS = {
    "sft-nll": ("sft", {}),
    "sft-dft": ("sft", {"loss_type": "dft"}),
    "sft-packed-padding-free": ("sft", {"packing": True, "padding_free": True}),
    "dpo-sigmoid": ("dpo", {}),
    "dpo-ipo": ("dpo", {"loss_type": ["ipo"]}),
    "dpo-wpo": ("dpo", {"use_weighting": True}),
    "dpo-ld-alpha": ("dpo", {"ld_alpha": 0.5}),
    "dpo-precomputed-reference": ("dpo", {"precompute_ref_log_probs": True}),
    "kto": ("kto", {}),
}
EXACT = ("mean_token_accuracy", "rewards/accuracies", "num_tokens")


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_offline_trainer_trains_the_same_with_kltriton_head(name, tied_model_dir, tmp_path, monkeypatch, caplog):
    trainer, overrides = CONFIGURATIONS[name]
    trl_logs = train_offline(trainer, tied_model_dir, tmp_path / "trl", **overrides)
    trl_head = _TrlHeadCounter(monkeypatch)
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = train_offline(trainer, tied_model_dir, tmp_path / "kltriton", **overrides)
    lines = [record.getMessage() for record in caplog.records]
    assert not any("keeps TRL's" in line for line in lines), lines
    assert any("with kltriton's LM head" in line for line in lines), lines
    assert trl_head.calls == 0 and logprobs.calls >= 3, (trl_head.calls, logprobs.calls)
    assert trl_logs[0]["loss"] != trl_logs[-1]["loss"]  # the test can fail: training moved the model
    assert_logs_close(trl_logs, kl_logs, 3, exact=EXACT)


@pytest.mark.filterwarnings("ignore:`label_smoothing_factor` is deprecated:FutureWarning")  # TRL's, about the option
def test_sft_with_label_smoothing_says_its_loss_is_trls(tied_model_dir, tmp_path, caplog):
    """With ``label_smoothing_factor`` SFT's loss is TRL's, from the model's own logits; kltriton's head gives the
    metrics, and one line says so. The logs equal plain TRL's."""
    trl_logs = train_offline("sft", tied_model_dir, tmp_path / "trl", label_smoothing_factor=0.1)
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = train_offline("sft", tied_model_dir, tmp_path / "kltriton", label_smoothing_factor=0.1)
    lines = [record.getMessage() for record in caplog.records]
    assert sum("SFTTrainer loss: TRL's code on the model's own logits (its label_smoothing_factor)" in line
               for line in lines) == 1, lines
    for step, (a, b) in enumerate(zip(trl_logs, kl_logs), start=1):
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (step, key, a[key], b[key])
