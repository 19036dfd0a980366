"""``veil.hf.DPTrainer``: the Hugging Face Trainer path against a naive per-example loop, refusals,
ε in ``log_history``, the registry charge and the run folder's report.

Tiny randomly initialised BERT models with LoRA adapters, built from a config (no download).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from veil.errors import (  # noqa: E402
    BudgetExhaustedError,
    ConfigError,
    InvalidParameterError,
    UnreachableTargetError,
)
from veil.hf import DPTrainer, PrivacyArguments  # noqa: E402
from veil.optimizer import DPOptimizer  # noqa: E402
from veil.registry.charge import open_registry  # noqa: E402
from veil.registry.identity import dataset_identity  # noqa: E402

VOCAB, LENGTH = 30, 6


def _model(dtype: torch.dtype = torch.float32, full: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if full:  # every parameter trained, the position embeddings (looked up as [1, T]) included
        return transformers.BertForSequenceClassification(config).to(dtype)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    return peft.get_peft_model(transformers.BertForSequenceClassification(config), lora).to(dtype)


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        mask = torch.ones(LENGTH, dtype=torch.long)
        mask[LENGTH - 1 - i % 3 :] = 0 if i % 3 else 1  # some examples padded
        rows.append(
            {
                "input_ids": torch.randint(1, VOCAB, (LENGTH,), generator=g),
                "attention_mask": mask,
                "labels": torch.tensor(i % 2),
            }
        )
    return rows


def _args(tmp_path: Path, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "hf"),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 3,
        "max_steps": 3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
    }
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _privacy(**overrides: Any) -> PrivacyArguments:
    settings: dict[str, Any] = {
        "target_epsilon": 8.0,
        "target_delta": 1e-3,
        "per_sample_max_grad_norm": 0.05,
        "dataset_id": "toy-tweets",
    }
    settings.update(overrides)
    return PrivacyArguments(**settings)


def _example_gradient(
    model: torch.nn.Module, params: list[torch.nn.Parameter], batch: dict[str, torch.Tensor], i: int
) -> list[torch.Tensor]:
    """∇ of example i's own loss, the example alone through the model."""
    logits = model(
        input_ids=batch["input_ids"][i : i + 1], attention_mask=batch["attention_mask"][i : i + 1]
    ).logits
    loss = F.cross_entropy(logits, batch["labels"][i : i + 1], reduction="sum")
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.double() for g, p in zip(grads, params, strict=True)]


def _norm(grads: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g**2).sum() for g in grads)))


