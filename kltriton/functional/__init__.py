"""The public functions, one per file: input checks and the label layout (``kltriton._inputs``), the route
(``kltriton.route``), and the ``[N]`` PyTorch work after the kernels (estimators, reward shaping, the loss)."""
