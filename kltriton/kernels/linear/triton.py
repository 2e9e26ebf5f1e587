"""Triton backend of the ``linear`` family: cuBLAS tiles folded by the Triton ``stream`` kernel."""
from kltriton.kernels.linear import tiles
from kltriton.kernels.stream import triton as stream

forward, backward = tiles.bind(stream)
