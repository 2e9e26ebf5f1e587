"""``kltriton.heads`` on an unwrapped model (one process): the head's ``LinearLogits`` with the config's scale and
softcap, scoring inside the head's forward, and the errors. The wrapped cases (DDP, FSDP2, ZeRO-3, tensor
parallel) are in ``sharded/test_libraries_sharded.py``."""
import pytest
import torch

pytest.importorskip("transformers")

import kltriton  # noqa: E402
from kltriton import heads  # noqa: E402


def _llama(logit_scale=None, softcap=None, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=211, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    if logit_scale is not None:
        config.logit_scale = logit_scale  # Cohere's name; head_scaling reads it as TRL does
    if softcap is not None:
        config.final_logit_softcapping = softcap
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: the softcap bends them
    return model


def _expected_logp(model, hidden, labels, logit_scale, softcap, temperature):
    logits = hidden @ model.lm_head.weight.T * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return (logits / temperature).log_softmax(-1).gather(-1, labels[..., None])[..., 0]


@pytest.mark.parametrize("logit_scale, softcap", [(None, None), (0.5, None), (None, 3.0), (1.5, 2.0)])
def test_lm_head_logits_reads_the_head_and_its_scaling(logit_scale, softcap):
    model = _llama(logit_scale, softcap)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 211, (3, 5), generator=gen)
    logits = kltriton.lm_head_logits(model, hidden)
    assert logits.weight is model.lm_head.weight and logits.bias is None
    assert (logits.logit_scale, logits.softcap) == (logit_scale or 1.0, softcap)
    got = kltriton.token_logprobs(logits, labels, temperature=0.7, backend="reference")
    expected = _expected_logp(model, hidden, labels, logit_scale or 1.0, softcap, 0.7)
    torch.testing.assert_close(got.double(), expected, rtol=1e-9, atol=1e-9)  # float64 on the reference backend


def test_score_with_lm_head_runs_inside_the_heads_forward_and_gives_its_gradients():
    """``fn`` runs as the head module's forward (its hooks see it), the forward is put back, and the gradients of
    the hidden states and the head equal autograd's through the dense computation."""
    model = _llama(softcap=3.0)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 211, (2, 7), generator=gen)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    loss = kltriton.score_with_lm_head(model, hidden, lambda logits: kltriton.token_logprobs(
        logits, labels, backend="reference").sum())
    assert seen == [hidden.shape]
    assert "forward" not in model.lm_head.__dict__  # the class's forward again
    got = torch.autograd.grad(loss, [hidden, model.lm_head.weight])
    expected_loss = _expected_logp(model, hidden, labels, 1.0, 3.0, 1.0).sum()
    expected = torch.autograd.grad(expected_loss, [hidden, model.lm_head.weight])
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-9, atol=1e-9)  # float64 throughout
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


def test_hidden_states_take_the_heads_dtype():
    model = _llama(dtype=torch.float32)
    logits = kltriton.lm_head_logits(model, torch.randn(2, 16, dtype=torch.float64))
    assert logits.hidden.dtype == torch.float32


def test_run_in_forward_goes_through_the_wrapper_and_restores_an_instance_forward():
    """The model's own (instance) forward, as TRL's fused head installs one, is back after the call, even when
    ``fn`` raises."""
    model = _llama()
    own = model.forward
    model.forward = own  # an instance attribute now
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append("hook"))
    assert heads.run_in_forward(model, lambda x: x * 2, torch.ones(1)).item() == 2.0
    assert calls == ["hook"] and model.__dict__["forward"] is own
    with pytest.raises(ValueError, match="inside"):
        heads.run_in_forward(model, lambda x: (_ for _ in ()).throw(ValueError("inside")), torch.ones(1))
    assert model.__dict__["forward"] is own


def test_unwrap_model_looks_through_ddp_and_compile_wrappers():
    model = _llama()

    class DeepSpeedEngine(torch.nn.Module):  # what unwrap_model recognises a DeepSpeed engine by
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert heads.unwrap_model(DeepSpeedEngine(model)) is model
    assert heads.unwrap_model(model) is model


def test_clear_errors():
    model = _llama()
    with pytest.raises(ValueError, match="no output embedding"):
        kltriton.lm_head_logits(torch.nn.Linear(2, 2), torch.zeros(1, 2))

    class Adapted(torch.nn.Module):  # a PEFT layer keeps the original as base_layer
        def __init__(self, base):
            super().__init__()
            self.base_layer, self.weight = base, base.weight

    model.lm_head = Adapted(model.lm_head)
    with pytest.raises(ValueError, match="PEFT adapter"):
        kltriton.lm_head_logits(model, torch.zeros(1, 16, dtype=torch.float64))
