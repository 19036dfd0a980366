"""``veil.lightning.DifferentialPrivacy``: the Lightning path against a naive per-example loop, ε through
the Trainer's logger, the registry charge, the report, and refusals. One process (see
``test_lightning_ddp.py`` for two)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from veil.errors import ConfigError, SamplingError  # noqa: E402
from veil.lightning import DifferentialPrivacy  # noqa: E402
from veil.optimizer import DPOptimizer  # noqa: E402
from veil.registry.charge import open_registry  # noqa: E402
from veil.registry.identity import dataset_identity  # noqa: E402


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _loader(n: int = 64, batch_size: int = 16, dtype: torch.dtype = torch.float32) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 5, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _trainer(tmp_path: Path, callback: DifferentialPrivacy, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "max_steps": 4,
        "accelerator": "cpu",
        "devices": 1,
        "default_root_dir": str(tmp_path),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
        "logger": pl.loggers.CSVLogger(str(tmp_path), name="logs"),
        "callbacks": [callback],
    }
    settings.update(overrides)
    return pl.Trainer(**settings)


def _dp(**overrides: Any) -> DifferentialPrivacy:
    settings: dict[str, Any] = {
        "target_epsilon": 4.0,
        "target_delta": 1e-3,
        "max_grad_norm": 0.5,
        "dataset_id": "toy-table",
    }
    settings.update(overrides)
    return DifferentialPrivacy(**settings)


def test_lightning_path_clips_like_a_per_example_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clipped sum each step's noise is added to equals the naive per-example loop (float64);
    C is the median per-example norm, so some examples are clipped and some are not."""
    module = Classifier(lr=0.0).double()
    reference = Classifier(lr=0.0).double()
    loader = _loader(dtype=torch.float64)
    x_all, y_all = loader.dataset.tensors  # type: ignore[attr-defined]
    params = list(reference.parameters())

    def gradient(i: int) -> list[torch.Tensor]:
        loss = F.cross_entropy(reference(x_all[i : i + 1]), y_all[i : i + 1])
        return list(torch.autograd.grad(loss, params))

    def norm(grads: list[torch.Tensor]) -> float:
        return float(torch.sqrt(sum((g**2).sum() for g in grads)))

    clip = float(torch.tensor([norm(gradient(i)) for i in range(len(y_all))]).median())
    sums: list[list[torch.Tensor]] = []
    original = DPOptimizer._write_private_grads

    def recording(self: DPOptimizer) -> None:
        sums.append([s.detach().clone() for s in self.clipper.clipped_sum()])
        original(self)

    monkeypatch.setattr(DPOptimizer, "_write_private_grads", recording)
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            batches.append((batch[0].clone(), batch[1].clone()))

    callback = _dp(max_grad_norm=clip)
    _trainer(tmp_path, callback, callbacks=[callback, Recorder()]).fit(module, loader)
    assert len(sums) == len(batches) == 4
    rows = {tuple(x.tolist()): i for i, x in enumerate(x_all)}
    for got, (xb, _) in zip(sums, batches, strict=True):
        want = [torch.zeros_like(p) for p in params]
        for x in xb:
            grads = gradient(rows[tuple(x.tolist())])
            factor = min(1.0, clip / (norm(grads) + 1e-12))
            for w, g in zip(want, grads, strict=True):
                w.add_(g * factor)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_epsilon_logged_registry_charged_report_written(tmp_path: Path) -> None:
    callback = _dp()
    module = Classifier()
    before = [p.detach().clone() for p in module.parameters()]
    _trainer(tmp_path, callback, log_every_n_steps=2).fit(module, _loader())
    assert 0 < callback.epsilon <= 4.0 and callback.epsilon > 0.95 * 4.0  # calibrated to 4 steps
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    with open(next(tmp_path.glob("logs/*/metrics.csv"))) as f:
        logged = [(int(r["step"]), float(r["epsilon"])) for r in csv.DictReader(f) if r.get("epsilon")]
    assert [s for s, _ in logged] == [2, 4]
    assert logged[-1][1] == pytest.approx(callback.epsilon)
    report = json.loads((tmp_path / "veil" / "report.json").read_text())
    assert report["steps"] == 4 and report["framework"] == "PyTorch Lightning"
    assert report["epsilon_spent"] == pytest.approx(callback.epsilon)
    assert report["sampling_rate"] == pytest.approx(16 / 64)
    registry = open_registry()
    try:
        status = registry.status(dataset_identity(dataset_id="toy-table"), per_run=True)
    finally:
        registry.close()
    assert [r.job for r in status.runs] == ["lightning"]
    assert status.spent_epsilon == pytest.approx(callback.epsilon, rel=1e-3)


