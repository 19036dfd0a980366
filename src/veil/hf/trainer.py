"""``DPTrainer``: the Hugging Face ``Trainer`` with veil's DP-SGD (the optional extra ``veil[hf]``).

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                        privacy_args=PrivacyArguments(target_epsilon=3, target_delta=1e-5,
                                                      per_sample_max_grad_norm=1.0, dataset_id="tweets"))
    trainer.train()          # ε in trainer.state.log_history, report in the run folder

The same constructor as ``transformers.Trainer`` plus ``privacy_args``. A thin adapter over
:mod:`veil.pipeline.external` (the one pipeline for loops veil does not own): the Trainer's own loop,
optimizer, scheduler, callbacks, logging and evaluation run unchanged, while

* the train loader is the engine's Poisson sampler over the train set, one **logical** batch of
  expected size ``per_device_train_batch_size × gradient_accumulation_steps`` per optimizer step;
* gradient accumulation becomes virtual batches: each logical batch is cut into physical chunks of
  ``per_device_train_batch_size`` whose clipped per-example gradients are summed before the one noise
  draw of the step (the Trainer itself runs with one batch per step);
* the loss is each example's cross-entropy summed over the batch (a fixed-coefficient sum of
  per-example terms, so per-sample clipping is exact), for sequence- and token-classification heads;
* σ is calibrated to (ε, δ) over the Trainer's planned steps, the dataset's registry budget is
  charged before training and settled with the steps taken, ε is logged every logging step
  (``epsilon`` in ``log_history``, and so in every ``report_to`` integration: MLflow, TensorBoard,
  ...), and ``report.json``/``report.html`` are written at the end;
* the Trainer's global gradient clipping (``max_grad_norm``) is off: veil clips per example.

Guarantee: that of :mod:`veil.pipeline.external` (add/remove-one on the train set's examples).
Only what depends on the public settings and the step is logged under its own name (``learning_rate``,
``epoch``, ``epsilon``, ``total_flos``); everything else is not private and is logged as
``non_private_*`` (the training loss, mean per example, as ``non_private_loss``; the evaluation metrics
as ``non_private_eval_*``; the timings). The same rule labels what ``train()``, ``evaluate()`` and
``predict()`` return and what ``log_metrics``/``save_metrics`` print and write (``train_results.json``,
``all_results.json``), so HF's example-script idiom releases nothing unlabelled: ``train()`` returns a
``TrainOutput`` whose ``training_loss`` is NaN (the loss, computed without noise, is
``metrics["non_private_train_loss"]``) and whose metrics carry ``epsilon``. ``total_flos`` is 0 and
checkpoints hold no random generators' state: both would count the padded tokens of the Poisson batches.
Refused before any row is read, each with one line (:mod:`veil.errors`): ``group_by_length`` or
any non-random train sampling; a ``compute_loss`` override or ``compute_loss_func`` (a loss veil
cannot check may mix examples); an evaluation score computed without noise steering the run
(``load_best_model_at_end``, ``save_strategy="best"``, ``EarlyStoppingCallback``, a plateau or
greedy learning-rate schedule, ``metric_for_best_model``); ``include_num_input_tokens_seen`` (a count
of the batches' tokens); ``auto_find_batch_size``; several processes or GPUs (DDP, DeepSpeed, FSDP,
DataParallel: use :mod:`veil.lightning` or ``veil train --nproc-per-node``); ``torch_compile``;
resuming from a checkpoint (the accountant would restart); a dataset without length; a model head
veil has no per-example loss for. A callback of the user's own may still stop the loop on any score:
a run that ends before its planned steps is reported not release-ready and keeps its whole plan
charged (:meth:`veil.pipeline.external.ExternalRun.finish`).
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from veil.errors import ConfigError
from veil.pipeline.external import (
    ExternalRun,
    PrivacyTarget,
    noiseless_score_refused,
    planned_steps,
    resume_refused,
)
from veil.text.batch_lookups import batch_of, expand_shared_lookups
from veil.text.load import require_transformers

if TYPE_CHECKING:
    from veil.optimizer import DPOptimizer
    from veil.sampling import PrivateDataLoader

require_transformers()  # the extra's one-line error, before the import below fails
from transformers import Trainer  # noqa: E402
from transformers.trainer_utils import PredictionOutput, TrainOutput  # noqa: E402

__all__ = ["DPTrainer", "PrivacyArguments"]

_HEADS = ("ForSequenceClassification", "ForTokenClassification")
# What the Trainer logs that depends on the public settings and the step alone; anything else is
# relabelled non_private_* (see DPTrainer.log).
_PUBLIC_LOGS = frozenset({"learning_rate", "epoch", "total_flos", "epsilon"})
# Schedulers that step on an evaluation score (transformers' SchedulerType values).
_SCORE_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")


@dataclass(frozen=True)
class PrivacyArguments:
    """The privacy settings of a :class:`DPTrainer` (checked when built).

    ``target_epsilon``/``target_delta``: the (ε, δ) the whole run may spend; ``per_sample_max_grad_norm``:
    the clip norm C of each example's gradient; ``noise_multiplier``: σ, or None to calibrate it to the
    target over the Trainer's planned steps; ``dataset_id``: the name of the train set's budget in the
    registry (required); ``out``: the run folder for the report (default ``<output_dir>/veil``).
    """

    target_epsilon: float
    target_delta: float
    per_sample_max_grad_norm: float
    noise_multiplier: float | None = None
    dataset_id: str | None = None
    accountant: Literal["pld", "rdp"] = "pld"
    out: str | None = None

    def __post_init__(self) -> None:
        self.target()  # every check, now

    def target(self) -> PrivacyTarget:
        return PrivacyTarget(
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            max_grad_norm=self.per_sample_max_grad_norm,
            noise_multiplier=self.noise_multiplier,
            dataset_id=self.dataset_id,
            accountant=self.accountant,
        )


class DPTrainer(Trainer):
    """``transformers.Trainer`` + DP-SGD (see the module doc); ``privacy_args`` is required."""

    def __init__(self, *args: Any, privacy_args: PrivacyArguments | None = None, **kwargs: Any) -> None:
        if not isinstance(privacy_args, PrivacyArguments):
            raise ConfigError(
                "privacy_args",
                type(privacy_args).__name__,
                "a DPTrainer needs its privacy settings",
                "pass privacy_args=veil.hf.PrivacyArguments(target_epsilon=..., target_delta=..., "
                "per_sample_max_grad_norm=..., dataset_id=...)",
            )
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        self.privacy_args = privacy_args
        # The Trainer sees one logical batch per step; veil cuts it into physical chunks itself.
        given: Any = self.args
        self.physical_batch_size = int(given.per_device_train_batch_size)
        self.logical_batch_size = self.physical_batch_size * int(given.gradient_accumulation_steps)
        args_copy = copy.copy(given)
        args_copy.gradient_accumulation_steps = 1
        args_copy.max_grad_norm = 0.0  # no global clipping of the (already private) gradient
        self.args = args_copy
        out = privacy_args.out or str(Path(given.output_dir or ".") / "veil")
        self.privacy = ExternalRun(privacy_args.target(), job="hf-trainer", out=out)
        self.report: dict[str, Any] | None = None
        self._dp_loader: PrivateDataLoader | None = None

    # -- the private loader and optimizer, built when the Trainer asks for its train loader ----------
    def get_train_dataloader(self) -> DataLoader:
        if self._dp_loader is not None:
            raise ConfigError(
                "train",
                "called twice",
                "one DPTrainer accounts for one run; a second train() would start a new accountant",
                "build a new DPTrainer for another run (its spend is charged to the same dataset)",
            )
        dataset = self.train_dataset
        if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError(
                "train_dataset",
                type(dataset).__name__,
                "Poisson sampling needs random access to a dataset of known size",
                "pass a map-style dataset (with __len__ and __getitem__)",
            )
        collator = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        n = len(dataset)
        _, steps = planned_steps(
            n, self.logical_batch_size, float(self.args.num_train_epochs), int(self.args.max_steps)
        )
        self.privacy.begin(n, self.logical_batch_size, steps)
        try:
            plain_optimizer = self.create_optimizer()
            assert self.model is not None
            plain = DataLoader(
                dataset,
                batch_size=self.logical_batch_size,
                collate_fn=collator,
                num_workers=self.args.dataloader_num_workers,
                pin_memory=self.args.dataloader_pin_memory,
            )
            expand_shared_lookups(self.model)  # BERT's [1, T] position ids: one row per example
            _, optimizer, loader = self.privacy.make_private(
                self.model, plain_optimizer, plain, loss_reduction="sum"
            )
        except BaseException:
            self.privacy.finish(framework="Hugging Face Trainer")
            raise
        self.optimizer = optimizer
        self._dp_loader = loader
        return loader

    @property
    def dp_optimizer(self) -> DPOptimizer:
        """The engine's optimizer (the Trainer's ``optimizer`` may be Accelerate's wrapper of it)."""
        assert self.privacy.engine is not None and self.privacy.engine._optimizer is not None
        return self.privacy.engine._optimizer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # Again here, before a row is read: a switch set or a callback added after construction
        # (``trainer.args.load_best_model_at_end = True``, ``add_callback(EarlyStoppingCallback())``)
        # would otherwise let a noiseless score steer the run (revB).
        _refuse_unsupported(self)
        if kwargs.get("resume_from_checkpoint") or (args and args[0]):
            raise resume_refused(
                "resume_from_checkpoint",
                kwargs.get("resume_from_checkpoint", args[0] if args else None),
                "train in one run (or use veil train, whose --resume continues the ledger)",
            )
        try:
            output = super().train(*args, **kwargs)
        finally:
            losses = [h["non_private_loss"] for h in self.state.log_history if "non_private_loss" in h]
            self.report = self.privacy.finish(
                framework="Hugging Face Trainer",
                non_private={"train_loss_last_logged": losses[-1] if losses else None},
            )
        # HF returns the training loss (mean over the run, computed without noise) under its own name,
        # and every example script prints and saves what it returns (log_metrics / save_metrics): NaN
        # in its place, the value in the metrics as non_private_train_loss (revF F4).
        return TrainOutput(output.global_step, math.nan, self._released(output.metrics))

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: it picks among runs by an evaluation score computed without noise, a selection
        on the private data that no run's ε covers."""
        raise noiseless_score_refused(
            "hyperparameter_search",
            "called",
            "choosing the run's hyperparameters",
            "select among DP runs with veil tune, whose score is released with noise and charged",
        )

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The Trainer's evaluation, its metrics returned as :meth:`log` releases them
        (``non_private_eval_*``, and ``epsilon`` once training began)."""
        return self._released(super().evaluate(*args, **kwargs))

    def predict(self, *args: Any, **kwargs: Any) -> PredictionOutput:
        """The Trainer's prediction, its metrics returned as :meth:`log` releases them
        (``non_private_test_*``). The predictions themselves are returned as they are: the model's outputs
        on data the caller passed, for the caller."""
        output = super().predict(*args, **kwargs)
        metrics = None if output.metrics is None else self._released(output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, metrics)

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """HF's printout of ``metrics``, each key labelled by the rule of :meth:`log` (a metric the
        caller added, such as ``train_samples``, included)."""
        super().log_metrics(split, _public_or_labelled(metrics))

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """HF's ``{split}_results.json``/``all_results.json``, each key labelled by the rule of
        :meth:`log`: nothing computed from the data reaches the output folder under its own name."""
        super().save_metrics(split, _public_or_labelled(metrics), combined)

    def _released(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` labelled (:func:`_public_or_labelled`) with ``epsilon``, ε spent so far, once the
        engine is built: what :meth:`log` logs and what ``train``/``evaluate``/``predict`` return."""
        released = _public_or_labelled(metrics)
        if self.privacy.engine is not None:
            released["epsilon"] = self.privacy.record_epsilon()
        return released

    # -- one logical batch: physical chunks, one noisy step -----------------------------------------
    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward/backward each physical chunk of the logical batch, accumulating clipped per-example
        gradients; the Trainer's ``optimizer.step()`` that follows adds the noise once (to a zero sum
        for an empty batch, which is still a step: Poisson sampling yields empty batches)."""
        assert self._dp_loader is not None
        self.privacy.check_step_fits()
        total = torch.zeros((), device=self.args.device)
        if _rows(inputs) == 0:  # an empty Poisson batch: no forward (HF models refuse 0 rows); noise only
            return total
        chunks = _split(inputs, self.physical_batch_size)
        signal = self._dp_loader.signal
        for i, chunk in enumerate(chunks):
            if i > 0:  # the previous chunk's clipped gradients are summed; no update yet
                signal.last_chunk = False
                self.dp_optimizer.step()
                # The next chunk of the same logical batch (the loader handed out the whole batch
                # as one): each step() takes a chunk of its own (veil.optimizer).
                signal.hand_out(first=False, last=i == len(chunks) - 1)
            loss = super().training_step(model, chunk, None)
            total = total + loss.to(total.device)
        return total / max(1, _rows(inputs))  # the mean per example, for the (non-private) log

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """Cross-entropy of each example (with ``label_smoothing_factor``), **summed** in training
        (ignored labels, -100, count 0); the mean in evaluation."""
        features = dict(inputs)
        labels = features.pop("labels")
        tokens = features.get("input_ids", features.get("inputs_embeds"))
        with (
            batch_of(*tokens.shape[:2])
            if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2
            else nullcontext()
        ):
            outputs = model(**features)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        reduction = "sum" if model.training else "mean"
        loss = F.cross_entropy(  # label smoothing is per example too: each term stays its own
            logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
            labels.reshape(-1).long(),
            ignore_index=-100,
            reduction=reduction,
            label_smoothing=float(self.args.label_smoothing_factor or 0.0),
        )
        return (loss, outputs) if return_outputs else loss

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0: the Trainer's count (6 × parameters × the padded tokens of each batch) is a function of the
        private texts' lengths, and it reaches ``total_flos`` in the log, every checkpoint's
        ``trainer_state.json`` and every ``report_to`` integration. No public count replaces it: under
        dynamic padding the only public length is the tokenizer's maximum, which misstates the work."""
        return 0

    def _save_rng_state(self, output_dir: str) -> None:
        """Nothing: the random generators' states after training depend on the draws dropout made, whose
        number grows with the elements of each padded batch (a function of the private texts' lengths,
        like the flops), and they are needed only to resume, which DPTrainer refuses."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``epsilon``; keep what is a function of the public settings and the step alone
        (``learning_rate``, ``epoch``, ``total_flos`` which is 0); drop the pre-noise ``grad_norm``;
        relabel everything else as ``non_private_*``: the training loss, every evaluation metric, the
        timings and memory figures (functions of the batches' padded sizes) and whatever a callback
        adds. Private by construction: a key veil does not know is never logged under its own name."""
        super().log(self._released(logs), start_time)


