"""Custom ops (``torch.library``, namespace ``kltriton``), one file per kernel family: ``stream``, ``linear``,
``loss``. They define ops only; ``kltriton.route`` decides which one a public function calls."""
