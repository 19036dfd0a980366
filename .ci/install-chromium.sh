#!/bin/sh
# Make Debian's Chromium available to the browser tests (tests/test_browser.py drives it with
# Playwright; never `playwright install`, which would download a browser at run time).
# Idempotent and quiet: does nothing when /usr/bin/chromium is found; installs it when root.
set -eu
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q chromium >/dev/null
    exit 0
fi
echo "install-chromium: no /usr/bin/chromium and cannot install it (need root and apt-get);" \
    "the browser tests will be skipped (and fail in CI)" >&2
