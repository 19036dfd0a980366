"""Data preparation shared by every job: load, check, presets, preprocessing plan and its release.

Everything here is checked before a job writes anything: δ against 1/N, the batch size against N,
the preprocessing plan (a DP release is only *planned* here; :func:`release_preprocessing` runs it,
after the job charged its event).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from veil.config import TrainConfig
from veil.errors import ConfigError, InvalidParameterError, SamplingError
from veil.pipeline.randomness import private_source
from veil.pipeline.seeds import Purpose
from veil.presets import apply_presets, preset_for, preset_of, whitening_for

if TYPE_CHECKING:
    from veil.accounting.events import PrivacyEvent
    from veil.data import Dataset
    from veil.data.preprocess import PreprocessingPlan
    from veil.data.whitening import WhiteningPlan

__all__ = [
    "Prepared",
    "UsesPrepared",
    "check_declarations",
    "check_delta",
    "delta_note",
    "load_data",
    "prepare",
    "refuse_whitening_over_target",
    "release_preprocessing",
    "whitening_plan",
]


@dataclass
class Prepared:
    """A job's checked inputs: the resolved config (presets applied), the data, the preprocessing
    plan (whose DP statistic, if any, is not released yet) and the preset's DP whitening of a fixed
    front's rows (:mod:`veil.data.whitening`; None for every other preset or job)."""

    cfg: TrainConfig
    data: Dataset
    prep: PreprocessingPlan
    model_name: str
    plan_size: int | None = None
    """A public size the steps are planned on (q = B / plan_size), when the data's own count is
    private (``veil tune``'s training part: ⌊(1 − F)·N⌋); None: the data's count, N."""

    whitening: WhiteningPlan | None = None

    @property
    def n_planned(self) -> int:
        """What q = B/N and the steps per epoch are computed against: ``plan_size``, else N."""
        return self.data.n_records if self.plan_size is None else self.plan_size

    @property
    def pre_events(self) -> list[PrivacyEvent]:
        """The events charged before training, in the order they are made: the preprocessing release,
        if it is a DP one, then the whitening's Gram release, if any."""
        events = [] if self.prep.event is None else [self.prep.event]
        return events if self.whitening is None else [*events, self.whitening.event]


class UsesPrepared:
    """Mixin of a job's plan that holds a :class:`Prepared` as ``prepared``: its parts by name."""

    prepared: Prepared

    @property
    def cfg(self) -> TrainConfig:
        return self.prepared.cfg

    @property
    def data(self) -> Dataset:
        return self.prepared.data

    @property
    def prep(self) -> PreprocessingPlan:
        return self.prepared.prep

    @property
    def model_name(self) -> str:
        return self.prepared.model_name


def load_data(cfg: TrainConfig, *, streaming: bool = False, units: bool = False) -> Dataset:
    """The configured dataset, split by a keyed hash of each row (key from the run's seed), labels in
    the order of the declared public label set.

    ``streaming``: the caller trains from a :class:`~veil.pipeline.streaming.StreamedDataset` (``veil
    train``); any other job given ``stream`` is refused, since it would see only the probe rows.
    ``units``: the caller protects privacy units (``veil train``); any other job given
    ``privacy_unit`` is refused here, before a row is read (:mod:`veil.pipeline.units`)."""
    from veil.data import load_dataset
    from veil.pipeline.units import check_unit_request

    check_unit_request(cfg, "this job", supported=units)

    if cfg.stream:  # the training rows stay in the file: veil.pipeline.streaming
        from veil.pipeline.streaming import load_streamed

        if not streaming:
            raise ConfigError(
                "stream",
                True,
                "only veil train reads a table window by window; this job needs the table in memory",
                "drop stream (--stream) for this job",
            )

        return load_streamed(cfg)
    if cfg.table_schema is not None and cfg.dataset.startswith("parquet:"):
        from veil.pipeline.streaming import refuse_too_large

        refuse_too_large(cfg)
    if cfg.text_column is not None or cfg.model.startswith("hf:"):
        from veil.text.data import load_text_dataset

        return load_text_dataset(
            cfg.dataset,
            model=cfg.model,
            text_column=cfg.text_column or "text",
            target=cfg.target,
            max_length=cfg.max_length,
            test_fraction=cfg.test_fraction,
            seed=cfg.seed,
            preset="text" if cfg.fine_tune == "head" else "text-finetune",
            classes=cfg.classes,
            table=cfg.table,
            query=cfg.query,
            fine_tune=cfg.fine_tune,
            device=cfg.device,
            multiline_values=cfg.csv_multiline_values,
        )
    return load_dataset(
        cfg.dataset,
        data_dir=cfg.data_dir,
        target=cfg.target,
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        schema=cfg.table_schema,
        table=cfg.table,
        query=cfg.query,
        classes=cfg.classes,
        privacy_unit=cfg.privacy_unit,
    )


