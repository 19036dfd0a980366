"""The `veil` entry point called in-process, and `veil budget show --json` for one dataset: shared by
the tests of the jobs charged to the budget registry."""

from __future__ import annotations

import json

import pytest

from veil.cli.main import main


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``veil ARGS``."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def show(capsys: pytest.CaptureFixture[str], spec: str) -> dict:
    """The registry's JSON record of the dataset named by ``spec``."""
    code, out, _ = cli(capsys, "budget", "show", "--dataset", spec, "--json")
    assert code == 0
    return json.loads(out)["datasets"][0]
