"""In CI the PostgreSQL tests must run: a missing server fails the suite there instead of skipping.

CI sets ``CI`` in the environment (GitHub Actions, GitLab, ... all do); ``.ci/install-postgres.sh``
then exits non-zero when it cannot install the server, and every PostgreSQL fixture goes through
``_postgres.skip_without_postgres``, which fails under ``CI`` and skips elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import _postgres


def _no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_postgres, "pg_bindir", lambda: None)


def test_without_a_server_ci_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_server(monkeypatch)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI runs the PostgreSQL tests"):
        _postgres.skip_without_postgres()


def test_without_a_server_elsewhere_the_tests_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_server(monkeypatch)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        _postgres.skip_without_postgres()


def test_every_postgres_fixture_goes_through_the_check() -> None:
    """No PostgreSQL fixture skips on its own (which would pass CI silently)."""
    here = Path(__file__).parent
    for name in ("test_tables_postgres.py", "test_registry_concurrency.py"):
        text = (here / name).read_text(encoding="utf-8")
        assert "skip_without_postgres()" in text and "pytest.skip(" not in text, name


def test_the_install_script_fails_in_ci_when_it_cannot_install() -> None:
    """After the two ways to succeed (binaries found, apt-get as root), CI exits 1 before the skip notice."""
    script = (Path(__file__).parents[1] / ".ci" / "install-postgres.sh").read_text(encoding="utf-8")
    ci_block = script[script.index('if [ -n "${CI:-}" ]') :]
    ci_block = ci_block[: ci_block.index("\nfi")]
    assert "exit 1" in ci_block
    assert script.index("apt-get install") < script.index(ci_block) < script.index("will be skipped")
