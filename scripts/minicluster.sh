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
"$(dirname "$0")/ensure-maven.sh" "$name-minicluster"
cd "$(dirname "$0")/../tests/$name"
mvn -B -q dependency:build-classpath -Dmdep.outputFile=target/classpath.txt
touch target/classpath.txt  # make's stamp
echo "$name-minicluster: $what resolved (tests/$name/target/classpath.txt)"
