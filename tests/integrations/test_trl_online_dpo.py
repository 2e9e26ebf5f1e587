"""TRL's experimental ``OnlineDPOTrainer`` with ``kltriton.integrations.trl.apply()``: its ``_forward`` (the completion
tokens' log-probs) is scored from the hidden states; four fp32 steps on CPU (TRL's own generation, a reward
function) log the same metrics as plain TRL, and the training forward never builds the ``[B, T, V]`` logits."""
import warnings

import pytest
import torch

pytest.importorskip("trl")

from helpers import CallCounter  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from kltriton.integrations import trl_experimental  # noqa: E402
from trl_support import FullLogitsWatch, assert_logs_close, train_online_dpo  # noqa: E402


def _online_dpo_class():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's warning on importing trl.experimental
        from trl.experimental.online_dpo import OnlineDPOTrainer
    return OnlineDPOTrainer


def _lora(*modules):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=list(modules), lora_dropout=0.0)


@pytest.mark.parametrize("adapter", [None, "q_proj,v_proj"], ids=["full", "peft"])
def test_online_dpo_trains_the_same_with_kltriton(adapter, model_dir, tmp_path, monkeypatch, caplog):
    """With PEFT the reference is the policy with its adapter off (TRL's ``disable_adapter``)."""
    if adapter is not None:
        pytest.importorskip("peft")
    peft_config = None if adapter is None else _lora(*adapter.split(","))
    trl_watch = FullLogitsWatch()
    trl_logs = train_online_dpo(model_dir, tmp_path / "trl", peft_config=peft_config, watch_model=trl_watch)
    assert any(shape[1] > 1 for shape in trl_watch.shapes)  # TRL's _forward: the [B, T, V] logits
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    watch = FullLogitsWatch()
    trainer_class = _online_dpo_class()
    trl_forward = trainer_class._forward
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = train_online_dpo(model_dir, tmp_path / "kltriton", peft_config=peft_config, watch_model=watch)
    assert trainer_class._forward is trl_forward  # undone
    lines = [record.getMessage() for record in caplog.records]
    assert any("OnlineDPOTrainer log-probs: kltriton.token_logprobs" in line for line in lines), lines
    assert not any("TRL's own _forward" in line for line in lines), lines
    # The policy and the reference at each of the 4 steps; the head's only logits are generation's last positions.
    assert logprobs.calls == 8, logprobs.calls
    assert watch.shapes and all(shape[1] == 1 for shape in watch.shapes), watch.shapes
    # The test can fail: the policy moved off the reference, and its log-probs with it.
    assert trl_logs[-1]["objective/kl"] != 0 and trl_logs[0]["logps/chosen"] != trl_logs[-1]["logps/chosen"]
    assert_logs_close(trl_logs, kl_logs, 4)


@pytest.mark.parametrize("prompt_len", [0, 3])
def test_forward_equals_trls_with_and_without_a_prompt(prompt_len, model_dir):
    """The patched ``_forward`` against TRL's on hand-made tensors: values and the parameters' gradients, with a
    padded completion, left truncation to ``max_length``, and no prompt (TRL then scores each completion token at its
    own position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer_class = _online_dpo_class()
    trainer = trainer_class.__new__(trainer_class)  # _forward reads only these attributes
    trainer.max_length, trainer.is_encoder_decoder = 8, False
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 18, (3, prompt_len), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    if prompt_len:
        prompt_ids[0, 0], prompt_mask[0, 0] = 0, 0  # a left-padded prompt
    completion_ids = torch.randint(3, 18, (3, 6), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    completion_ids[1, 4:], completion_mask[1, 4:] = 0, 0

    def run():
        model.zero_grad()
        logprobs = trainer._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
        return logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    with kl_trl.apply():
        ours, our_grads = run()
    theirs, their_grads = run()
    assert ours.shape == theirs.shape == completion_ids.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_peft_adapter_on_the_head_keeps_trls_forward(model_dir, tmp_path, caplog):
    """A LoRA adapter on ``lm_head``: kltriton would project with the base weight only, so TRL's ``_forward`` runs,
    with one line naming the reason."""
    pytest.importorskip("peft")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        logs = train_online_dpo(model_dir, tmp_path / "peft-head", peft_config=_lora("q_proj", "lm_head"),
                                max_steps=1)
    assert len(logs) == 1
    lines = [record.getMessage() for record in caplog.records]
    assert sum("OnlineDPOTrainer log-probs: TRL's own _forward" in line and "PEFT adapter" in line
               for line in lines) == 1, lines


def test_reasons_for_trls_forward(model_dir):
    """Vision inputs and encoder-decoder models keep TRL's ``_forward`` (``_why_trl_forward`` and the vision check)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = type("Trainer", (), {"is_encoder_decoder": True})()
    assert trl_experimental._why_trl_forward(trainer, model) == "the model is an encoder-decoder"
    trainer.is_encoder_decoder = False
    assert trl_experimental._why_trl_forward(trainer, model) is None
