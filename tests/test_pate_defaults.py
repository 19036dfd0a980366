"""``veil pate`` follows the job rules of veil.pipeline.randomness: secure noise by default (fresh each
run, nothing of it stored), ``--reproducible`` is research mode and never release-ready, the label
set is declared, and non-private figures live only in report.json's ``non_private`` section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from veil.cli.main import main
from veil.errors import ConfigError
from veil.pate.config import resolve_pate_config
from veil.pate.run import run_pate

# Byte strings a stored noise seed or generator state would leave in a file.
GENERATOR_MARKS = (b"noise_rng", b"bit_generator", b"PCG64", b"rng_state")

# σ = 30 votes over 10 teachers: each answer is close to a uniform draw over the 10 classes, so two
# runs with fresh noise give 60 equal labels with probability far below 1e-12.
_NOISY = {"dataset": "digits", "teachers": 10, "sigma": 30.0, "epsilon": 20.0, "queries": 60}


def _labels(folder: Path) -> np.ndarray:
    return np.asarray(np.load(folder / "labels.npz")["label"])


def _run(tmp_path: Path, name: str, **extra: Any) -> Any:
    return run_pate({**_NOISY, "semi_supervised": False, "out": str(tmp_path / name), **extra})


def test_default_runs_draw_fresh_noise_and_store_no_noise_seed(tmp_path: Path) -> None:
    from veil.pipeline.seeds import Purpose, derive_seed

    a, b = _run(tmp_path, "a"), _run(tmp_path, "b")
    assert a.randomness == b.randomness == "secure" and a.release_ready
    assert next(c for c in a.checks if c.name == "secure_randomness").passed
    assert not np.array_equal(_labels(tmp_path / "a"), _labels(tmp_path / "b"))  # same flags, other noise
    noise_seed = str(derive_seed(0, Purpose.PATE_NOISE)).encode()
    files = [p for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert any(p.parent.name == "teachers" for p in files)  # the teachers' folder is scanned too
    for path in files:
        data = path.read_bytes()
        assert noise_seed not in data, path
        assert not any(mark in data for mark in GENERATOR_MARKS), path
    assert "research mode" not in a.guarantee_statement
    # Research mode: replayable, hence never release-ready.
    r1, r2 = _run(tmp_path, "r1", reproducible=True), _run(tmp_path, "r2", reproducible=True)
    assert np.array_equal(_labels(tmp_path / "r1"), _labels(tmp_path / "r2"))
    assert r1.randomness == "seeded" and not r1.release_ready and r2.reproducible
    assert not next(c for c in r1.checks if c.name == "secure_randomness").passed
    assert "knows the seed" in r1.guarantee_statement
    saved = json.loads((tmp_path / "r1" / "report.json").read_text())
    assert saved["randomness"] == "seeded" and saved["release_ready"] is False


def test_reproducible_flag_is_research_mode_and_the_summary_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["pate", "--dataset", "digits", "--teachers", "10", "--sigma", "2", "--epsilon", "10"]
    argv += ["--queries", "20", "--no-semi-supervised"]
    assert main([*argv, "--out", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "release-ready: secure randomness" in text and "NOT release-ready" not in text
    assert "(non-private, internal)" in text
    assert main([*argv, "--reproducible", "--out", str(tmp_path / "r")]) == 0
    assert "NOT release-ready: research mode" in capsys.readouterr().out
    r = json.loads((tmp_path / "r" / "report.json").read_text())
    assert r["randomness"] == "seeded" and r["release_ready"] is False and r["reproducible"] is True
    assert "knows the seed" in r["guarantee_statement"]
    assert not next(c for c in r["checks"] if c["name"] == "secure_randomness")["passed"]
    page = (tmp_path / "r" / "report.html").read_text()
    assert "not release-ready" in page and '<section class="internal">' in page


def test_legacy_secure_rng_maps_onto_reproducible_and_classes_are_read(tmp_path: Path) -> None:
    assert resolve_pate_config(None, {"secure_rng": False}).reproducible is True
    assert resolve_pate_config(None, {"secure_rng": True}).reproducible is False
    assert resolve_pate_config(None, {}).reproducible is False  # secure is the default
    toml = tmp_path / "p.toml"
    toml.write_text("[pate]\nreproducible = true\nsecure_rng = true\n")
    with pytest.raises(ConfigError, match="secure_rng"):
        resolve_pate_config(toml)
    cfg = resolve_pate_config(None, {"classes": "no,yes"})
    assert cfg.classes == ["no", "yes"]


def test_own_data_needs_declared_classes_and_reports_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = (x[:, 0] > 0).astype(int)
    csv = tmp_path / "d.csv"
    csv.write_text(
        "a,b,c,label\n" + "\n".join(f"{r[0]},{r[1]},{r[2]},{t}" for r, t in zip(x, y, strict=True)) + "\n"
    )
    np.savez(tmp_path / "public.npz", x=rng.normal(size=(40, 3)))  # declared public (issue 23, item 6)
    settings = {"dataset": f"csv:{csv}", "target": "label", "teachers": 5, "sigma": 1.0, "epsilon": 10.0}
    settings |= {"queries": 10, "delta": 1e-4, "semi_supervised": False}
    settings |= {"public_data": str(tmp_path / "public.npz")}
    with pytest.raises(ConfigError, match="classes=None"):
        run_pate({**settings, "out": str(tmp_path / "none")})
    assert not (tmp_path / "none").exists()  # refused before anything is written
    rep = run_pate({**settings, "classes": ["0", "1"], "out": str(tmp_path / "ok")})
    assert rep.label_set["classes"] == ["0", "1"] and rep.label_set["declared_by"].startswith("--classes")