def _public_or_labelled(metrics: dict[str, float]) -> dict[str, float]:
    """A copy of ``metrics`` in which only what depends on the public settings and the step alone
    (``_PUBLIC_LOGS``) keeps its name; the pre-noise ``grad_norm`` is dropped; every other key,
    computed from the data without noise or unknown to veil, is renamed ``non_private_<key>`` (a key
    labelled already is kept). The one rule for everything DPTrainer logs, returns, prints or saves."""
    labelled = dict(metrics)
    labelled.pop("grad_norm", None)  # the gradient before noise: not private, and not the update
    for key in [k for k in labelled if k not in _PUBLIC_LOGS and not k.startswith("non_private_")]:
        labelled[f"non_private_{key}"] = labelled.pop(key)
    return labelled


def _split(inputs: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """The logical batch's tensors cut along dimension 0 into chunks of ``size`` (at least one)."""
    n = _rows(inputs)
    if n <= size:
        return [inputs]
    return [
        {k: v[i : i + size] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        for i in range(0, n, size)
    ]


def _rows(inputs: dict[str, Any]) -> int:
    return next((int(v.shape[0]) for v in inputs.values() if isinstance(v, torch.Tensor)), 0)


def _refuse_unsupported(trainer: Any) -> None:
    """Everything that breaks the guarantee, refused before a row is read."""
    args = trainer.args
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) or strategy != "random":
        raise ConfigError(
            "train_sampling_strategy",
            "group_by_length" if getattr(args, "group_by_length", False) else strategy,
            "batches chosen by length (or in any order but Poisson sampling) make who is in a batch depend "
            "on the other examples, which DP-SGD's accounting does not cover",
            "drop group_by_length: DPTrainer samples every batch by Poisson sampling",
        )
    if type(trainer).compute_loss is not DPTrainer.compute_loss or trainer.compute_loss_func is not None:
        raise ConfigError(
            "compute_loss",
            "overridden",
            "per-sample clipping is exact only for a loss that is a fixed sum of per-example terms; a "
            "custom loss may mix examples (a batch mean over tokens, in-batch negatives, ...)",
            "use DPTrainer's loss (each example's cross-entropy), or train with veil.PrivacyEngine",
        )
    _refuse_score_feedback(trainer)
    if getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False):
        raise ConfigError(
            "include_num_input_tokens_seen",
            args.include_num_input_tokens_seen,
            "the count of tokens in the Poisson-sampled batches is a function of the private texts' "
            "lengths, logged without noise (num_input_tokens_seen, tokens per second, trainer_state.json)",
            "drop include_num_input_tokens_seen",
        )
    if getattr(args, "auto_find_batch_size", False):
        raise ConfigError(
            "auto_find_batch_size",
            True,
            "a retry with a smaller batch after running out of memory changes the sampling rate mid-run "
            "and depends on the private batches' padded sizes",
            "drop auto_find_batch_size and set per_device_train_batch_size (the physical batch) to fit",
        )
    if getattr(args, "neftune_noise_alpha", None):
        raise ConfigError(
            "neftune_noise_alpha",
            args.neftune_noise_alpha,
            "NEFTune scales its embedding noise by the padded length of the whole batch, so one text's "
            "length changes the other examples' gradients: per-sample clipping no longer bounds one "
            "example's influence",
            "drop neftune_noise_alpha (DP-SGD's own noise is what protects the data)",
        )
    if getattr(args, "torch_compile", False):
        raise ConfigError(
            "torch_compile",
            True,
            "veil's per-sample clipping hooks observe each layer's inputs and output gradients, which a "
            "compiled graph does not expose layer by layer",
            "drop torch_compile",
        )
    if args.world_size > 1 or args.n_gpu > 1:
        raise ConfigError(
            "world_size",
            max(args.world_size, args.n_gpu),
            "DPTrainer runs in one process on one device; several would each add their own noise and "
            "sample apart (or, with DataParallel, clip on replicas veil does not see)",
            "run one process, or use veil.lightning.DifferentialPrivacy or veil train --nproc-per-node",
        )
    head = _head_name(trainer.model)
    if not head.endswith(_HEADS):
        raise ConfigError(
            "model",
            head,
            "DPTrainer's per-example loss is the cross-entropy of a classification head",
            "use an AutoModelForSequenceClassification or ...ForTokenClassification model",
        )


