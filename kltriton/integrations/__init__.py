"""Make a trainer library's own code compute with kltriton: one call each, undone by ``.undo()``.

- ``kltriton.integrations.trl.apply()``: TRL's ``GRPOTrainer`` (``pip install kltriton[trl]``).
- ``kltriton.integrations.verl.apply()``: verl's log-prob, entropy, KL and policy-loss functions
  (``pip install kltriton[verl]``); ``kltriton.integrations.verl_autoapply`` applies it on import, for
  verl's Ray workers (``VERL_USE_EXTERNAL_MODULES``).
- ``kltriton.integrations.openrlhf.apply()``: OpenRLHF's ``openrlhf.models.utils`` functions and its
  ``PolicyLoss`` (``pip install kltriton[openrlhf]``).

Nothing is imported here: importing a submodule imports only kltriton; the library is imported
when ``apply()`` is called.
"""