def check_declarations(cfg: TrainConfig, classes_fix: str | None = None) -> None:
    """Refuse what is wrong in the user's own declarations before the budget check (``veil train`` and
    ``veil tune``), which could otherwise hide it behind "budget exhausted" (or charge a run refused
    on public input): the table schema (syntax, types, reviewed) and, for the data
    :func:`veil.data.load_dataset` reads, every check it makes without a row
    (:func:`veil.data.check_request`: a missing label set, ...; ``classes_fix``: how this job declares
    one, when not ``--classes``); for text, the label set and the target too."""
    if not cfg.stream and cfg.text_column is None and not cfg.model.startswith("hf:"):
        from veil.data import CLASSES_FIX, check_request

        check_request(
            cfg.dataset,
            schema=cfg.table_schema,
            target=cfg.target,
            classes=cfg.classes,
            privacy_unit=cfg.privacy_unit,
            classes_fix=classes_fix or CLASSES_FIX,
            query=cfg.query,
        )
    elif cfg.table_schema is not None:
        from veil.tables.schema import load_schema

        load_schema(cfg.table_schema).require_reviewed(cfg.table_schema)
    if cfg.stream:  # what a streamed run cannot do, from the flags alone
        from veil.pipeline.streaming import check_streamable

        check_streamable(cfg)
    if cfg.text_column is not None:  # text needs a pretrained model's folder
        from veil.text.data import model_folder

        model_folder(cfg.model)
    if cfg.text_column is not None or cfg.model.startswith("hf:"):  # read by the text loader
        _check_text_request(cfg, classes_fix)


def _check_text_request(cfg: TrainConfig, classes_fix: str | None) -> None:
    """A text run's declarations, from the flags and the file's header alone (revH's H9): the label
    set (``--classes``: the text loader never takes it from the rows), a ``sql:`` URL's own refusals
    (:func:`veil.data.check_sql_request`) and, for a CSV or Parquet file, a ``--target`` among its
    column names."""
    from veil.data import CLASSES_FIX, check_names, check_sql_request, undeclared_classes

    check_sql_request(cfg.dataset, query=cfg.query)
    if cfg.classes is None:
        raise undeclared_classes(classes_fix or CLASSES_FIX)
    if cfg.table_schema is None:
        check_names(cfg.dataset, target=cfg.target)


NO_SCHEMA_HINT = (
    "; a table read without a schema keeps only the rows whose every feature is a number (a text or "
    "missing cell drops its row): draft a schema with `veil schema infer FILE --target COLUMN --out "
    "schema.toml`, review it, and train with --schema schema.toml (docs/tables.md)"
)
"""What the N = 0 refusal adds for a table read without a schema: a fixed text, chosen from the
configuration alone (the rows that were dropped are never described)."""


def check_delta(delta: float, n: int, hint: str = "") -> None:
    """Refuse δ ≥ 1/N: such a δ allows a mechanism that publishes one whole record. ``n`` is a public
    count (N by declaration, as in DP-SGD, or a size planned from public numbers); N < 1 is refused
    in one line (nothing to train on), never divided by. ``hint``: a fixed text the caller chose from
    its configuration (e.g. :data:`NO_SCHEMA_HINT`), appended to the fix."""
    from veil.errors import DataError

    if n < 1:
        raise DataError(
            "dataset",
            f"N = {n} training examples",
            "there is no example to train on, so no guarantee about one record can be stated",
            "provide more examples, or a smaller test or validation fraction" + hint,
        )
    if delta >= 1.0 / n:
        raise InvalidParameterError(
            "delta",
            delta,
            f"δ ≥ 1/N (N = {n} training examples) allows a mechanism that publishes a whole record outright",
            f"pass a δ well below 1/N, e.g. --delta {10 ** math.floor(math.log10(1.0 / n) - 1):g}",
        )


def delta_note(delta: float, n: int) -> str | None:
    """δ against 1/N as a note for the internal ``non_private`` section of a job whose N is private
    (``veil synth``, ``veil pate``): never a refusal, never a message. Once the rows are read nothing
    may depend on N but an accounted mechanism (a refusal at N = 73 and none at N = 72 would reveal
    one record); a δ ≥ 1/N is a weak guarantee, not a broken one. N = 0 has no 1/N: no note."""
    if n < 1 or delta < 1.0 / n:
        return None
    return (
        f"δ = {delta:g} ≥ 1/N (N = {n} records): the guarantee would allow a mechanism that "
        "publishes a whole record; choose δ well below 1/N for the next run on this data"
    )