def _refuse_score_feedback(trainer: Any) -> None:
    """Every Trainer switch that feeds an evaluation score (computed without noise) back into the run,
    refused before a row is read: choosing the released weights, keeping the best checkpoint, stopping
    early, a learning rate set by the score, and ``metric_for_best_model`` itself (whose only uses are
    these, and whose best value would be written unlabelled into ``trainer_state.json``)."""
    args = trainer.args
    keep_last = "keep the last model (the default), or select among runs with veil tune (a DP score)"
    if getattr(args, "load_best_model_at_end", False):
        raise noiseless_score_refused(
            "load_best_model_at_end", True, "choosing the released weights", keep_last
        )
    from transformers import optimization

    scheduler = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    stepped_by_score = (torch.optim.lr_scheduler.ReduceLROnPlateau, *_greedy(optimization))
    given = trainer.lr_scheduler  # one passed in optimizers=(optimizer, scheduler)
    if scheduler in _SCORE_SCHEDULERS or isinstance(given, stepped_by_score):
        raise noiseless_score_refused(
            "lr_scheduler_type",
            type(given).__name__ if isinstance(given, stepped_by_score) else scheduler,
            "setting the learning rate",
            "use a schedule fixed in advance (linear, cosine, constant, ...)",
        )
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
        raise noiseless_score_refused(
            "save_strategy", "best", "choosing which checkpoints are kept", 'save by "steps" or "epoch"'
        )
    from transformers import EarlyStoppingCallback

    if any(isinstance(c, EarlyStoppingCallback) for c in trainer.callback_handler.callbacks):
        raise noiseless_score_refused(
            "callbacks",
            "EarlyStoppingCallback",
            "stopping training",
            "drop EarlyStoppingCallback: the run stops at its planned steps (max_steps / num_train_epochs)",
        )
    if getattr(args, "metric_for_best_model", None) is not None:
        raise noiseless_score_refused(
            "metric_for_best_model",
            args.metric_for_best_model,
            "tracking the best checkpoint (best_metric, written unlabelled into trainer_state.json)",
            "drop metric_for_best_model",
        )


def _greedy(optimization: Any) -> tuple[type, ...]:
    """transformers' GreedyLR (stepped by an evaluation score), where this version has it."""
    greedy = getattr(optimization, "GreedyLR", None)
    return (greedy,) if isinstance(greedy, type) else ()


def _head_name(model: Any) -> str:
    """The transformers class under any peft wrapper."""
    base = model
    for attr in ("base_model", "model"):
        inner = getattr(base, attr, None)
        if isinstance(inner, torch.nn.Module) and type(base).__name__.startswith("Peft"):
            base = inner
    while type(base).__name__ == "LoraModel":
        base = base.model
    return type(base).__name__
