"""Shared by the TRL integration tests: tiny Llama models with random weights and a word-level tokenizer, built
from a config and saved locally (no downloads)."""
import torch

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "log", "big", "small", "red", "blue", "and", "then"]


def tiny_llama(path, seed=0, hidden_size=32):
    """A 2-layer Llama with random weights (``seed``) and a word-level tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                                        unk_token="[UNK]")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