def prepare(
    cfg: TrainConfig,
    *,
    private: bool = True,
    streaming: bool = False,
    units: bool = False,
    whiten: bool = False,
) -> Prepared:
    """Load and check the data, apply the presets, plan the preprocessing (nothing released).

    ``private=False`` (a σ = 0 reference run) skips the δ check: such a run promises nothing.
    ``streaming``, ``units``: see :func:`load_data`. With a privacy unit, N (for δ and the batch
    size) counts units. ``whiten``: the caller trains through :func:`veil.pipeline.loop.start`, which
    makes the preset's whitening release (``veil train``); planned for a private row-level run of a
    preset that has one (:func:`veil.presets.whitening_for`), from public facts only."""
    from veil.data.preprocess import plan_preprocessing
    from veil.models import resolve_name

    data = load_data(cfg, streaming=streaming, units=units)
    n = data.n_records
    if private:
        table = cfg.table_schema is None and cfg.dataset.partition(":")[0] in ("csv", "parquet", "sql")
        check_delta(cfg.delta, n, NO_SCHEMA_HINT if table else "")
    cfg = apply_presets(cfg, preset_for(cfg.model, data), n)
    assert cfg.batch_size is not None and cfg.epochs is not None
    if cfg.batch_size > n:
        raise SamplingError(
            "batch_size",
            cfg.batch_size,
            f"the sampling rate q = batch_size / N must be ≤ 1, and N = {n} training "
            + ("units" if data.units_train is not None else "examples"),
            f"pass --batch-size of at most {n}",
        )
    prep = plan_preprocessing(cfg, data)
    name = resolve_name(cfg.model, data.kind, data.input_shape)
    planned = whiten and private and data.units_train is None
    whitening = whitening_plan(cfg, data.preset, data.kind, data.input_shape) if planned else None
    return Prepared(cfg, data, prep, name, whitening=whitening)


def whitening_plan(
    cfg: TrainConfig, preset: str, kind: str, input_shape: tuple[int, ...]
) -> WhiteningPlan | None:
    """The scattering preset's whitening release a private, row-level, one-process run plans
    (:func:`veil.presets.whitening_for`; none with ``--stream``), from the model, the data's preset
    family, kind and example shape: public facts, known before a row is read for a built-in dataset
    (:func:`refuse_whitening_over_target`)."""
    from veil.models import resolve_name

    name = resolve_name(cfg.model, kind, input_shape)
    target = None if cfg.noise_multiplier is not None else cfg.epsilon
    settings = whitening_for(preset_of(cfg.model, preset, kind, input_shape), name, input_shape, target)
    if settings is None or cfg.stream:
        return None
    from veil.data.whitening import WhiteningPlan

    return WhiteningPlan(**settings)


def refuse_whitening_over_target(cfg: TrainConfig, whiten: bool) -> None:
    """Refuse, before the budget is charged and before a row is read, a target ε that the scattering
    preset's Gram release alone reaches (σ calibrated by :func:`veil.pipeline.budget.noise_multiplier`
    would find nothing left for training).

    Guarantee. The refusal is a function of public facts only: ε, δ and the accountant, the model, a
    built-in dataset's preset family, kind and example shape (:data:`veil.data.BUILTIN_SHAPES`), the
    privacy unit and ``whiten`` (one process: :func:`prepare`'s condition); the release's cost is
    ``Gaussian(S)`` with the preset's S, whatever the rows. Nothing to check for other data (their
    shape is read from the file: the post-read check on the whole preprocessing stands) or with a
    given σ (``--noise-multiplier``: no calibration)."""
    from veil.data import BUILTIN_PRESETS, BUILTIN_SHAPES

    if not whiten or cfg.privacy_unit is not None or cfg.noise_multiplier is not None:
        return
    if cfg.dataset not in BUILTIN_SHAPES:
        return
    kind, shape = BUILTIN_SHAPES[cfg.dataset]
    whitening = whitening_plan(cfg, BUILTIN_PRESETS[cfg.dataset], kind, shape)
    if whitening is None:
        return
    from veil.accounting.calibrate import epsilon_of
    from veil.errors import UnreachableTargetError

    cost = epsilon_of([whitening.event], cfg.delta, cfg.accountant)
    if cost >= cfg.epsilon:
        raise UnreachableTargetError(
            "epsilon",
            cfg.epsilon,
            f"the scattering preset's whitening releases one Gram matrix before training, which alone "
            f"costs ε = {cost:.3g} at δ = {cfg.delta:g}, leaving nothing for training",
            f"pass --epsilon above {cost:.3g} (the preset was tuned at ε = 3), or another --model "
            "(e.g. cnn, which has no whitening release)",
        )


def release_preprocessing(prepared: Prepared, index: int = 0) -> None:
    """Release the planned DP preprocessing statistic (the ``index``-th release of the run, from 0).

    Call only after the release's event is charged (a job with a ledger appends it first). Noise
    from the OS CSPRNG in secure mode, else from the seed derived for :attr:`Purpose.PREPROCESSING`."""
    from veil.data.preprocess import run_preprocessing

    cfg = prepared.cfg
    run_preprocessing(
        prepared.prep,
        prepared.data,
        private_source(cfg.reproducible, cfg.seed, Purpose.PREPROCESSING, index),
        count=prepared.n_planned,  # public: N, or tune's planned size (never the part's own count)
    )
