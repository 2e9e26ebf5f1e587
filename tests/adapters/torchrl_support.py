"""Tiny torchrl models and data shared by the torchrl adapter tests (``test_torchrl.py``, ``test_torchrl_ray.py``).

A 1-layer Llama with random weights and an in-memory word-level tokenizer (no download); the Ray tests
use the builders as model factories on the actor.
"""
import torch
import transformers
import tokenizers
from tensordict import TensorDict, lazy_stack
from torch.nn.utils.rnn import pad_sequence
from torchrl.data.llm import History
from torchrl.modules.llm import TransformersWrapper
from torchrl.modules.llm.policies import ChatHistory

LENGTHS = [5, 8]
GEN, REF = ("log_probs", "full"), ("ref_log_probs", "full")
SPECIAL = ["<pad>", "<unk>", "<eos>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
WORDS = SPECIAL + [f"w{i}" for i in range(56)]
V = len(WORDS)
# A ChatML-like template whose {% generation %} block gives Hugging Face's assistant-token mask.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }} <|im_end|>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
CHATS = [
    [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"},
     {"role": "assistant", "content": "w6 w7"}],
    [{"role": "system", "content": "w1"}, {"role": "user", "content": "w8"},
     {"role": "assistant", "content": "w9 w10 w11 w12"}],
]


def tiny_tokenizer():
    """A word-level tokenizer built in memory, with a chat template that marks assistant tokens."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                     unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(seed: int):
    """A 1-layer Llama with random weights fixed by ``seed`` (the same on every process)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=64,
                                   bos_token_id=2, eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_wrapper(seed, log_probs_key, input_mode, pad_output, **kwargs):
    """torchrl's ``TransformersWrapper`` scoring tokens on ``tiny_llama(seed)``."""
    return TransformersWrapper(tiny_llama(seed), tokenizer=tiny_tokenizer(), input_mode=input_mode, generate=False,
                               return_log_probs=True, pad_output=pad_output, log_probs_key=log_probs_key, **kwargs)


def model_pair(input_mode, pad_output):
    return (tiny_wrapper(0, "log_probs", input_mode, pad_output),
            tiny_wrapper(1, "ref_log_probs", input_mode, pad_output))


def token_data(pad_output, reward=True):
    """Two samples of 5 and 8 tokens: left-padded ``[2, 8]`` tensors, or a lazy stack of per-sample ones."""
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, V, (n,), generator=gen) for n in LENGTHS]
    assistant = [torch.arange(n) >= 2 for n in LENGTHS]
    if pad_output:
        pad = lambda x, v: pad_sequence(x, batch_first=True, padding_value=v, padding_side="left")  # noqa: E731
        full = pad(tokens, 0)
        td = TensorDict({("tokens", "full"): full, ("masks", "all_attention_mask"): full != 0,
                         ("masks", "all_assistant_mask"): pad(assistant, False)}, batch_size=(2,))
        if reward:
            td["next"] = TensorDict({"reward": torch.ones(2, max(LENGTHS), 1)}, batch_size=(2,))
        return td
    return lazy_stack([TensorDict({("tokens", "full"): t,
                                   ("masks", "all_attention_mask"): torch.ones_like(t, dtype=torch.bool),
                                   ("masks", "all_assistant_mask"): a,
                                   **({"next": TensorDict({"reward": torch.ones(len(t), 1)})} if reward else {})})
                       for t, a in zip(tokens, assistant)])


def history_data(pad_output, reward=True):
    """The two chats of ``CHATS`` as ``("history", "full")``, with a ``[1, 1]`` reward per sample."""
    td = TensorDict(history=ChatHistory(full=History.from_chats(CHATS)), batch_size=(2,))
    if reward:
        td["next"] = TensorDict({"reward": torch.full((2, 1, 1), 0.5)}, batch_size=(2,))
    return td if pad_output else td.to_lazystack(0)


def nested(items):
    return torch.nested.as_nested_tensor(items, layout=torch.strided)


def as_rows(td, key):
    value = td.get(key, as_list=True)
    return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)


def assert_same_rows(a_td, b_td, keys, atol=2e-6, rtol=1e-5):
    for key in keys:
        a, b = as_rows(a_td, key), as_rows(b_td, key)
        assert len(a) == len(b), key
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y.detach().to(x.dtype), atol=atol, rtol=rtol, msg=lambda m: f"{key}: {m}")


KEYS = [GEN, REF, "kl_penalty", "reward"]