def _per_example_clipped_sum(
    model: torch.nn.Module, params: list[torch.nn.Parameter], batch: dict[str, torch.Tensor], clip: float
) -> list[torch.Tensor]:
    """Σ_i clip_C(∇ loss_i), one example at a time: the independent reference."""
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(batch["labels"].shape[0]):
        grads = _example_gradient(model, params, batch, i)
        factor = min(1.0, clip / (_norm(grads) + 1e-12))
        for t, g in zip(total, grads, strict=True):
            t.add_(g * factor)
    return total


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_trainer_path_clips_like_a_per_example_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: bool
) -> None:
    """Virtual batches (3 physical chunks of 2 per logical batch): the clipped sum the noise is added
    to equals the naive per-example loop over the logical batch, in float64. C is the median
    per-example norm, so some examples are clipped and some are not. The same run: ε in
    ``log_history`` at every logging step, the report written, the registry charged."""
    model = _model(torch.float64, full)
    reference = _model(torch.float64, full)  # same seed, same weights; lr = 0 keeps the trained one equal
    data = _data(12)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    everyone = {k: torch.stack([row[k] for row in data]) for k in data[0]}
    norms = [_norm(_example_gradient(reference, trainable, everyone, i)) for i in range(12)]
    clip = float(torch.tensor(norms).median())
    sums: list[list[torch.Tensor]] = []
    original = DPOptimizer._write_private_grads

    def recording(self: DPOptimizer) -> None:
        sums.append([s.detach().clone().double() for s in self.clipper.clipped_sum()])
        original(self)

    monkeypatch.setattr(DPOptimizer, "_write_private_grads", recording)
    trainer = DPTrainer(
        model=model,
        args=_args(tmp_path, learning_rate=0.0, weight_decay=0.0),
        train_dataset=data,
        privacy_args=_privacy(per_sample_max_grad_norm=clip),
    )
    batches: list[dict[str, torch.Tensor]] = []
    step = trainer.training_step

    def record_batch(model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        batches.append({k: v.clone() for k, v in inputs.items()})
        return step(model, inputs, num_items_in_batch)

    trainer.training_step = record_batch  # type: ignore[method-assign]
    trainer.train()
    assert len(sums) == len(batches) == 3
    assert trainer.privacy.engine is not None and trainer.privacy.engine.forward_probe == "passed"
    assert max(b["labels"].shape[0] for b in batches) > 2, "no logical batch spanned several chunks"
    named = dict(model.named_parameters())
    names = {id(p): n for n, p in named.items()}
    ref_params = dict(reference.named_parameters())
    clipper = trainer.dp_optimizer.clipper
    params = [ref_params[names[id(p)]] for p in clipper.parameters]
    for got, batch in zip(sums, batches, strict=True):
        want = _per_example_clipped_sum(reference, params, batch, clip)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)

    logged = [h for h in trainer.state.log_history if "non_private_loss" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    eps = [h["epsilon"] for h in logged]
    assert eps == sorted(eps) and 0 < eps[0] < eps[-1] <= 8.0
    assert eps[-1] > 0.95 * 8.0  # σ calibrated to the target over the 3 planned steps
    assert not any("loss" in h or "grad_norm" in h for h in trainer.state.log_history)
    report = json.loads((tmp_path / "hf" / "veil" / "report.json").read_text())
    assert report["steps"] == 3 and report["epsilon_spent"] == pytest.approx(eps[-1])
    assert report["batch_size"] == 6 and report["sampling_rate"] == pytest.approx(6 / 12)
    assert (tmp_path / "hf" / "veil" / "report.html").is_file()
    registry = open_registry()
    try:
        status = registry.status(dataset_identity(dataset_id="toy-tweets"), per_run=True)
    finally:
        registry.close()
    assert [r.job for r in status.runs] == ["hf-trainer"]
    assert status.runs[0].charged and len(status.runs[0].events) >= 1
    assert status.spent_epsilon == pytest.approx(eps[-1], rel=1e-3)


def test_refusals_before_training(tmp_path: Path) -> None:
    data = _data(20)
    with pytest.raises(ConfigError, match="group_by_length"):
        DPTrainer(
            model=_model(),
            args=_args(tmp_path, train_sampling_strategy="group_by_length"),
            train_dataset=data,
            privacy_args=_privacy(),
        )

    with pytest.raises(ConfigError, match="load_best_model_at_end"):
        DPTrainer(
            model=_model(),
            args=_args(tmp_path, load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"),
            train_dataset=data,
            eval_dataset=data,
            privacy_args=_privacy(),
        )

    with pytest.raises(ConfigError, match="torch_compile"):
        DPTrainer(
            model=_model(),
            args=_args(tmp_path, torch_compile=True),
            train_dataset=data,
            privacy_args=_privacy(),
        )

    class MixingTrainer(DPTrainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
            return model(**inputs).loss

    with pytest.raises(ConfigError, match="compute_loss"):
        MixingTrainer(model=_model(), args=_args(tmp_path), train_dataset=data, privacy_args=_privacy())
    with pytest.raises(ConfigError, match="compute_loss"):
        DPTrainer(
            model=_model(),
            args=_args(tmp_path),
            train_dataset=data,
            privacy_args=_privacy(),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss,
        )
    with pytest.raises(InvalidParameterError, match="dataset_id"):
        _privacy(dataset_id=None)
    with pytest.raises(ConfigError, match="privacy_args"):
        DPTrainer(model=_model(), args=_args(tmp_path), train_dataset=data)
    trainer = DPTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=50),
        train_dataset=data,
        privacy_args=_privacy(noise_multiplier=0.3, target_epsilon=1.0),
    )
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint.*restart veil's accountant"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-1"))
    with pytest.raises(UnreachableTargetError, match="noise_multiplier"):
        trainer.train()
    registry = open_registry()
    try:
        assert not registry.status(dataset_identity(dataset_id="toy-tweets")).runs  # nothing charged
    finally:
        registry.close()
    assert not (tmp_path / "hf" / "veil").exists()


def test_empty_poisson_batch_is_a_noise_only_step_and_no_step_past_the_plan(tmp_path: Path) -> None:
    """An empty logical batch never reaches the model (HF models refuse 0 rows) but is still a step:
    noise only, accounted. A step beyond the planned count is refused before it is taken."""
    trainer = DPTrainer(
        model=_model(), args=_args(tmp_path, max_steps=1), train_dataset=_data(20), privacy_args=_privacy()
    )
    trainer.get_train_dataloader()
    empty = {
        "input_ids": torch.zeros(0, LENGTH, dtype=torch.long),
        "attention_mask": torch.zeros(0, LENGTH, dtype=torch.long),
        "labels": torch.zeros(0, dtype=torch.long),
    }
    before = [p.detach().clone() for p in trainer.dp_optimizer.clipper.parameters]
    assert trainer._dp_loader is not None
    trainer._dp_loader.signal.hand_out(first=True, last=True)  # as the private loader yields it
    assert float(trainer.training_step(trainer.model, dict(empty))) == 0.0
    trainer.optimizer.step()
    assert trainer.privacy.steps == 1
    after = trainer.dp_optimizer.clipper.parameters
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the noise
    with pytest.raises(BudgetExhaustedError, match="steps"):
        trainer.training_step(trainer.model, dict(empty))
    report = trainer.privacy.finish(framework="test")
    assert report is not None and report["steps"] == 1


def test_forward_mixing_probe_takes_keyword_batches() -> None:
    """The engine's forward-mixing probe runs on Hugging Face batches (dicts, passed as keywords):
    BERT passes; a forward that subtracts the batch mean is refused before training."""
    from torch.utils.data import DataLoader

    from veil.mixing_probe import probe_forward

    collate = transformers.default_data_collator
    loader = DataLoader(_data(8), batch_size=4, collate_fn=collate)
    assert probe_forward(_model(), loader) == "passed"

    class Mixing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 4)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Any = None) -> Any:
            h = self.embed(input_ids).mean(1)
            return {"logits": h - h.mean(0)}

    problem = probe_forward(Mixing(), loader)
    assert not isinstance(problem, str) and "mixes examples" in str(problem)


