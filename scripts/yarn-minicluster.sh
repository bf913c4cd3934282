#!/usr/bin/env bash
# Apache Hadoop's MiniYARNCluster and MiniDFSCluster for the YARN test
# (tests/test_yarn.py): resolves tests/yarn/pom.xml
# (hadoop-client-minicluster, the Hadoop version pyspark bundles) into
# Maven's own cache (~/.m2) and writes the classpath the test starts
# tests/yarn/MiniYarn.java with. Needs Maven and a JDK (as sdk-java.sh).
set -euo pipefail
cd "$(dirname "$0")/../tests/yarn"
if ! command -v mvn >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "yarn-minicluster: installing maven with apt-get..." >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven >/dev/null
  else
    echo "yarn-minicluster: Maven (mvn) is needed for the YARN test; install it" >&2
    exit 1
  fi
fi
mvn -B -q dependency:build-classpath -Dmdep.outputFile=target/classpath.txt
touch target/classpath.txt  # make's stamp
echo "yarn-minicluster: Hadoop's MiniYARNCluster resolved (tests/yarn/target/classpath.txt)"
