#!/usr/bin/env bash
# Smoke-test the image build.sh made: run it with no arguments (the bundled model), chat through
# it, check its health check, stop it with SIGTERM and see it exit cleanly; then the reference
# launch line (vllm serve -> cpuserve serve, the model mounted at /models). Prints the timings.
#   container/smoke.sh [TAG] [MODEL_DIR]
set -euo pipefail
TAG=${1:-localhost/cpuserve:latest}
MODEL=${2:-}
W=${CPUSERVE_PODMAN_DIR:-/var/tmp/cpuserve-podman}
export CONTAINERS_CONF=$W/containers.conf CONTAINERS_STORAGE_CONF=$W/storage.conf TMPDIR=$W/tmp
PORT=18043

wait_ready() {  # seconds until /health answers 200 (the container must still run)
    local start=$1
    for _ in $(seq 1 "${READY_TRIES:-240}"); do
        if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
            echo $(( $(date +%s%N) / 1000000 - start ))
            return 0
        fi
        podman container exists "$2" || { echo "[smoke] the container exited" >&2; return 1; }
        sleep 0.5
    done
    return 1
}

chat() {
    curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"messages":[{"role":"user","content":"What is the capital of France? Answer in one word."}],"temperature":0,"max_tokens":16}'
}

start=$(( $(date +%s%N) / 1000000 ))
CID=$(podman run -d --network host --name cpuserve-smoke "$TAG")
trap 'podman rm -f cpuserve-smoke >/dev/null 2>&1 || true' EXIT
ready_ms=$(wait_ready "$start" "$CID")
answer=$(chat)
echo "$answer" | grep -q '"content"' || { echo "[smoke] no answer: $answer" >&2; exit 1; }
podman healthcheck run "$CID" >/dev/null || { echo "[smoke] health check failed" >&2; exit 1; }
user=$(podman exec "$CID" id -u)
[ "$user" != 0 ] || { echo "[smoke] runs as root" >&2; exit 1; }
t=$(date +%s%N)
podman stop -t 30 "$CID" >/dev/null
code=$(podman inspect "$CID" --format '{{.State.ExitCode}}')
stop_ms=$(( ($(date +%s%N) - t) / 1000000 ))
[ "$code" = 0 ] || { echo "[smoke] exit code $code after SIGTERM" >&2; podman logs "$CID" | tail -5 >&2; exit 1; }
podman rm "$CID" >/dev/null
echo "[smoke] run -> first answer ready in ${ready_ms} ms; answer: $(echo "$answer" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')" >&2
echo "[smoke] SIGTERM -> exit 0 in ${stop_ms} ms; user id $user" >&2
if [ -n "$MODEL" ]; then
    name=$(basename "$MODEL")
    CID=$(podman run -d --network host --name cpuserve-smoke -v "$(dirname "$MODEL")":/models:ro "$TAG" \
        cpuserve serve "/models/$name" --host 0.0.0.0 --port $PORT --dtype bfloat16 --enforce-eager \
        --max-model-len 1024 --max-num-batched-tokens 1024 --max-num-seqs 1 --generation-config vllm \
        --distributed-executor-backend uni --disable-log-stats --language-model-only)
    ready_ms=$(READY_TRIES=1200 wait_ready "$(( $(date +%s%N) / 1000000 ))" "$CID") || { podman logs "$CID" 2>&1 | tail -5 >&2; exit 1; }
    chat | grep -q '"content"' || { echo "[smoke] the reference launch line gave no answer" >&2; exit 1; }
    podman stop -t 30 "$CID" >/dev/null
    echo "[smoke] the reference launch line (vllm serve -> cpuserve serve) served /models/$name; ready in ${ready_ms} ms" >&2
fi
