"""Opacus-style programs run unchanged but for the import, and checked against veil's own accountant.

Each program is the text an Opacus user has, with the library's name written ``LIB``; :func:`run`
replaces ``LIB`` by ``veil`` (or ``opacus``) in the import lines only and executes it. The flows follow
Opacus's public tutorials: the image classifier (``ModuleValidator.fix``, ``make_private_with_epsilon``,
``BatchMemoryManager``), ``accountant.get_epsilon`` in the training loop, and checkpointing with
``save_checkpoint``/``load_checkpoint``. Where Opacus is installed, the same σ = 0 script gives the same
clipped update under both libraries, and the program texts run under Opacus too.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from veil.accounting.calibrate import dpsgd_epsilon

DATA = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

g = torch.Generator().manual_seed(0)
images = torch.randn(256, 1, 8, 8, generator=g)
labels = (images.mean(dim=(1, 2, 3)) > 0).long()
"""

IMAGE_CLASSIFIER = """
from LIB import PrivacyEngine
from LIB.validators import ModuleValidator
from LIB.utils.batch_memory_manager import BatchMemoryManager

EPOCHS = 2
EPSILON = 4.0
DELTA = 1e-3
MAX_GRAD_NORM = 1.0
BATCH_SIZE = 128
MAX_PHYSICAL_BATCH_SIZE = 64

train_loader = DataLoader(TensorDataset(images, labels), batch_size=BATCH_SIZE)
model = nn.Sequential(
    nn.Conv2d(1, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 2)
)
errors = ModuleValidator.validate(model, strict=False)
model = ModuleValidator.fix(model)
errors_after_fix = ModuleValidator.validate(model, strict=False)

optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
criterion = nn.CrossEntropyLoss()
privacy_engine = PrivacyEngine()
model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    epochs=EPOCHS,
    target_epsilon=EPSILON,
    target_delta=DELTA,
    max_grad_norm=MAX_GRAD_NORM,
)
physical_sizes = []
steps = 0
for epoch in range(EPOCHS):
    model.train()
    with BatchMemoryManager(
        data_loader=train_loader, max_physical_batch_size=MAX_PHYSICAL_BATCH_SIZE, optimizer=optimizer
    ) as memory_safe_data_loader:
        for i, (x, y) in enumerate(memory_safe_data_loader):
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            physical_sizes.append(len(x))
epsilon = privacy_engine.get_epsilon(DELTA)
sigma = optimizer.noise_multiplier
"""

ACCOUNTANT_IN_LOOP = """
from LIB import PrivacyEngine

DELTA = 1e-3
train_loader = DataLoader(TensorDataset(images.flatten(1), labels), batch_size=64)
model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
privacy_engine = PrivacyEngine(accountant="rdp")
model, optimizer, train_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    noise_multiplier=1.1,
    max_grad_norm=1.0,
)
criterion = nn.CrossEntropyLoss()
epsilons = []
for epoch in range(2):
    for x, y in train_loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    epsilons.append(privacy_engine.accountant.get_epsilon(delta=DELTA))
history = privacy_engine.accountant.history
"""

CHECKPOINT = """
from LIB import PrivacyEngine

DELTA = 1e-3

def build():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(images.flatten(1), labels), batch_size=128)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
    )
    return engine, model, optimizer, loader

def train_one_epoch(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

privacy_engine, model, optimizer, train_loader = build()
train_one_epoch(model, optimizer, train_loader)
epsilon_saved = privacy_engine.get_epsilon(DELTA)
privacy_engine.save_checkpoint(
    path=CHECKPOINT_PATH, module=model, optimizer=optimizer, checkpoint_dict={"epoch": 1}
)
weights_saved = [p.detach().clone() for p in model.parameters()]

privacy_engine, model, optimizer, train_loader = build()
checkpoint = privacy_engine.load_checkpoint(path=CHECKPOINT_PATH, module=model, optimizer=optimizer)
start_epoch = checkpoint["epoch"]
weights_loaded = [p.detach().clone() for p in model.parameters()]
epsilon_loaded = privacy_engine.get_epsilon(DELTA)
train_one_epoch(model, optimizer, train_loader)
epsilon_resumed = privacy_engine.get_epsilon(DELTA)
"""

ONE_STEP = """
from LIB import PrivacyEngine
from LIB.validators import ModuleValidator

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
)
model.load_state_dict(INITIAL_STATE)
assert ModuleValidator.is_valid(model)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
loader = DataLoader(TensorDataset(images[:32], labels[:32]), batch_size=32)  # q = 1: everyone, once
privacy_engine = PrivacyEngine()
model, optimizer, loader = privacy_engine.make_private(
    module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=0.05
)
for x, y in loader:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    batch = len(x)
update = [p.detach().clone() for p in model.parameters()]
"""


