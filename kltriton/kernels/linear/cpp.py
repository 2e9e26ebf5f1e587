"""C++ backend of the ``linear`` family: CPU BLAS tiles folded by the C++ ``stream`` kernel."""
from kltriton.kernels.linear import tiles
from kltriton.kernels.divergence import cpp as divergence
from kltriton.kernels.loss import cpp as loss
from kltriton.kernels.stream import cpp as stream

forward, backward, column_forward, column_backward = tiles.bind(stream)
loss_forward = tiles.bind_loss(loss)
jsd_forward, jsd_backward, divergence_loss = tiles.bind_divergence(divergence)
