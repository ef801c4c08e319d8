#!/usr/bin/env bash
# Installs everything the project needs into .venv (idempotent), and fetches Kafka's jars.
# A stamp of pyproject.toml, setup.py, the C module + this script skips the pip steps when
# nothing changed (the editable install compiles detectors/_bestc.c in place).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.trainsentry-setup
want=$(cat pyproject.toml setup.py detectors/_bestc.c scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import verl, faust, trainsentry" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  # The service, GPU sampler and dev tools. verl comes second: it pulls a CUDA build of
  # torch (several GB, cached by pip) and declares a newer click than faust-streaming
  # does; both run fine with either (we never use faust's click CLI), so pip's conflict
  # warning is expected and filtered.
  .venv/bin/python -m pip install -q -e ".[service,gpu,dev]"
  if ! .venv/bin/python -c "import verl" 2>/dev/null; then
    .venv/bin/python -m pip install -q "verl==0.9.1" 2>&1 | grep -v "dependency conflicts\|requires click\|^ERROR: pip's dependency resolver" || true
  fi
  .venv/bin/python -c "import verl, faust, trainsentry" || { echo "setup: an import failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# Apache Kafka's jars from Maven Central (cached under ~/.cache/trainsentry and ~/.m2).
.venv/bin/python -c "from trainsentry.kafka_local import fetch_jars; print('kafka jars:', fetch_jars())"
# The browser test (headless Chromium + chromedriver) and promtool for the rule checks,
# from Debian's packages; only as root (CI), only when missing.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=""
  [ -x /usr/bin/chromium ] || missing="$missing chromium"
  [ -x /usr/bin/chromedriver ] || missing="$missing chromium-driver"
  command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
  if [ -n "$missing" ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
  fi
fi