def run(program: str, lib: str, **inputs: Any) -> dict[str, Any]:
    """Execute ``program`` with ``LIB`` → ``lib`` in its import lines; returns its variables."""
    lines = [
        line.replace("LIB", lib) if line.lstrip().startswith(("from LIB", "import LIB")) else line
        for line in program.splitlines()
    ]
    assert all("LIB" not in line for line in lines), "LIB outside an import line"
    namespace: dict[str, Any] = dict(inputs)
    exec(compile(DATA + "\n".join(lines), f"<opacus-style program for {lib}>", "exec"), namespace)
    return namespace


def test_image_classifier_flow_reports_the_epsilon_of_its_steps() -> None:
    out = run(IMAGE_CLASSIFIER, "veil")
    assert len(out["errors"]) == 1 and out["errors_after_fix"] == []  # BatchNorm found, then fixed
    assert max(out["physical_sizes"]) <= 64
    engine, sigma = out["privacy_engine"], out["sigma"]
    assert engine.steps == 2 * 2  # 2 epochs × ⌈256/128⌉ logical steps, however many physical chunks
    assert len(out["physical_sizes"]) > engine.steps
    assert sum(out["physical_sizes"]) > 0
    # ε reported = ε of exactly those steps, composed by a fresh accountant; and within the target.
    assert out["epsilon"] == pytest.approx(dpsgd_epsilon(128 / 256, sigma, 4, 1e-3), rel=1e-9)
    assert out["epsilon"] <= 4.0
    assert engine.accountant_name == "pld"


def test_accountant_get_epsilon_in_the_training_loop() -> None:
    out = run(ACCOUNTANT_IN_LOOP, "veil")
    q, steps_per_epoch = 64 / 256, 4
    expected = [dpsgd_epsilon(q, 1.1, k * steps_per_epoch, 1e-3, accountant="rdp") for k in (1, 2)]
    assert out["epsilons"] == pytest.approx(expected, rel=1e-9)
    assert out["epsilons"][0] < out["epsilons"][1]
    assert [tuple(h) for h in out["history"]] == [(1.1, q, 8)]


def test_checkpoint_flow_resumes_weights_and_privacy_spent(tmp_path: Path) -> None:
    out = run(CHECKPOINT, "veil", CHECKPOINT_PATH=str(tmp_path / "ckpt.pt"))
    assert out["start_epoch"] == 1
    assert all(torch.equal(a, b) for a, b in zip(out["weights_saved"], out["weights_loaded"], strict=True))
    assert out["epsilon_loaded"] == pytest.approx(out["epsilon_saved"], rel=1e-12)
    assert out["epsilon_saved"] == pytest.approx(dpsgd_epsilon(0.5, 1.0, 2, 1e-3), rel=1e-9)
    assert out["epsilon_resumed"] == pytest.approx(dpsgd_epsilon(0.5, 1.0, 4, 1e-3), rel=1e-9)


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sigma_zero_update_is_the_naive_clipped_mean() -> None:
    """Independent reference: the per-example loop (clip each example's gradient, sum, divide by B)."""
    state = _initial_state()
    out = run(ONE_STEP, "veil", INITIAL_STATE=state)
    ns = run("", "veil")
    x, y = ns["images"][:32], ns["labels"][:32]
    ref = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    ref.load_state_dict(state)
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for i in range(32):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
        grads = [p.grad for p in ref.parameters()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        scale = min(1.0, 0.05 / float(norm))
        for t, g in zip(total, grads, strict=True):
            t += g * scale
    expected = [p.detach() - t / 32 for p, t in zip(ref.parameters(), total, strict=True)]
    assert out["batch"] == 32
    for got, want in zip(out["update"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sigma_zero_same_update_as_opacus() -> None:
    """The same script under Opacus and veil at σ = 0, q = 1: the same clipped update (to 1e-5)."""
    pytest.importorskip("opacus")
    state = _initial_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = run(ONE_STEP, "opacus", INITIAL_STATE=state)
    ours = run(ONE_STEP, "veil", INITIAL_STATE=state)
    assert theirs["batch"] == ours["batch"] == 32
    changed = 0
    for a, b in zip(theirs["update"], ours["update"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        changed += int(not torch.equal(a, state_value(state, a)))
    assert changed > 0


def state_value(state: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The initial value with ``like``'s shape (for 'the step moved something')."""
    return next(v for v in state.values() if v.shape == like.shape)


def test_programs_are_opacus_programs(tmp_path: Path) -> None:
    """The same texts run under Opacus itself (so they are Opacus code, not veil code in disguise)."""
    pytest.importorskip("opacus")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop = run(ACCOUNTANT_IN_LOOP, "opacus")
        ckpt = run(CHECKPOINT, "opacus", CHECKPOINT_PATH=str(tmp_path / "opacus.pt"))
    ours = run(ACCOUNTANT_IN_LOOP, "veil")
    # Both use RDP on the same steps; the two libraries' RDP conversions agree to a few percent.
    assert loop["epsilons"] == pytest.approx(ours["epsilons"], rel=0.05)
    assert ckpt["start_epoch"] == 1
