"""Make a trainer library's own code compute with kltriton: one call each, undone by ``.undo()``.

- ``kltriton.integrations.trl.apply()``: TRL's ``GRPOTrainer``: its LM head's log-probs and entropy, and
  its loss (``pip install kltriton[trl]``).
- ``kltriton.integrations.verl.apply()``: verl's log-prob and entropy functions (``pip install
  kltriton[verl]``); ``kltriton.integrations.verl_autoapply`` applies it on import, for verl's Ray workers
  (``VERL_USE_EXTERNAL_MODULES``).
- ``kltriton.integrations.openrlhf.apply()``: OpenRLHF's log-prob and entropy helpers in
  ``openrlhf.models.utils`` (``pip install kltriton[openrlhf]``).

Each calls kltriton's public functions (the drop-ins of ``kltriton.dropins`` where the library's helper has
their signature).

Nothing is imported here: importing a submodule imports only kltriton; the library is imported
when ``apply()`` is called.
"""
