#!/usr/bin/env bash
# Maven, for the scripts that resolve Java dependencies into ~/.m2
# (sdk-java.sh, sdk-xlang.sh, minicluster.sh): installs Debian's maven where
# it can (as root), as ensure-java.sh installs Java; otherwise says what to
# do. `ensure-maven.sh WHO` names the caller in its messages.
set -euo pipefail
who="${1:-beam-pyspark}"
if command -v mvn >/dev/null 2>&1; then exit 0; fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "$who: installing maven with apt-get..." >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven >/dev/null
  command -v mvn >/dev/null 2>&1 && exit 0
fi
echo "$who: Maven (mvn) is needed; install it (e.g. 'sudo apt-get install maven')" >&2
echo "  and run this again." >&2
exit 1
