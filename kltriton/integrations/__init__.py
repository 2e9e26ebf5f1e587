"""Make a trainer library's own code compute with kltriton: one call each, undone by ``.undo()``.

- ``kltriton.integrations.trl.apply()``: TRL's ``GRPOTrainer``: its LM head's log-probs and entropy, and
  its loss (TRL 1.16.0, the ``[trl]`` extra).
- ``kltriton.integrations.verl.apply()``: verl's log-prob and entropy functions (verl 0.9.1, the ``[verl]``
  extra); ``kltriton.integrations.verl_autoapply`` applies it on import, for verl's Ray workers
  (``VERL_USE_EXTERNAL_MODULES``).
- ``kltriton.integrations.openrlhf.apply()``: OpenRLHF's log-prob and entropy helpers in
  ``openrlhf.models.utils`` (OpenRLHF 0.11.2, installed as docs/install.md says: it has no extra).

Each calls kltriton's public functions (the drop-ins of ``kltriton.dropins`` where the library's helper has
their signature).

Nothing is imported here: importing a submodule imports only kltriton; the library is imported
when ``apply()`` is called.
"""
