"""Reference backend of the ``linear`` family: the GEMM tiles folded by the reference ``stream``
kernel (any float dtype, float64 included: the oracle mode)."""
from kltriton.kernels.linear import tiles
from kltriton.kernels.divergence import reference as divergence
from kltriton.kernels.loss import reference as loss
from kltriton.kernels.stream import reference as stream

forward, backward, column_forward, column_backward = tiles.bind(stream)
loss_forward = tiles.bind_loss(loss)
jsd_forward, jsd_backward, divergence_loss = tiles.bind_divergence(divergence)
