#!/usr/bin/env bash
# Starts Beam's Java expansion service for Beam SQL or KafkaIO (or the
# tests' one for Beam's cross-language ValidatesRunner suite) from the
# jars `make sdk-xlang` resolved (docs/multi-language.md):
#
#   scripts/expansion-service.sh sql|kafka|validates PORT [more ExpansionService options]
#
# Python pipelines then name it: SqlTransform(..., expansion_service=
# 'localhost:PORT'), ReadFromKafka(..., expansion_service='localhost:PORT').
# Its transforms get a PROCESS environment that starts Beam's Java harness
# with beam-pyspark's boot (python -m beam_pyspark.boot java) from the same
# jars, which the expansion names as the environment's artifacts; the runner
# stages them and serves them to the harness. With --beam-default-environment
# as the third argument it keeps Beam's default instead, a Docker image
# (apache/beam_java17_sdk:<version>), which beam-pyspark maps to the same
# boot (docs/guide/environments.md, Environment overrides).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
name="${1:?usage: $0 sql|kafka|validates PORT [options]}"
port="${2:?usage: $0 sql|kafka|validates PORT [options]}"
shift 2
environment=(--defaultEnvironmentType=PROCESS
  '--defaultEnvironmentConfig={"command": "python -m beam_pyspark.boot java"}')
if [ "${1:-}" = "--beam-default-environment" ]; then
  environment=()
  shift
fi
cp_file="$root/sdks/xlang/$name/target/classpath.txt"
if [ ! -f "$cp_file" ]; then
  echo "expansion-service: $cp_file is missing: run 'make sdk-xlang'" >&2
  exit 1
fi
java="${JAVA_HOME:+$JAVA_HOME/bin/}java"
exec "$java" -cp "$(cat "$cp_file")" \
  org.apache.beam.sdk.expansion.service.ExpansionService "$port" \
  "${environment[@]}" "$@"