@pytest.mark.parametrize(
    ("setting", "match"),
    [({"gradient_clip_val": 1.0}, "gradient_clip_val"), ({"accumulate_grad_batches": 2}, "accumulate")],
)
def test_refuses_before_training(tmp_path: Path, setting: dict[str, Any], match: str) -> None:
    callback = _dp()
    with pytest.raises(ConfigError, match=match):
        _trainer(tmp_path, callback, **setting).fit(Classifier(), _loader())
    assert callback.run is None and not (tmp_path / "veil").exists()


class _Plateau(Classifier):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "train_loss"}}


class _LateRestore(pl.strategies.SingleDeviceStrategy):
    """A strategy that restores checkpoints after on_fit_start, as DeepSpeed, FSDP and ModelParallel do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("setting", "module", "match"),
    [
        ({"callbacks": [pl.callbacks.EarlyStopping(monitor="train_loss")]}, Classifier, "EarlyStopping"),
        (
            {"callbacks": [pl.callbacks.ModelCheckpoint(monitor="train_loss")], "enable_checkpointing": True},
            Classifier,
            "ModelCheckpoint.monitor",
        ),
        ({}, _Plateau, "ReduceLROnPlateau"),
        ({"strategy": _LateRestore(device=torch.device("cpu"))}, Classifier, "_LateRestore"),
    ],
    ids=["early-stopping", "checkpoint-monitor", "plateau", "late-restore"],
)
def test_refuses_a_noiseless_score_steering_the_run(
    tmp_path: Path, setting: dict[str, Any], module: type, match: str
) -> None:
    """The rule DPTrainer applies: a stop, a kept checkpoint or a learning rate chosen by a score
    computed without noise is refused at on_fit_start, before the registry is charged or a row read;
    so is a strategy that would restore a checkpoint only after that hook."""
    callback = _dp()
    callbacks = [callback, *setting.pop("callbacks", [])]
    with pytest.raises(ConfigError, match=match):
        _trainer(tmp_path, callback, callbacks=callbacks, **setting).fit(module(), _loader())
    assert callback.run is None and not (tmp_path / "veil").exists()
    registry = open_registry()
    try:
        assert not registry.status(dataset_identity(dataset_id="toy-table")).runs
    finally:
        registry.close()


class _CountedRows(TensorDataset):
    """The private rows, counting every read."""

    reads = 0

    def __getitem__(self, index: Any) -> Any:
        self.reads += 1
        return super().__getitem__(index)


class _OwnLoader(Classifier):
    """A module that serves its loader and its batch size (what BatchSizeFinder tunes) itself."""

    def __init__(self, rows: _CountedRows) -> None:
        super().__init__()
        self.rows, self.batch_size = rows, 16

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size)


@pytest.mark.parametrize(
    "tuner",
    [
        lambda: pl.callbacks.LearningRateFinder(num_training_steps=5, early_stop_threshold=None),
        lambda: pl.callbacks.BatchSizeFinder(max_trials=2),
    ],
    ids=["lr-finder", "batch-size-finder"],
)
def test_refuses_a_tuner_before_it_reads_a_row(tmp_path: Path, tuner: Any) -> None:
    """Lightning moves its tuner callbacks to the front, and their on_fit_start trains without noise
    on the private loader (a learning rate or batch size chosen from those steps): refused by name at
    setup, before any on_fit_start, so no row is read and nothing charged (revF F5)."""
    dataset = _loader().dataset
    rows = _CountedRows(*dataset.tensors)  # type: ignore[attr-defined]
    callback, finder = _dp(), tuner()
    with pytest.raises(ConfigError, match=type(finder).__name__) as refused:
        _trainer(tmp_path, callback, callbacks=[callback, finder]).fit(_OwnLoader(rows))
    assert "veil tune" in str(refused.value)
    assert rows.reads == 0 and callback.run is None and not (tmp_path / "veil").exists()
    registry = open_registry()
    try:
        assert not registry.status(dataset_identity(dataset_id="toy-table")).runs
    finally:
        registry.close()


def test_a_plain_checkpoint_is_kept(tmp_path: Path) -> None:
    """ModelCheckpoint without monitor (Lightning's default: the last weights) is not a selection."""
    callback = _dp()
    _trainer(tmp_path, callback, enable_checkpointing=True).fit(Classifier(), _loader())
    assert callback.run is not None and callback.run.steps == 4
    assert list(tmp_path.glob("logs/*/checkpoints/*.ckpt"))


def test_refuses_a_resumed_fit_before_charging(tmp_path: Path) -> None:
    """``fit(..., ckpt_path=...)`` would continue weights that went through the first fit's noisy
    steps with a fresh accountant (the report would under-count ε): refused at on_fit_start, before
    the second run is charged; the first run's report and charge stay as they were."""
    first = _dp(out=tmp_path / "first")
    _trainer(tmp_path, first, enable_checkpointing=True).fit(Classifier(), _loader())
    checkpoint = next(tmp_path.glob("logs/*/checkpoints/*.ckpt"))
    report = (tmp_path / "first" / "report.json").read_text()
    second = _dp(out=tmp_path / "second")
    with pytest.raises(ConfigError, match="ckpt_path"):
        _trainer(tmp_path, second, max_steps=8).fit(Classifier(), _loader(), ckpt_path=str(checkpoint))
    assert second.run is None and not (tmp_path / "second").exists()
    assert (tmp_path / "first" / "report.json").read_text() == report
    registry = open_registry()
    try:
        status = registry.status(dataset_identity(dataset_id="toy-table"), per_run=True)
    finally:
        registry.close()
    assert len(status.runs) == 1 and status.spent_epsilon == pytest.approx(first.epsilon, rel=1e-3)


def test_refuses_a_second_fit_with_the_same_callback(tmp_path: Path) -> None:
    """Fitting the same Trainer again continues the same weights: the callback's second on_fit_start is
    refused before a second run is charged, and the first run's report stays."""
    callback = _dp()
    trainer = _trainer(tmp_path, callback)
    module = Classifier()
    trainer.fit(module, _loader())
    report = callback.report
    trainer.fit_loop.epoch_loop.max_steps = 8  # continue the same weights
    with pytest.raises(ConfigError, match="second fit"):
        trainer.fit(module, _loader())
    assert callback.report is report and callback.run is not None and callback.run.steps == 4
    registry = open_registry()
    try:
        assert len(registry.status(dataset_identity(dataset_id="toy-table"), per_run=True).runs) == 1
    finally:
        registry.close()


class _UserStop(pl.Callback):
    """A user's own stop, set after the first batch (it could have read any noiseless score)."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        trainer.should_stop = True


def test_a_run_stopped_before_its_plan_is_not_release_ready(tmp_path: Path) -> None:
    """A callback the adapter does not know (or one appended after ``on_fit_start``) may stop the loop
    on a value computed without noise: the run that ends before its planned steps fails
    ``planned_steps_taken`` and keeps its whole plan charged; the complete run is release-ready."""
    reports = {}
    for name, extra in (("stopped", [_UserStop()]), ("complete", [])):
        dp = _dp(dataset_id=f"toy-{name}")
        _trainer(tmp_path / name, dp, callbacks=[dp, *extra]).fit(Classifier(), _loader())
        assert dp.report is not None
        reports[name] = dp.report
    assert reports["stopped"]["steps"] < reports["stopped"]["steps_planned"] == 4
    assert not reports["stopped"]["release_ready"] and reports["complete"]["release_ready"]
    registry = open_registry()
    try:
        spent = [
            registry.status(dataset_identity(dataset_id=f"toy-{r}"), per_run=True).spent_epsilon
            for r in reports
        ]
    finally:
        registry.close()
    assert spent[0] == pytest.approx(spent[1], rel=1e-6)


class _Manual(Classifier):
    """Manual optimization: ``steps`` optimizer steps in each training step."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.steps = steps

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        for _ in range(self.steps):
            optimizer.zero_grad()
            self.manual_backward(F.cross_entropy(self(x), y))
            optimizer.step()


def test_manual_optimization_with_one_step_per_batch_is_release_ready(tmp_path: Path) -> None:
    """Over two epochs (4 batches each), one manual step per batch: one release per batch."""
    dp = _dp(dataset_id="toy-manual")
    _trainer(tmp_path, dp, max_steps=6).fit(_Manual(steps=1), _loader())
    assert dp.report is not None and dp.report["steps"] == 6 and dp.report["release_ready"]


def test_two_manual_steps_on_one_batch_are_refused(tmp_path: Path) -> None:
    """revF's a8 in Lightning: a second ``opt.step()`` on the same sampled batch is refused before its
    noise or its event; the run is not release-ready and its whole plan stays charged (it was
    reported release-ready at ε under-stated 2.5× before)."""
    dp = _dp(dataset_id="toy-twice")
    with pytest.raises(SamplingError, match="second step"):
        _trainer(tmp_path, dp, max_steps=4).fit(_Manual(steps=2), _loader())
    assert dp.report is not None and dp.report["steps"] == 1 and not dp.report["release_ready"]
    registry = open_registry()
    try:
        spent = registry.status(dataset_identity(dataset_id="toy-twice"), per_run=True).spent_epsilon
    finally:
        registry.close()
    assert spent == pytest.approx(4.0, rel=0.05)  # the plan (calibrated to ε = 4 over 4 steps)
