#!/usr/bin/env bash
# System packages the test suite needs beyond Python: Debian's Chromium for the headless browser test
# (tests/e2e/test_progress_ui.py drives it with Playwright; `playwright install` is never used).
# Idempotent: installs only what is missing. Needs root (CI runs as root) or sudo.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  echo "ci_system_deps: chromium present ($(/usr/bin/chromium --version 2>/dev/null || echo '?'))"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "ci_system_deps: need root or sudo to install chromium" >&2; exit 1; }
  SUDO="sudo"
fi
echo "ci_system_deps: installing chromium with apt-get"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
/usr/bin/chromium --version
