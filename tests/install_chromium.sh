#!/usr/bin/env bash
# Debian's chromium for the browser test (tests/test_browser.py): Playwright drives it
# through executable_path, because browser downloads (`playwright install`) are impossible
# here. Installs it when missing and possible (root with apt-get); otherwise says so, and the
# test skips with the reason. Fast when chromium is already there.
set -uo pipefail
CHROMIUM=${DMUON_EDU_CHROMIUM:-/usr/bin/chromium}

if [ -x "$CHROMIUM" ]; then
    echo "chromium is installed: $CHROMIUM"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "chromium is missing and cannot be installed here (needs root and apt-get): the browser test will be skipped."
    echo "To run it: sudo apt-get install -y chromium"
    exit 0
fi
echo "installing chromium with apt-get (about 15 s) ..."
log=$(mktemp)
if DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$log" 2>&1 &&
   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >>"$log" 2>&1; then
    echo "installed: $("$CHROMIUM" --version 2>/dev/null)"
    rm -f "$log"
else
    tail -n 20 "$log"
    echo "apt-get could not install chromium (full log: $log): the browser test will be skipped."
fi
