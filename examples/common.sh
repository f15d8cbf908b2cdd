# Helpers the example scripts source: the commands, a work folder, vLLM's CPU-build
# environment, waiting for a server, and stopping everything the script started on exit.
# Not an example by itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PY:-.venv/bin/python}
LMCM=${LMCM:-.venv/bin/lmcache-mooncake}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lmcm-example.XXXXXX")
PIDS=()

# vLLM's CPU build: offline, 1 GiB of KV cache, its caches in the work folder.
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
export VLLM_CACHE_ROOT="$WORK/vllm-cache" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"

# cpu_for N: a core for the N-th vLLM of this script, so that two vLLMs do not bind OpenMP to the
# same core (vLLM's CPU build binds each to one core by default).
cpu_for() { local n; n=$(nproc); echo $(( $1 % n )); }

free_port() { "$PY" -c 'from lmcache_mooncake.runtime.procs import free_port; print(free_port())'; }

# start NAME CMD...: run CMD in the background, its output in $WORK/NAME.log
start() {
  local name=$1; shift
  "$@" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  echo "started $name (pid $!, log $WORK/$name.log)"
}

# wait_ready NAME URL [PID]: until URL/health answers, or fail with the log's tail
# (PID: the process to watch, default the one started last)
wait_ready() {
  local name=$1 url=$2 pid=${3:-${PIDS[-1]}}
  for _ in $(seq 600); do
    curl -sf "$url/health" >/dev/null && { echo "$name ready at $url"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo "$name exited; log:" >&2; tail -30 "$WORK/$name.log" >&2; exit 1; }
    sleep 1
  done
  echo "$name not ready after 600 s; log:" >&2; tail -30 "$WORK/$name.log" >&2; exit 1
}

# complete URL PROMPT: a greedy completion; prints "prompt=N cached=N text=..."
complete() {
  local body answer
  body=$("$PY" -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2],
    "max_tokens": 8, "temperature": 0}))' "$MODEL" "$2")
  answer=$(curl -sf "$1/v1/completions" -H 'Content-Type: application/json' -d "$body")
  "$PY" -c 'import json, sys
r = json.loads(sys.argv[1]); u = r["usage"]; d = u.get("prompt_tokens_details") or {}
print("prompt=%d cached=%d text=%r" % (u["prompt_tokens"], d.get("cached_tokens") or 0, r["choices"][0]["text"]))' "$answer"
}

cleanup() {
  local rc=$? pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "${STORE_STARTED:-}" ] && "$LMCM" store down >/dev/null 2>&1 || true
  if [ "$rc" -eq 0 ]; then rm -rf "$WORK"; else echo "failed; logs kept in $WORK" >&2; fi
}
trap cleanup EXIT

MODEL=${MODEL:-$("$LMCM" make-model --arch llama --size tiny)}
# A prompt of about 450 tokens: two full chunks and a partial one.
PROMPT=${PROMPT:-$(for i in $(seq 60); do printf 'line %d of the shared system prompt. ' "$i"; done)}