def test_evaluation_metrics_are_logged_as_non_private(tmp_path: Path) -> None:
    """An evaluation score is computed without noise: it reaches the log (and any report_to) only under
    a non_private_ name."""
    trainer = DPTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_data(20), privacy_args=_privacy()
    )
    trainer.log({"eval_loss": 0.7, "eval_accuracy": 0.5, "loss": 1.0})
    last = trainer.state.log_history[-1]
    assert last["non_private_eval_loss"] == 0.7 and last["non_private_eval_accuracy"] == 0.5
    assert last["non_private_loss"] == 1.0
    assert not any(k.startswith("eval_") or k == "loss" for k in last)


class _QuietPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """A subclass: refused as its parent is."""


def _plateau(trainer_args: Any) -> dict[str, Any]:
    """A ReduceLROnPlateau (subclass) passed as the Trainer's scheduler (``optimizers=``), not by name."""
    model = _model()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return {"model": model, "optimizers": (optimizer, _QuietPlateau(optimizer))}


_EVAL = {"eval_strategy": "steps", "eval_steps": 1}


def _nothing_charged_or_written(tmp_path: Path) -> None:
    """No run in the registry for the toy dataset, no run folder."""
    registry = open_registry()
    try:
        assert not registry.status(dataset_identity(dataset_id="toy-tweets")).runs
    finally:
        registry.close()
    assert not (tmp_path / "hf" / "veil").exists()


