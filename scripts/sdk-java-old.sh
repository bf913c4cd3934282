#!/usr/bin/env bash
# An older Beam Java client for tests/test_sdk_java_old.py (issue 43,
# version skew): resolves sdks/java-old/pom.xml into Maven's own cache
# (~/.m2), so that the tests run offline, and writes the classpath the
# tests start Java with. Maven comes with `make sdk-java` (a prerequisite).
set -euo pipefail
cd "$(dirname "$0")/../sdks/java-old"
mvn -B -q dependency:go-offline
mvn -B -q -o dependency:build-classpath -Dmdep.outputFile=target/classpath.txt
touch target/classpath.txt  # make's stamp: Maven keeps an unchanged file's time
echo "sdk-java-old: Beam $(sed -n 's:.*<beam.version>\(.*\)</beam.version>.*:\1:p' pom.xml)'s Java SDK resolved (sdks/java-old/target/classpath.txt)"
