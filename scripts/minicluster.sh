#!/usr/bin/env bash
# Apache Hadoop's mini clusters for the tests, from the Hadoop version
# pyspark bundles (hadoop-client-minicluster): `minicluster.sh hdfs` for
# the checkpoint-storage tests (tests/hdfs: MiniDFSCluster, also `make
# hdfs`), `minicluster.sh yarn` for the YARN tests (tests/yarn:
# MiniYARNCluster with a MiniDFSCluster). Resolves tests/NAME/pom.xml into
# Maven's own cache (~/.m2) and writes the classpath the tests start
# tests/NAME's Java main with. Needs Maven and a JDK (as sdk-java.sh).
set -euo pipefail
name="${1:?usage: minicluster.sh hdfs|yarn}"
case "$name" in
  hdfs) what="Hadoop's MiniDFSCluster" ;;
  yarn) what="Hadoop's MiniYARNCluster" ;;
  *) echo "minicluster.sh: no mini cluster '$name' (hdfs or yarn)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../tests/$name"
if ! command -v mvn >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "$name-minicluster: installing maven with apt-get..." >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven >/dev/null
  else
    echo "$name-minicluster: Maven (mvn) is needed for $what; install it" >&2
    exit 1
  fi
fi
mvn -B -q dependency:build-classpath -Dmdep.outputFile=target/classpath.txt
touch target/classpath.txt  # make's stamp
echo "$name-minicluster: $what resolved (tests/$name/target/classpath.txt)"
