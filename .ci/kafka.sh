#!/usr/bin/env bash
# CI helper: start a throw-away local Kafka broker and create the contract topics, or stop it.
#   .ci/kafka.sh start [PORT]   -> prints the bootstrap address; state in $TMPDIR/trainsentry-kafka-PORT
#   .ci/kafka.sh stop  [PORT]
# Uses the repository's .venv if present, else `trainsentry` on PATH (docs/kafka.md).
set -euo pipefail
cd "$(dirname "$0")/.."
TS=trainsentry
[ -x .venv/bin/trainsentry ] && TS=.venv/bin/trainsentry
CMD=${1:?usage: .ci/kafka.sh start|stop [PORT]}
PORT=${2:-9092}
DATA="${TMPDIR:-/tmp}/trainsentry-kafka-$PORT"
case "$CMD" in
  start)
    BOOTSTRAP=$("$TS" --log-level WARNING kafka start --port "$PORT" --data-dir "$DATA" --timeout 180)
    "$TS" --log-level WARNING topics create --bootstrap "$BOOTSTRAP" >&2
    echo "$BOOTSTRAP" ;;
  stop)
    "$TS" --log-level WARNING kafka stop --port "$PORT" --data-dir "$DATA" ;;
  *) echo "usage: .ci/kafka.sh start|stop [PORT]" >&2; exit 2 ;;
esac