@pytest.mark.parametrize(
    ("args", "extra", "match"),
    [
        ({"lr_scheduler_type": "reduce_lr_on_plateau", **_EVAL}, None, "lr_scheduler_type"),
        ({"lr_scheduler_type": "greedy", **_EVAL}, None, "lr_scheduler_type"),
        (_EVAL, _plateau, "_QuietPlateau"),
        ({"save_strategy": "best", "metric_for_best_model": "loss", **_EVAL}, None, "save_strategy"),
        (
            {"metric_for_best_model": "loss", **_EVAL},
            lambda a: {"callbacks": [transformers.EarlyStoppingCallback(early_stopping_patience=1)]},
            "EarlyStoppingCallback",
        ),
        ({"metric_for_best_model": "loss", **_EVAL}, None, "metric_for_best_model"),
        ({"include_num_input_tokens_seen": True}, None, "include_num_input_tokens_seen"),
        ({"include_num_input_tokens_seen": "non_padding"}, None, "include_num_input_tokens_seen"),
        ({"auto_find_batch_size": True}, None, "auto_find_batch_size"),
        ({"neftune_noise_alpha": 5.0}, None, "neftune_noise_alpha"),
    ],
    ids=[
        "plateau",
        "greedy",
        "plateau-instance",
        "save-best",
        "early-stopping",
        "metric-for-best",
        "tokens-seen",
        "tokens-seen-non-padding",
        "auto-batch",
        "neftune",
    ],
)
def test_refuses_a_data_dependent_switch_before_reading(
    tmp_path: Path, args: dict[str, Any], extra: Any, match: str
) -> None:
    """A switch whose effect or log depends on the data without noise — an evaluation score steering
    the learning rate, the checkpoints kept or the stop; a count of the batches' tokens; a batch size
    retried after running out of memory — is refused when the DPTrainer is built: nothing read, nothing
    charged, no run folder."""
    trainer_args = _args(tmp_path, **args)
    kwargs: dict[str, Any] = {"model": _model()}
    if extra is not None:
        kwargs.update(extra(trainer_args))
    with pytest.raises(ConfigError, match=match):
        DPTrainer(
            args=trainer_args,
            train_dataset=_data(20),
            eval_dataset=_data(4),
            privacy_args=_privacy(),
            **kwargs,
        )
    _nothing_charged_or_written(tmp_path)


def test_logs_and_checkpoints_carry_no_unlabelled_count_of_the_data(tmp_path: Path) -> None:
    """Every key in ``log_history`` is public by construction (the step, epoch, learning rate, ε, and
    ``total_flos``, which is 0) or labelled ``non_private_``; a checkpoint's ``trainer_state.json``
    holds ``total_flos`` 0 (the Trainer's count is 6 × parameters × the padded tokens of each
    Poisson batch, a function of the texts' lengths) and no random generators' state (their draws
    count dropout's elements)."""
    trainer = DPTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=_data(20),
        privacy_args=_privacy(),
    )
    trainer.train()
    public = {"step", "epoch", "learning_rate", "epsilon", "total_flos"}
    for entry in trainer.state.log_history:
        assert all(k in public or k.startswith("non_private_") for k in entry), entry
    assert [h["total_flos"] for h in trainer.state.log_history if "total_flos" in h] == [0]
    checkpoint = tmp_path / "hf" / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["total_flos"] == 0 and state["num_input_tokens_seen"] == 0
    assert state["best_metric"] is None
    assert not list(checkpoint.glob("rng_state*"))
    assert (tmp_path / "hf" / "veil" / "report.json").is_file()


def test_what_train_evaluate_and_predict_return_and_save_metrics_writes_is_labelled(
    tmp_path: Path,
) -> None:
    """HF's example-script idiom (``m = trainer.train().metrics; m["train_samples"] = ...;
    trainer.log_metrics("train", m); trainer.save_metrics("train", m)``, the same for ``evaluate()``
    and ``predict()``) prints and writes beside the model only public keys (the step, epoch, learning
    rate, ε, ``total_flos``) or ``non_private_`` ones: the training loss, computed without noise, is
    not returned under its own name (``TrainOutput.training_loss`` is NaN) (revF F4)."""
    public = {"epoch", "learning_rate", "epsilon", "total_flos"}

    def labelled(metrics: dict[str, Any]) -> bool:
        return all(k in public or k.startswith("non_private_") for k in metrics)

    trainer = DPTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=2),
        train_dataset=_data(20),
        eval_dataset=_data(4),
        privacy_args=_privacy(),
    )
    result = trainer.train()
    assert result.global_step == 2 and result.training_loss != result.training_loss  # NaN
    assert labelled(result.metrics) and "non_private_train_loss" in result.metrics, result.metrics
    assert result.metrics["epsilon"] == pytest.approx(trainer.report["epsilon_spent"])  # type: ignore[index]
    evaluated = trainer.evaluate()
    assert labelled(evaluated) and "non_private_eval_loss" in evaluated, evaluated
    predicted = trainer.predict(_data(4)).metrics
    assert predicted is not None and labelled(predicted) and "non_private_test_loss" in predicted
    for split, metrics in (("train", result.metrics), ("eval", evaluated), ("test", predicted)):
        metrics = {**metrics, f"{split}_samples": 20}  # the scripts add the dataset's size
        trainer.log_metrics(split, metrics)
        trainer.save_metrics(split, metrics)
    for name in ("train_results.json", "eval_results.json", "test_results.json", "all_results.json"):
        saved = json.loads((tmp_path / "hf" / name).read_text())
        assert saved and labelled(saved), (name, saved)
    assert json.loads((tmp_path / "hf" / "all_results.json").read_text())["non_private_train_samples"] == 20


