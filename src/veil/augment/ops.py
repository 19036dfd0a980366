"""Image augmentations as batched tensor ops: random flips and shifts (a crop of a padded image).

Inputs are ``[N, C, H, W]`` float tensors. The randomness comes from the caller's generator and is
independent of the data, so augmenting changes no privacy analysis on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["augment", "random_flip", "random_shift"]


def random_flip(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each image mirrored left-right with probability 1/2."""
    flip = torch.rand(x.shape[0], generator=gen) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1).to(x.device), x.flip(-1), x)


def random_shift(x: torch.Tensor, gen: torch.Generator, pad: int = 2) -> torch.Tensor:
    """Each image shifted by up to ``pad`` pixels in each direction: a random crop of the image
    padded by reflection (the crop-and-pad augmentation of De et al.)."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    rows = (dy.view(n, 1) + torch.arange(h).view(1, h)).to(x.device)
    cols = (dx.view(n, 1) + torch.arange(w).view(1, w)).to(x.device)
    idx = torch.arange(n, device=x.device).view(n, 1, 1)
    out = padded.permute(0, 2, 3, 1)[idx, rows.view(n, h, 1), cols.view(n, 1, w)]
    return out.permute(0, 3, 1, 2)


def augment(x: torch.Tensor, gen: torch.Generator, *, flip: bool = True, pad: int = 2) -> torch.Tensor:
    """One random augmentation of each image: a shift, then (optionally) a flip."""
    out = random_shift(x, gen, pad) if pad > 0 else x
    return random_flip(out, gen) if flip else out
