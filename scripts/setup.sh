#!/usr/bin/env bash
# Installs everything the project needs into .venv (idempotent), and fetches Kafka's jars.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The service, GPU sampler and dev tools. verl comes second: it pulls a CUDA build of
# torch (several GB, cached by pip) and a newer click than faust-streaming declares;
# faust runs fine with it (we never use faust's click CLI), so we install it separately.
.venv/bin/python -m pip install -q -e ".[service,gpu,dev]"
if ! .venv/bin/python -c "import verl" 2>/dev/null; then
  .venv/bin/python -m pip install -q "verl==0.9.1" 2>&1 | grep -v "dependency conflicts\|requires click\|^ERROR: pip's dependency resolver" || true
  .venv/bin/python -c "import verl" || { echo "verl did not install" >&2; exit 1; }
fi
# Apache Kafka's jars from Maven Central (cached under ~/.cache/trainsentry and ~/.m2).
.venv/bin/python -c "from trainsentry.kafka_local import fetch_jars; print('kafka jars:', fetch_jars())"
