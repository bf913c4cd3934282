#!/usr/bin/env bash
# The status page's browser tests (tests/test_status_live.py) drive a
# real headless Chromium through Selenium with Debian's chromedriver; no
# browser is ever downloaded at run time. Install both where we can
# (Debian/Ubuntu as root), as ensure-java.sh installs Java; otherwise say
# what to do. Not fatal: everything but those tests runs without them, and
# those tests fail (not skip) on Linux without them, saying why.
set -uo pipefail
have() { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }
if have; then exit 0; fi
if [ "$(uname -s)" != "Linux" ]; then exit 0; fi  # the tests skip there
echo "beam-pyspark: the browser tests need Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver)." >&2
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "beam-pyspark: installing chromium and chromium-driver with apt-get..." >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends chromium chromium-driver >/dev/null
  if have; then exit 0; fi
fi
echo "beam-pyspark: install them (e.g. 'sudo apt-get install chromium chromium-driver');" >&2
echo "  until then tests/test_status_live.py fails." >&2
exit 0
