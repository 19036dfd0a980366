#!/bin/sh
# Make the PostgreSQL server binaries available to the tests (they start a throw-away server).
# Idempotent and quiet: does nothing when pg_ctl is found; installs Debian's `postgresql` when root.
set -eu
if command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends postgresql >/dev/null
    exit 0
fi
if [ -n "${CI:-}" ]; then
    echo "install-postgres: no PostgreSQL server binaries and cannot install them (need root and apt-get);" \
        "CI must run the PostgreSQL tests" >&2
    exit 1
fi
echo "install-postgres: no PostgreSQL server binaries and cannot install them (need root and apt-get);" \
    "the PostgreSQL tests will be skipped" >&2
