#!/usr/bin/env bash
# Java for multi-language pipelines (docs/multi-language.md): Beam's Java
# expansion services for Beam SQL and KafkaIO, Apache Kafka's own
# broker for the tests' real Kafka, and the expansion service of Beam's
# cross-language ValidatesRunner suite (validates, tests only). Maven
# resolves each of sdks/xlang/* into its cache (~/.m2) and writes the
# classpath a JVM starts with to
# sdks/xlang/<name>/target/classpath.txt; the SQL and validates ones first
# build their registrars (src/). Nothing is fetched when the tests run.
set -euo pipefail
"$(dirname "$0")/ensure-maven.sh" "sdk-xlang"
cd "$(dirname "$0")/../sdks/xlang"
for name in sql kafka broker validates; do
  (
    cd "$name"
    if [ -d src ]; then
      mvn -B -q package -DskipTests
      jar="$(pwd)/target/beam-pyspark-xlang-$name-0.jar"
    else
      jar=""
    fi
    mvn -B -q dependency:build-classpath -Dmdep.outputFile=target/deps.txt
    { [ -n "$jar" ] && printf '%s:' "$jar"; cat target/deps.txt; } > target/classpath.txt
    echo "sdk-xlang: $name: $(tr ':' '\n' < target/classpath.txt | wc -l) jars (sdks/xlang/$name/target/classpath.txt)"
  )
done
touch ../../sdks/xlang/.resolved
