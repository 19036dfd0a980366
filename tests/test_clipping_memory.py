"""What a private step keeps alive: nothing of a chunk's inputs once the step is done.

Issue 29: ``veil.clipping._tree.flatten`` was a recursive closure, a reference cycle holding the
flattened tensors, so each chunk's input batch waited for Python's cyclic garbage collector; a
Fashion-MNIST run kept ~250 MB more resident per logical step of 16 chunks until a collection
(2.6–2.9 GB instead of ~1.8 GB). These tests disable the collector and check by weak reference
that the inputs are freed by reference counting alone; each fails on the cyclic ``flatten``.
"""

from __future__ import annotations

import gc
import weakref
from collections import namedtuple
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from veil.clipping._tree import flatten, map_tensors
from veil.engine import PrivacyEngine


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


Pair = namedtuple("Pair", ["a", "b"])


def test_flatten_rebuilds_nested_structures() -> None:
    t, u = torch.zeros(2), torch.ones(3)
    obj = ((t, [u, 1]), {"k": Pair(t, "s")})
    leaves, build = flatten(obj)
    assert len(leaves) == 5 and leaves[0] is t and leaves[1] is u and leaves[2] == 1
    rebuilt = build(leaves)
    assert rebuilt[0][0] is t and rebuilt[0][1] == [u, 1] and isinstance(rebuilt[1]["k"], Pair)
    doubled = map_tensors(obj, lambda x: x * 2)
    assert torch.equal(doubled[0][1][0], u * 2) and doubled[1]["k"].b == "s"


def test_flatten_keeps_no_reference_cycle(no_cyclic_gc: None) -> None:
    t = torch.zeros(1000)
    alive = weakref.ref(t)
    leaves, build = flatten(((t,), {"x": [t, 3]}))
    build(leaves)
    map_tensors((t, {"y": t}), lambda x: x + 1)
    del leaves, build, t
    survived = alive() is not None
    assert not survived, "flatten left the tensor in a reference cycle (freed only by gc.collect)"


def test_private_steps_free_each_chunks_inputs(no_cyclic_gc: None) -> None:
    """The preset's head (GroupNorm + linear on fixed features, whose first layer's output is
    reattached by the clipper): after each chunk's step the chunk's input is gone."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.GroupNorm(3, 9), nn.Flatten(), nn.Linear(9 * 4, 3))
    data = TensorDataset(torch.randn(64, 9, 2, 2), torch.randint(0, 3, (64,)))
    engine = PrivacyEngine(seed=0, reproducible=True)
    model, optimizer, loader = engine.make_private(
        module=head,
        optimizer=torch.optim.SGD(head.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=32),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(),
        physical_batch_size=8,
    )
    steps = 0
    for _ in range(2):
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            del xb, yb, loss
    assert steps >= 8
    # The clipper keeps detached views of the inputs (other tensor objects, the same memory): count
    # every live tensor of a chunk's shape (at most 8 rows; the dataset has 64) instead of watching
    # the loader's objects.
    kept = [
        o
        for o in gc.get_objects()
        if type(o) is torch.Tensor and o.shape[1:] == (9, 2, 2) and 0 < o.shape[0] <= 8
    ]
    assert len(kept) <= 1, f"{len(kept)} chunk inputs still alive after {steps} steps"
