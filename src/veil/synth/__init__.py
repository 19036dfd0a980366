"""Differentially private synthetic tables: MST and AIM over a schema's public domain.

* :mod:`veil.synth.domain` — the discrete domain from the schema (levels, bins of public bounds);
* :mod:`veil.synth.junction`, :mod:`veil.synth.pgm` — junction tree, belief propagation, mirror
  descent estimation from noisy marginals, sampling (numpy only);
* :mod:`veil.synth.measure`, :mod:`veil.synth.mechanisms` — the Gaussian measurements, the
  exponential-mechanism selections, MST and AIM;
* :mod:`veil.synth.run` — the ``veil synth`` job; :mod:`veil.synth.outputs` — table and report.

``synthesize(...)`` is the Python entry point (the same as the command).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["SynthSettings", "run_synth", "synthesize"]


def __getattr__(name: str) -> Any:
    if name == "SynthSettings":
        from veil.synth.settings import SynthSettings

        return SynthSettings
    if name == "run_synth":
        from veil.synth.run import run_synth

        return run_synth
    raise AttributeError(name)


def synthesize(
    dataset: str,
    schema: str,
    *,
    epsilon: float,
    delta: float,
    rows: int,
    mechanism: str = "mst",
    out: str | Path | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Write a DP synthetic table of ``rows`` rows to ``out``; returns the report (see ``docs/synth.md``)."""
    from veil.synth.run import run_synth
    from veil.synth.settings import SynthSettings

    settings = SynthSettings(
        dataset=dataset,
        schema=str(schema),
        epsilon=epsilon,
        delta=delta,
        rows=rows,
        mechanism=mechanism,  # type: ignore[arg-type]
        out=Path(out) if out is not None else None,
        **options,
    )
    return run_synth(settings)
