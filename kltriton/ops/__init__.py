"""Public ops, each a registered ``torch.library`` custom op (``kltriton::<name>``)."""
