#!/usr/bin/env bash
# Best effort: install headless Chromium and its WebDriver (Debian's `chromium` and
# `chromium-driver` packages) for the page test, tests/server/test_page.py. Run by
# `make setup`. Where it cannot (no apt-get, neither root nor passwordless sudo, no
# network, no such package) it says so and exits 0: that test then skips with a reason.
set -u

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
say() { echo "setup: $*; tests/server/test_page.py will skip its browser tests." >&2; }

if ! command -v apt-get >/dev/null 2>&1; then
    say "no apt-get to install Chromium with (install chromium and chromedriver yourself)"
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    say "installing Chromium needs root (sudo apt-get install chromium chromium-driver)"
    exit 0
fi

echo "setup: installing chromium and chromium-driver with apt-get (for the page test)" >&2
if "${as_root[@]}" apt-get update -q >/dev/null \
   && DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -q \
        chromium chromium-driver >/dev/null; then
    exit 0
fi
say "apt-get could not install chromium chromium-driver"
exit 0
