"""Run vLLM offline with the lmcache-mooncake connector, twice in one script.

    .venv/bin/python examples/offline_kv_both.py [MODEL_DIR]

Without MODEL_DIR a small generated model is built (no download). The first
LLM computes the prompt and stores its chunks on disk; after it is shut down,
a second LLM (empty CPU tier) loads them: its output reports cached tokens.
"""

import os
import sys
import tempfile

# vLLM's CPU build otherwise takes most of the host's memory for its KV cache (21 of 24 GiB here),
# and the worker is killed when LMCache then allocates its CPU tier. GiB, read when vLLM starts.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402 - after the environment it reads

from lmcache_mooncake.testing.models import ModelSpec, build_model


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(build_model(ModelSpec(arch="llama", size="tiny")))
    disk = tempfile.mkdtemp(prefix="lmcm-example-disk-")
    kv_transfer_config = {
        "kv_connector": "LMCacheMooncakeConnector",
        "kv_connector_module_path": "lmcache_mooncake.connector",
        "kv_role": "kv_both",
        # The YAML file's keys can be given here too; they override the file.
        "kv_connector_extra_config": {"config_file": "configs/local.yaml", "local_disk": disk},
    }
    prompt = {"prompt_token_ids": [(i * 7919) % 1900 + 16 for i in range(700)]}
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    for run in (1, 2):
        llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=2048,
                  kv_transfer_config=kv_transfer_config)
        out = llm.generate([prompt], greedy)[0]
        print(f"run {run}: {len(prompt['prompt_token_ids'])} prompt tokens, "
              f"{out.num_cached_tokens} cached, output {list(out.outputs[0].token_ids)}")
        llm.llm_engine.engine_core.shutdown()
        del llm


if __name__ == "__main__":  # vLLM and LMCache start worker processes with "spawn"
    main()
