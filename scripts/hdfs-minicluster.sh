#!/usr/bin/env bash
# Apache Hadoop's MiniDFSCluster for the checkpoint-storage tests
# (tests/test_checkpoint_hdfs.py): resolves tests/hdfs/pom.xml
# (hadoop-client-minicluster, the Hadoop version pyspark bundles) into
# Maven's own cache (~/.m2) and writes the classpath the tests start
# tests/hdfs/MiniHdfs.java with. Needs Maven and a JDK (as sdk-java.sh).
set -euo pipefail
cd "$(dirname "$0")/../tests/hdfs"
if ! command -v mvn >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "hdfs-minicluster: installing maven with apt-get..." >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven >/dev/null
  else
    echo "hdfs-minicluster: Maven (mvn) is needed for the HDFS tests; install it" >&2
    exit 1
  fi
fi
mvn -B -q dependency:build-classpath -Dmdep.outputFile=target/classpath.txt
touch target/classpath.txt  # make's stamp
echo "hdfs-minicluster: Hadoop's MiniDFSCluster resolved (tests/hdfs/target/classpath.txt)"
