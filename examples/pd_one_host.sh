#!/usr/bin/env bash
# Prefill and decode on one host, step by step: the store, a prefill vLLM (kv_producer), a decode
# vLLM (kv_consumer) and the proxy, then a request through the proxy.
#
#   bash examples/pd_one_host.sh        # MODEL=/path/to/model to use your own
#
# The proxy sends each request to the prefill instance with max_tokens=1 (it computes the prompt
# and writes its chunks to the store), then to the decode instance, which loads them: its usage
# reports the prompt's tokens as cached. `lmcache-mooncake up` does all of this in one command.
source "$(dirname "$0")/common.sh"

# 1. The store: a master and a storage process that owns the memory. It is recorded in
#    $LMCACHE_MOONCAKE_STORE_DIR (default ~/.cache/lmcache-mooncake/store), where the configs'
#    `master_address: auto` finds it; here a folder of this run, so it collides with no other store.
export LMCACHE_MOONCAKE_STORE_DIR="$WORK/store"
"$LMCM" store up --memory 512MiB
STORE_STARTED=1

# 2. A prefill and a decode instance; both start at once (on 2 cores that takes about a minute).
#    `serve` checks the config file, then runs vLLM's OpenAI server with the connector in that role
#    (`--print-command` shows the command); options it does not know go to vLLM.
P_PORT=$(free_port); D_PORT=$(free_port); X_PORT=$(free_port)
VLLM_ARGS=(--model "$MODEL" --dtype float32 --max-model-len 2048 --enforce-eager)
#    Each gets its own run folder (lookup socket, counters) and, on this small host, its own core.
start prefill env LMCACHE_MOONCAKE_RUN_DIR="$WORK/prefill-run" VLLM_CPU_OMP_THREADS_BIND="$(cpu_for 0)" \
  "$LMCM" serve --role prefill --config configs/prefill.yaml --port "$P_PORT" "${VLLM_ARGS[@]}"
PREFILL_PID=${PIDS[-1]}
start decode env LMCACHE_MOONCAKE_RUN_DIR="$WORK/decode-run" VLLM_CPU_OMP_THREADS_BIND="$(cpu_for 1)" \
  "$LMCM" serve --role decode --config configs/decode.yaml --port "$D_PORT" "${VLLM_ARGS[@]}" \
  --enable-prompt-tokens-details
wait_ready prefill "http://127.0.0.1:$P_PORT" "$PREFILL_PID"
wait_ready decode "http://127.0.0.1:$D_PORT"

# 3. The proxy: clients use http://127.0.0.1:$X_PORT/v1 as an OpenAI endpoint (it binds 127.0.0.1;
#    --host 0.0.0.0 serves other hosts). With --model, --dtype and --config it names each prompt's
#    chunks as the workers do: prefix routing, and a prompt the store holds skips prefill.
#    Without --model it routes round-robin and always prefills.
start proxy "$LMCM" proxy --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT" --port "$X_PORT" \
  --model "$MODEL" --dtype float32 --config configs/decode.yaml
wait_ready proxy "http://127.0.0.1:$X_PORT"

# 4. A request through the proxy: the decode instance loads what the prefill instance stored.
answer=$(complete "http://127.0.0.1:$X_PORT" "$PROMPT")
echo "through the proxy: $answer"
"$LMCM" store status
