"""``python -m veil ...``: the ``veil`` command (also what ``torchrun -m veil ...`` starts on each rank)."""

from veil.cli.main import run

run()
