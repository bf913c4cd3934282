#!/usr/bin/env bash
# Spark needs a Java runtime (17+). Say so clearly, and install one where we
# can (Debian/Ubuntu as root); otherwise tell the user what to do.
set -euo pipefail
if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then exit 0; fi
if command -v java >/dev/null 2>&1; then exit 0; fi
echo "beam-pyspark: Spark needs Java 17 or later, and no 'java' was found on PATH." >&2
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "beam-pyspark: installing openjdk-17-jre-headless with apt-get..." >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
  command -v java >/dev/null 2>&1 && exit 0
fi
echo "beam-pyspark: install a JDK (e.g. 'sudo apt-get install openjdk-17-jre-headless'," >&2
echo "  or 'brew install openjdk@17') or set JAVA_HOME, then run this again." >&2
exit 1
