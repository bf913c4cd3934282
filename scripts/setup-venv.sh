#!/usr/bin/env bash
# `make setup`: Java, the virtualenv and beam-pyspark with its libraries,
# one line per step with its time so far, and pip's own lines as it
# downloads (a fresh machine fetches ~700 MB, apache-beam and pyspark the
# largest: minutes, more on a busy or slow link). Usage: setup-venv.sh
# PYTHON VENV EXTRAS
set -euo pipefail
python=$1 venv=$2 extras=$3
start=$SECONDS
step() {
  printf '\n==> [%s/3] %s (%ss so far)\n' "$1" "$2" "$((SECONDS - start))"
}
step 1 "Java for Spark"
scripts/ensure-java.sh
java -version 2>&1 | head -1
step 2 "virtualenv $venv"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
step 3 "beam-pyspark[$extras] and its libraries: apache-beam, pyspark, ... (pip's lines below; minutes the first time)"
# Packages pip already has are not news: only what it fetches and installs.
"$venv/bin/python" -m pip install --progress-bar off -e ".[$extras]" \
  | { grep --line-buffered -v '^Requirement already satisfied' || true; }
printf '\n==> set-up done in %ss\n' "$((SECONDS - start))"
