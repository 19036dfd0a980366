"""Privacy auditing: membership-inference attacks and canary audits giving empirical ε lower bounds.

* :mod:`veil.audit.bounds` — the one-run ε lower bound (Steinke, Nasr & Jagielski 2023);
* :mod:`veil.audit.mia` — the loss-threshold attack and LiRA (online and offline);
* :mod:`veil.audit.canaries` — gradient-space (white-box) canaries, and why canaries are sound;
* :mod:`veil.audit.coordinates` — where gradient canaries go (quiet coordinates) and how many;
* :mod:`veil.audit.input_canaries` — input-space (black-box) canaries;
* :mod:`veil.audit.run` — ``veil audit``: train with canaries, attack, report (the job);
* :mod:`veil.audit.fit` — training for an audit, through :mod:`veil.pipeline`;
* :mod:`veil.audit.attacks` — the membership-inference attacks of an audit, their section and plots;
* :mod:`veil.audit.settings` — what to audit, the report, config resolution;
* :mod:`veil.audit.hook` — the canaries ``veil train --audit`` attaches (called by training).

Nothing here is imported by ``import veil``; submodules import torch/scipy only when needed.
"""

from __future__ import annotations

from veil.audit.bounds import OneRunBound, bound_from_scores, epsilon_lower_bound, p_value

__all__ = ["OneRunBound", "bound_from_scores", "epsilon_lower_bound", "p_value"]
