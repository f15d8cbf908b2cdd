#!/usr/bin/env bash
# One vLLM server that saves and loads (kv_role kv_both) with the connector's CPU and disk tiers.
#
#   bash examples/kv_both.sh            # MODEL=/path/to/model to use your own
#
# It starts `lmcache-mooncake serve --role both` (vLLM's OpenAI server with the connector) with
# vLLM's own prefix cache off, so that what the second identical request does not compute comes
# from the connector: its usage reports the prompt's tokens as cached, and the output is the same.
# The chunks are on disk too: a restarted server (or another one with the same local_disk) loads
# them from there (examples/offline_kv_both.py shows that).
source "$(dirname "$0")/common.sh"

PORT=$(free_port)
URL=http://127.0.0.1:$PORT
# Any configuration key can be overridden by LMCACHE_MOONCAKE_<KEY>: a disk folder for this run.
export LMCACHE_MOONCAKE_LOCAL_DISK="$WORK/disk" LMCACHE_MOONCAKE_RUN_DIR="$WORK/run"
SERVE=("$LMCM" serve --role both --model "$MODEL" --port "$PORT" --config configs/local.yaml
       --dtype float32 --max-model-len 2048 --enforce-eager --no-enable-prefix-caching
       --enable-prompt-tokens-details)

start vllm "${SERVE[@]}"
wait_ready vllm "$URL"
first=$(complete "$URL" "$PROMPT")
echo "first request:  $first"
again=$(complete "$URL" "$PROMPT")
echo "same again:     $again"

