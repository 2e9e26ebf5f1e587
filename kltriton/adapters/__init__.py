"""Adapters for libraries built on top of the kernels: import the one you use.

- ``kltriton.adapters.torchrl``: drop-ins for torchrl's LLM KL transforms and KL controllers
  (needs torchrl, the ``[torchrl]`` extra).
- ``kltriton.adapters.hf``: ``causal_lm_logprobs`` for Hugging Face causal LMs.

Nothing is imported here, so ``import kltriton`` never imports torchrl or transformers.
"""