@pytest.mark.parametrize("late", ["early stopping callback", "best model at the end"])
def test_a_switch_set_after_construction_is_refused_before_reading(tmp_path: Path, late: str) -> None:
    """``train()`` checks again what ``__init__`` refused: a callback added or an argument changed on
    the built trainer cannot let a noiseless score choose the stop or the released weights (revB)."""
    from transformers import EarlyStoppingCallback

    trainer = DPTrainer(
        model=_model(),
        args=_args(
            tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1
        ),
        train_dataset=_data(20),
        eval_dataset=_data(4),
        privacy_args=_privacy(),
    )
    if late == "early stopping callback":
        trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=1))
    else:
        trainer.args.metric_for_best_model = "eval_loss"
        trainer.args.load_best_model_at_end = True
    with pytest.raises(ConfigError):
        trainer.train()
    registry = open_registry()
    try:
        assert not registry.status(dataset_identity(dataset_id="toy-tweets")).runs
    finally:
        registry.close()
    assert trainer.state.global_step == 0


class _StopOnEvalLoss(transformers.TrainerCallback):
    """A user's own early stop on the evaluation loss (computed without noise): no library switch."""

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        if metrics:  # any score at all: the stop follows the first evaluation
            control.should_training_stop = True


def test_a_users_own_early_stop_is_not_release_ready_and_keeps_the_plan_charged(tmp_path: Path) -> None:
    """revC: a home-made callback stopping on ``eval_loss`` picked the released weights of a
    release-ready run. The library cannot read arbitrary code, so a run that ends before its planned
    steps fails ``planned_steps_taken`` (not release-ready) and the registry keeps the whole plan: its
    record does not depend on when the loop stopped. The complete run beside it stays release-ready."""
    reports = {}
    for name, callbacks in (("stopped", [_StopOnEvalLoss()]), ("complete", [])):
        trainer = DPTrainer(
            model=_model(),
            args=_args(tmp_path / name, max_steps=4, eval_strategy="steps", eval_steps=1),
            train_dataset=_data(20),
            eval_dataset=_data(4),
            callbacks=callbacks,
            privacy_args=_privacy(dataset_id=f"toy-{name}"),
        )
        trainer.train()
        assert trainer.report is not None
        reports[name] = trainer.report
    stopped, complete = reports["stopped"], reports["complete"]
    assert stopped["steps"] == 1 and complete["steps"] == 4
    taken = {r: next(c for c in reports[r]["checks"] if c["name"] == "planned_steps_taken") for r in reports}
    assert not taken["stopped"]["passed"] and not stopped["release_ready"]
    assert taken["complete"]["passed"] and complete["release_ready"]
    registry = open_registry()
    try:
        spent = {
            r: registry.status(dataset_identity(dataset_id=f"toy-{r}"), per_run=True).spent_epsilon
            for r in reports
        }
    finally:
        registry.close()
    # The plan (4 steps) is charged for both; the stopped run's own ε is one step's.
    assert spent["stopped"] == pytest.approx(spent["complete"], rel=1e-6)
    assert stopped["epsilon_spent"] < complete["epsilon_spent"]


def test_refuses_hyperparameter_search(tmp_path: Path) -> None:
    """HF's ``hyperparameter_search`` picks among runs by a noiseless evaluation score: refused when
    called, before a run starts (nothing charged, no run folder)."""
    trainer = DPTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_data(20), privacy_args=_privacy()
    )
    with pytest.raises(ConfigError, match="hyperparameter_search"):
        trainer.hyperparameter_search(n_trials=2)
    _nothing_charged_or_written(tmp_path)
