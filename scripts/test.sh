#!/usr/bin/env bash
# Starts a local Kafka broker (unless one answers already), runs the whole test suite
# against it, and stops the broker it started. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${TRAINSENTRY_TEST_KAFKA_PORT:-9092}
DATA_DIR=${TRAINSENTRY_TEST_KAFKA_DIR:-$(mktemp -d /tmp/trainsentry-ci-kafka.XXXXXX)}
export TRAINSENTRY_KAFKA_BOOTSTRAP=127.0.0.1:$PORT
started=0
if ! (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null; then
  .venv/bin/trainsentry kafka start --port "$PORT" --data-dir "$DATA_DIR"
  started=1
fi
cleanup() { [ "$started" = 1 ] && .venv/bin/trainsentry kafka stop --port "$PORT" --data-dir "$DATA_DIR" || true; }
trap cleanup EXIT
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
