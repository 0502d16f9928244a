#!/usr/bin/env bash
# Debian's chromium and chromium-driver, for the chat page's browser tests (tests/test_webpage.py),
# installed when missing: as root, or through sudo. Elsewhere it says what to install and leaves it.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install_browser: no apt-get here; install Chromium and ChromeDriver for tests/test_webpage.py" >&2
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q chromium chromium-driver >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium chromium-driver >/dev/null; }
