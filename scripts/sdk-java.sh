#!/usr/bin/env bash
# Beam's Java SDK for the Java tests (tests/test_sdk_java*.py): resolves
# sdks/java/pom.xml into Maven's own cache (~/.m2) so that the tests run
# offline, and writes the pipeline classpath the tests start Java with.
# Needs Maven and a JDK; installs Debian's maven where it can (as root).
set -euo pipefail
"$(dirname "$0")/ensure-maven.sh" "sdk-java"
cd "$(dirname "$0")/../sdks/java"
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
