"""job: ``veil predict``, a trained table model's predictions for new rows, encoded as in training.

The model is rebuilt from the run folder alone: ``config.toml`` (which network), ``encoder.json``
(the schema and feature layout the model was trained on) and ``model.pt`` (the released DP weights).
New rows go through the same encoder, so a level, bound or missing value is treated exactly as in
training: a row that a ``"drop"`` policy of the schema drops gets no prediction (its row number is
skipped, and the summary counts it). Predicting from the released
model is post-processing of a DP release: it costs no privacy budget. The predictions themselves are
about the new rows, and are theirs to protect.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np

from veil.errors import CheckpointError, ConfigError

__all__ = ["load_released_model", "predict_table"]


def load_released_model(run_dir: Path) -> tuple[Any, Any]:
    """The released model (eval mode) and its encoder, rebuilt from the run folder."""
    import torch

    from veil.config import load_config_file, make_config
    from veil.data import Dataset
    from veil.data.preprocess import plan_preprocessing
    from veil.pipeline.model import assemble, build_net
    from veil.pipeline.run_folder import CONFIG
    from veil.tables.encoder import TableEncoder

    for name in (CONFIG, "encoder.json", "model.pt"):
        if not (run_dir / name).is_file():
            raise CheckpointError(
                "run folder",
                str(run_dir),
                f"it has no {name}: veil predict needs a finished veil train run on a table read through a "
                "schema (config.toml, encoder.json and model.pt)",
                "pass the --out folder of such a run",
            )
    cfg = make_config(load_config_file(run_dir / CONFIG), source="saved config")
    encoder = TableEncoder.load(run_dir / "encoder.json")
    empty = np.zeros((0, encoder.width), dtype=np.float32)
    no_labels = np.zeros(0, dtype=np.int64)
    shell = Dataset(
        name="predict",
        kind="table",
        x_train=empty,
        y_train=no_labels,
        x_test=empty,
        y_test=no_labels,
        classes=encoder.classes,
        sha256="",
        preset="table",
        feature_names=list(encoder.feature_names),
        encoder=encoder,
    )
    model = assemble(plan_preprocessing(cfg, shell), (encoder.width,), build_net(cfg, shell, cfg.seed))
    try:
        state = torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:
        raise CheckpointError(
            "model.pt",
            str(run_dir / "model.pt"),
            f"the weights do not fit the model the run's config and encoder describe ({type(exc).__name__})",
            "restore the run folder's files as veil train wrote them",
        ) from None
    return model.eval(), encoder


def predict_table(
    run_dir: str,
    dataset: str,
    out: str,
    *,
    table: str | None = None,
    query: str | None = None,
    force: bool = False,
    batch: int = 65_536,
) -> dict[str, Any]:
    """Write ``out`` (CSV: row, prediction, one probability per class); returns a summary."""
    import torch

    from veil.accounting.ledger import atomic_write_text
    from veil.tables import load_table
    from veil.tables.encoder import EncodedTable

    out_path = Path(out).expanduser()
    if out_path.exists() and not force:
        raise ConfigError("--out", str(out_path), "the file exists", "choose another path, or pass --force")
    if not out_path.parent.is_dir():
        raise ConfigError("--out", str(out_path), "its folder does not exist", "create the folder first")
    model, encoder = load_released_model(Path(run_dir).expanduser())
    encoded = load_table(dataset, encoder.schema, table=table, query=query, with_target=False)
    assert isinstance(encoded, EncodedTable)
    probs = np.empty((len(encoded.x), len(encoder.classes)), dtype=np.float64)
    with torch.no_grad():
        for start in range(0, len(encoded.x), batch):
            logits = model(torch.from_numpy(encoded.x[start : start + batch]))
            probs[start : start + batch] = torch.softmax(logits.double(), dim=1).numpy()
    labels = np.asarray(encoder.classes, dtype=object)[probs.argmax(axis=1)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["row", "prediction", *(f"p_{c}" for c in encoder.classes)])
    assert encoded.dropped is not None
    numbers = np.flatnonzero(~encoded.dropped) + 1  # the source's row numbers of the encoded rows
    for i, label, p in zip(numbers, labels, probs, strict=True):
        writer.writerow([int(i), label, *(f"{v:.6g}" for v in p)])
    atomic_write_text(out_path, buffer.getvalue())
    counts = {str(c): int((labels == c).sum()) for c in encoder.classes}
    return {
        "predictions": str(out_path),
        "rows": len(labels),
        "rows dropped by the schema's rules": int(encoded.dropped.sum()),
        "predicted per class": counts,
    }
