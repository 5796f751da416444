#!/usr/bin/env bash
# Start tritonserver on all interfaces with the SpecGuide model repository, under the supervisor
# that starts it again if a Python backend stub dies (specguide/process/supervisor.py); extra arguments
# are passed to tritonserver (e.g. --log-verbose=1).
set -euo pipefail
exec python3 -m specguide.process.supervisor --http "127.0.0.1:${TRITON_HTTP_PORT:-8000}" -- tritonserver \
  --model-repository="${MODEL_REPOSITORY:-/models}" \
  --http-port="${TRITON_HTTP_PORT:-8000}" \
  --grpc-port="${TRITON_GRPC_PORT:-8001}" \
  --metrics-port="${TRITON_METRICS_PORT:-8002}" \
  --allow-metrics=true \
  "$@"
