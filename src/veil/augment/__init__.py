"""Augmentation multiplicity (De et al. 2022): K augmentations of each example, their gradients
averaged *before* clipping. See :mod:`veil.augment.multiplicity`."""
