"""The one default-δ rule of every veil command and job (``docs/accounting.md``, "The default δ").

Rule: a job that releases a model or a table (``train``, ``audit``, ``pate``, ``tune``, ``synth``,
``federated``) and the calculators (``epsilon``, ``calibrate``) take δ = 1e-5 unless given; a DP
schema release (``schema infer --epsilon``), a preprocessing step whose δ adds to the δ of every run
trained on the schema afterwards, takes a hundredth of it, 1e-7, so that it leaves the later runs
room under the same dataset budget. The rule reads nothing from the data, so it leaks nothing. A job
whose N is known before it trains (the N a run declares public for its sampling rate) refuses
δ ≥ 1/N: a dataset of 100 000 rows or more needs an explicit, smaller ``--delta`` (below 1/(10 N)).
"""

from __future__ import annotations

DEFAULT_DELTA: float = 1e-5
"""δ of a job when none is given (see the module docstring for the rule)."""
DEFAULT_RELEASE_DELTA: float = 1e-7  # DEFAULT_DELTA / 100, written exactly
"""δ of a DP schema release when none is given: it adds to every later run's δ on the dataset."""
