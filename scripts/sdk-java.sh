#!/usr/bin/env bash
# Beam's Java SDK for the Java tests (tests/test_sdk_java*.py): resolves
# sdks/java/pom.xml into Maven's own cache (~/.m2) so that the tests run
# offline, and writes the pipeline classpath the tests start Java with.
# Needs Maven and a JDK; installs Debian's maven where it can (as root).
set -euo pipefail
cd "$(dirname "$0")/../sdks/java"
if ! command -v mvn >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "sdk-java: installing maven with apt-get..." >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven >/dev/null
  else
    echo "sdk-java: Maven (mvn) is needed for the Java SDK's tests; install it" >&2
    echo "  (e.g. 'sudo apt-get install maven') and run this again." >&2
    exit 1
  fi
fi
# go-offline: every dependency and plugin the tests need, so that they run
# with mvn -o. It misses what surefire resolves when it runs (its JUnit 4.7
# provider): one of Beam's own unit tests (no runner, under a second) runs
# once online to fetch that too.
mvn -B -q dependency:go-offline
mvn -B -q surefire:test -Dtest=VarIntCoderTest
mvn -B -q -o dependency:build-classpath -Dmdep.outputFile=target/classpath.txt
# Beam's own examples (beam-examples-java) with what their classes link
# (tests/test_sdk_examples.py): a classpath of their own.
(cd examples && mvn -B -q dependency:go-offline &&
 mvn -B -q -o dependency:build-classpath -Dmdep.outputFile=target/classpath.txt)
touch target/classpath.txt  # make's stamp: Maven keeps an unchanged file's time
echo "sdk-java: Beam's Java SDK resolved (classpath in sdks/java/target/classpath.txt)"
