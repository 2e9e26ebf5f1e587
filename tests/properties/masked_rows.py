"""Masked logits rows shared by the extreme-input tests: vocab padding, banned tokens, masked streaming blocks and
a ``-max`` / ``+max`` row."""
import torch

# V = 4500: two Triton blocks of 4096 and nine C++ blocks of 512 floats, so masks cross block edges.
VOCAB = 4500


def masked_rows(dtype, mask_value, with_max_row):
    """``[R, V]`` policy and reference logits in ``dtype`` with masked stretches, and targets ``[R]``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, VOCAB, generator=g) * 3
    y = x + torch.randn(7, VOCAB, generator=g)
    x[0, -300:] = mask_value            # vocab padding at the end (last block), both models
    y[0, -300:] = mask_value
    x[1, :4200] = mask_value            # masked first block: the next block's max rescales by ~0
    y[1, :4200] = mask_value
    x[2, ::2] = mask_value              # every other token banned, both models
    y[2, ::2] = mask_value
    x[3, 100:200] = mask_value          # policy masked only: p = 0 there, no KL term
    y[4, 1::3] = -1e30                  # reference masked where the policy has mass: KL ~ 1e29
    x[5, :] = mask_value                # all masked but one token in the second block
    x[5, 4400] = 5.0
    y[5] = x[5]
    if with_max_row:
        big = torch.finfo(dtype).max
        x[6, :] = -big                  # -max everywhere, +max at one token (in the second block)
        x[6, 4321] = big
        y[6] = x[6]
    targets = torch.tensor([5, 4300, 1, 150, 9, 4400, 4321 if with_max_row else 7])
    return x.to(dtype), y.to(dtype), targets


MASKS = {"finfo_min": None, "neg_1e30": -1e30, "neg_inf": float("-inf")}
