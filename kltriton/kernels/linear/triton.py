"""Triton backend of the ``linear`` family: cuBLAS tiles folded by the Triton ``stream`` kernel."""
from kltriton.kernels.linear import tiles
from kltriton.kernels.divergence import triton as divergence
from kltriton.kernels.loss import triton as loss
from kltriton.kernels.stream import triton as stream

forward, backward, column_forward, column_backward = tiles.bind(stream)
loss_forward = tiles.bind_loss(loss)
jsd_forward, jsd_backward, divergence_loss = tiles.bind_divergence(divergence)
