"""The steps every job shares, each defined once (jobs: :mod:`veil.training`, :mod:`veil.audit.run`,
:mod:`veil.pate.run`); below the jobs, above the core (accounting, engine, clipping, data, models).

* :mod:`~veil.pipeline.seeds` — :func:`derive_seed` and the :class:`Purpose` of each random part;
* :mod:`~veil.pipeline.randomness` — secure (OS CSPRNG, default) or seeded research randomness of the
  private draws, the ``secure_randomness`` check and ``release_ready``;
* :mod:`~veil.pipeline.data` — load and check the data, presets, preprocessing plan and release;
* :mod:`~veil.pipeline.budget` — σ for the planned run, steps that fit (via ``veil.accounting``);
* :mod:`~veil.pipeline.model` — network, released model, trainable part, optimizer, engine, evaluation;
* :mod:`~veil.pipeline.run_folder` — file names, default and checked ``--out``, atomic writes;
* :mod:`~veil.pipeline.checkpoints` — checkpoints, resume and its verification;
* :mod:`~veil.pipeline.loop` — the accounted DP-SGD loop (ledger entry before each update, EMA);
* :mod:`~veil.pipeline.checks` — the report's checklist items;
* :mod:`~veil.pipeline.outputs` — strict-JSON cleaning, the released model's bytes.

Report pages are rendered by :mod:`veil.report.render` (one jinja Environment for every job).
Importing this package loads nothing heavy.
"""
