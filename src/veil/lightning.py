"""``DifferentialPrivacy``: a Lightning callback that trains with veil's DP-SGD (extra ``veil[lightning]``).

    trainer = L.Trainer(max_epochs=3, callbacks=[DifferentialPrivacy(
        target_epsilon=3, target_delta=1e-5, max_grad_norm=1.0, dataset_id="fashion")])
    trainer.fit(module, train_loader)     # callback.epsilon: ε spent so far

A thin adapter over :mod:`veil.pipeline.external`. At ``on_fit_start`` (the module's optimizer is
configured, no training batch has been read) the callback plans σ for the Trainer's planned steps
(``max_steps``, else ``max_epochs × ⌈N/B⌉``), charges the dataset's registry budget, and replaces the
module's optimizer and train dataloader by the engine's: Poisson-sampled logical batches of expected
size ``batch_size`` of the user's loader, exact per-sample clipping, secure noise, one accounted event
per optimizer step. Manual optimization takes one ``opt.step()`` per batch: a second one on the same
batch is refused before its noise or its event (:mod:`veil.optimizer`), and the fit ends not
release-ready with its whole plan charged. ε is logged through the Trainer's loggers (``epsilon``; MLflow with
``MLFlowLogger``) every ``log_every_n_steps`` and at the end, and ``report.json``/``report.html`` are
written to ``<default_root_dir>/veil`` (or ``out``) when fitting ends.

Across processes (``strategy="ddp"``, gloo on CPU or NCCL): the callback trains the module under
Lightning's DDP wrapper but never through its gradient averaging — DDP would average *unclipped*
gradients — and lets the engine do what ``veil train --nproc-per-node`` does (:mod:`veil.distributed`):
each rank takes its shard of every Poisson batch, the clipped sums are all-reduced once per step with
one noise draw across ranks, and the ranks apply the same update. The registry is charged, and the
report written, by rank 0 alone.

Guarantee: that of :mod:`veil.pipeline.external` (add/remove-one on the train set's examples).
Refused before training, with one line each: at the callback's ``setup`` (called for every callback
before any ``on_fit_start``) Lightning's tuner callbacks ``LearningRateFinder`` and ``BatchSizeFinder``,
whose ``on_fit_start`` Lightning runs first and which train without noise on the private loader to
choose a learning rate or batch size (choose them with ``veil tune``); at ``setup`` or
``on_fit_start`` (before the budget is reserved or a row read) a fit resumed from a checkpoint
(``fit(..., ckpt_path=...)``: the accountant would restart and the report under-count ε) or a second
fit with the same callback, a strategy that restores
checkpoints only after ``on_fit_start`` (DeepSpeed, FSDP, ModelParallel), a score computed without
noise steering the run (``EarlyStopping``, ``ModelCheckpoint(monitor=...)``, a ``ReduceLROnPlateau``
scheduler: the same rule as :class:`veil.hf.DPTrainer`), gradient clipping by the Trainer
(``gradient_clip_val``: it would clip the private gradient again, harmlessly but misleadingly),
``accumulate_grad_batches > 1`` (batches are Poisson-sampled logical batches already; set the
loader's ``batch_size`` instead), more than one optimizer, a train loader without ``batch_size`` or
over a dataset without length. What the module itself logs (``self.log``) is not covered, as the
report says. A callback the adapter cannot read (one of the user's own, or one appended after
``on_fit_start``) may still stop the loop: a run that ends before its planned steps is reported not
release-ready and keeps its whole plan charged (:meth:`veil.pipeline.external.ExternalRun.finish`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from veil.errors import ConfigError
from veil.pipeline.external import (
    ExternalRun,
    PrivacyTarget,
    noiseless_score_refused,
    planned_steps,
    resume_refused,
)

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the extra is missing
    raise ConfigError(
        "veil.lightning",
        "lightning",
        "the Lightning callback needs the lightning package, which is not installed",
        "pip install 'veil[lightning]'",
    ) from None

__all__ = ["DifferentialPrivacy"]

_FRAMEWORK = "PyTorch Lightning"


class DifferentialPrivacy(Callback):
    """Make a LightningModule's training differentially private (see the module doc)."""

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float,
        max_grad_norm: float,
        *,
        noise_multiplier: float | None = None,
        dataset_id: str | None = None,
        accountant: Literal["pld", "rdp"] = "pld",
        loss_reduction: Literal["mean", "sum"] = "mean",
        out: str | Path | None = None,
    ) -> None:
        self.target = PrivacyTarget(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            dataset_id=dataset_id,
            accountant=accountant,
        )
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(
                "loss_reduction", loss_reduction, "the loss reduces by mean or sum", "pass 'mean' or 'sum'"
            )
        self.loss_reduction = loss_reduction
        self.out = out
        self.run: ExternalRun | None = None
        self.report: dict[str, Any] | None = None
        self._logged_step = -1

    @property
    def epsilon(self) -> float:
        """ε spent so far at the target δ (0 before the first step)."""
        return 0.0 if self.run is None else self.run.epsilon

    # -- before the first batch ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse what the Trainer's settings and callbacks already show, at the one hook every callback
        gets before any ``on_fit_start``: Lightning runs its tuner callbacks' ``on_fit_start`` first,
        and they train on the private loader (revF F5)."""
        if stage != "fit":
            return
        if self.run is not None:
            raise ConfigError(
                "DifferentialPrivacy",
                "a second fit",
                "one callback accounts for one fit; a second would start a new accountant, and on the same "
                "module (a Trainer fitted again) its report would under-count ε",
                "build a new DifferentialPrivacy callback (and module) for another run: its spend is "
                "charged to the same dataset",
            )
        _refuse_at_setup(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _refuse_at_fit_start(trainer)
        source = trainer.fit_loop._data_source
        loader = source.dataloader()
        dataset = getattr(loader, "dataset", None)
        batch_size = getattr(loader, "batch_size", None)
        if dataset is None or not hasattr(dataset, "__len__") or batch_size is None:
            raise ConfigError(
                "train_dataloader",
                type(loader).__name__,
                "Poisson sampling needs a map-style dataset of known size and the loader's batch_size "
                "(the expected batch size q·N)",
                "return a torch DataLoader(dataset, batch_size=B) from train_dataloader",
            )
        n = len(dataset)
        _, steps = planned_steps(n, batch_size, float(trainer.max_epochs or 1), trainer.max_steps)
        out = Path(self.out) if self.out is not None else Path(trainer.default_root_dir) / "veil"
        run = ExternalRun(self.target, job="lightning", out=out, primary=trainer.is_global_zero)
        run.begin(n, batch_size, steps)
        self.run = run
        try:
            _, optimizer, private_loader = run.make_private(
                pl_module,
                trainer.optimizers[0],
                loader,
                loss_reduction=self.loss_reduction,
                distributed=trainer.world_size > 1,  # the engine all-reduces the clipped sums itself
            )
        except BaseException:
            self.report = run.finish(framework=_FRAMEWORK, world_size=trainer.world_size)
            raise
        _bypass_gradient_averaging(trainer)
        trainer._accelerator_connector.use_distributed_sampler = False  # veil shards the Poisson batches
        trainer.strategy.optimizers = [optimizer]
        source.instance = private_loader
        trainer.fit_loop._combined_loader = None  # built from the new source when the loop starts

    # -- during training -------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.run is not None:
            self.run.check_step_fits()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        run = self.run
        if run is None or run.steps == self._logged_step:
            return
        if (
            run.steps % max(1, getattr(trainer, "log_every_n_steps", 50)) == 0
            or run.steps >= run.steps_planned
        ):
            self._log_epsilon(trainer)

    def _log_epsilon(self, trainer: pl.Trainer) -> None:
        assert self.run is not None
        eps = self.run.record_epsilon()
        self._logged_step = self.run.steps
        for logger in trainer.loggers:
            logger.log_metrics({"epsilon": eps}, step=self.run.steps)

    # -- the end ---------------------------------------------------------------------------------
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        if self.run is None:
            return
        if self.run.steps != self._logged_step:
            self._log_epsilon(trainer)
        report = self.run.finish(framework=_FRAMEWORK, world_size=trainer.world_size)
        if report is not None:
            self.report = report


def _refuse_at_setup(trainer: pl.Trainer) -> None:
    """What breaks the guarantee and the Trainer's settings and callbacks show at ``setup``: refused
    before any callback's ``on_fit_start`` (a tuner's reads the private loader), before the budget
    is reserved and before the engine reads a row (its forward probe)."""
    if trainer.strategy.restore_checkpoint_after_setup:
        raise ConfigError(
            "strategy",
            type(trainer.strategy).__name__,
            "this strategy restores a checkpoint only after on_fit_start, when the run is already charged "
            "and rows read, so a resume (which would under-count ε) could not be refused in time; its "
            "sharded layers are not what veil's per-sample clipping sees either",
            'use strategy="ddp" (or one device)',
        )
    _refuse_score_feedback(trainer)
    if trainer.gradient_clip_val:
        raise ConfigError(
            "gradient_clip_val",
            trainer.gradient_clip_val,
            "veil clips each example's gradient; the Trainer's clipping of the summed, noisy gradient is "
            "not part of the guarantee and would hide the step's real scale",
            "drop gradient_clip_val (the callback's max_grad_norm is the per-example clip norm)",
        )
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            "accumulate_grad_batches",
            trainer.accumulate_grad_batches,
            "each optimizer step is one Poisson-sampled logical batch; a fixed number of loader batches "
            "per step would not be one",
            "drop accumulate_grad_batches and set the loader's batch_size to the expected batch size",
        )


def _refuse_at_fit_start(trainer: pl.Trainer) -> None:
    """What breaks the guarantee and Lightning sets only after ``setup`` (the checkpoint a fit resumes
    from, the configured optimizers and schedulers): refused at ``on_fit_start``, before the budget is
    reserved and before the engine reads a row. A tuner, which would read rows first, was refused at
    ``setup``."""
    if trainer.ckpt_path is not None:
        raise resume_refused(
            "ckpt_path",
            str(trainer.ckpt_path),
            "fit from the start (a new run, charged to the same dataset), or train with veil train, "
            "whose --resume continues the ledger",
        )
    for config in trainer.lr_scheduler_configs:
        if config.reduce_on_plateau:
            raise noiseless_score_refused(
                "lr_scheduler",
                type(config.scheduler).__name__,
                "setting the learning rate",
                "use a schedule fixed in advance (StepLR, CosineAnnealingLR, ...)",
            )
    if len(trainer.optimizers) != 1:
        raise ConfigError(
            "configure_optimizers",
            f"{len(trainer.optimizers)} optimizers",
            "one DP optimizer accounts for every step; other optimizers' steps would go unaccounted",
            "return one optimizer over every trainable parameter",
        )


def _refuse_score_feedback(trainer: pl.Trainer) -> None:
    """The Lightning callbacks that feed a score computed without noise back into the run, refused for
    the reason :class:`veil.hf.DPTrainer` refuses its own
    (:func:`veil.pipeline.external.noiseless_score_refused`): the tuners ``LearningRateFinder`` and
    ``BatchSizeFinder`` (a learning rate or batch size chosen by noiseless trial steps on the training
    rows, which they read before any other callback's ``on_fit_start``), ``EarlyStopping`` (a stop
    chosen by the score) and ``ModelCheckpoint(monitor=...)`` (the weights kept chosen by it). A
    ``ReduceLROnPlateau`` scheduler (the learning rate set by the score) is refused at ``on_fit_start``,
    once the optimizers are configured."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    tuned = {LearningRateFinder: "learning rate", BatchSizeFinder: "batch size"}
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by its connector
    for callback in callbacks:
        for tuner, setting in tuned.items():
            if isinstance(callback, tuner):
                raise noiseless_score_refused(
                    "callbacks",
                    type(callback).__name__,
                    f"setting the {setting} (from noiseless trial steps on the training rows)",
                    f"drop {tuner.__name__} (Tuner.lr_find / scale_batch_size add it): select the "
                    f"{setting} among DP runs with veil tune",
                )
    for stopping in trainer.early_stopping_callbacks:
        raise noiseless_score_refused(
            "EarlyStopping",
            stopping.monitor,
            "stopping training",
            "drop EarlyStopping: the run stops at its planned steps (max_steps / max_epochs)",
        )
    for checkpoint in trainer.checkpoint_callbacks:
        monitor = getattr(checkpoint, "monitor", None)
        if monitor is not None:
            raise noiseless_score_refused(
                "ModelCheckpoint.monitor",
                monitor,
                "choosing which weights are kept",
                "drop monitor (ModelCheckpoint keeps the last weights), or select among runs with veil "
                "tune (a DP score)",
            )


def _bypass_gradient_averaging(trainer: pl.Trainer) -> None:
    """Under DDP: run the training step on the module inside Lightning's DDP wrapper, so DDP's
    averaging of unclipped gradients never runs (veil all-reduces the clipped sums instead)."""
    from torch.nn.parallel import DistributedDataParallel

    strategy: Any = trainer.strategy
    if isinstance(strategy.model, DistributedDataParallel):
        strategy.model = strategy.model.module
