"""An MoE model (a tiny Mixtral whose config asks for its router logits, ``router_aux_loss_coef`` 0.01) in TRL's
offline trainers with ``kltriton.integrations.trl.apply()``: kltriton's head scores it and adds TRL's load-balancing
loss, and three fp32 SGD steps log the same metrics as plain TRL (``aux_loss`` among them)."""
import pytest
import torch

pytest.importorskip("trl")

from helpers import CallCounter  # noqa: E402
from kltriton.integrations import trl as kl_trl  # noqa: E402
from test_trl import _TrlHeadCounter  # noqa: E402
from trl_support import assert_logs_close, tiny_mixtral, train_offline  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mixtral")
    tiny_mixtral(path)
    return path


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_moe_model_trains_the_same_with_kltriton_head(trainer, moe_dir, tmp_path, monkeypatch, caplog):
    trl_logs = train_offline(trainer, moe_dir, tmp_path / "trl")
    trl_head = _TrlHeadCounter(monkeypatch)
    logprobs = CallCounter(monkeypatch, "token_logprobs")
    with kl_trl.apply(), caplog.at_level("WARNING", logger="kltriton.integrations.trl"):
        kl_logs = train_offline(trainer, moe_dir, tmp_path / "kltriton")
    lines = [record.getMessage() for record in caplog.records]
    assert any("MixtralForCausalLM scores its" in line and "with kltriton's LM head" in line for line in lines), lines
    assert not any("keeps TRL's" in line for line in lines), lines
    assert trl_head.calls == 0 and logprobs.calls >= 3, (trl_head.calls, logprobs.calls)
    # The test can fail: the aux loss is logged, is not zero, and training moved the model.
    assert all(log["aux_loss"] > 0 for log in trl_logs), trl_logs
    assert trl_logs[0]["loss"] != trl_logs[-1]["loss"]
    assert_logs_close(trl_logs, kl_logs, 3)


def test_moe_head_loss_and_gradients_equal_trls(moe_dir, monkeypatch):
    """The head's own ``loss`` (the NLL plus ``router_aux_loss_coef * aux_loss``, which the trainers above do not
    read: they add the coefficient to ``aux_loss`` themselves) and every parameter's gradient equal TRL's head's, with
    a padded row (the attention mask enters the load-balancing loss)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer import utils as trl_utils

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0]])
    attention_mask = (ids != 0).long()
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[:, :2] = -100

    def run():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    with kl_trl.apply():
        trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
        logprobs = CallCounter(monkeypatch, "token_logprobs")
        ours, our_grads = run()
        assert logprobs.calls == 1
    theirs, their_grads = run()
    assert logprobs.calls == 1  # undone: TRL's head scored this call
    nll = -theirs.log_probs.detach().sum() / labels.ne(-100).sum()
    assert theirs.aux_loss.detach() > 0 and not torch.isclose(theirs.loss.detach(), nll)  # the test can fail
    for name in ("loss", "aux_loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-5, atol=1e-6)
    assert our_grads.keys() == their_grads.keys() and any("gate" in name for name in our_grads)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
