"""Warm the shared store from Python, then check what a second run would do.

    .venv/bin/python examples/warmup.py [MODEL_DIR]

Without MODEL_DIR a small generated model is built (no download). The script
starts its own embedded Mooncake Store in a temporary folder (stopped at the
end), warms it with examples/warmup_inputs.jsonl and the documents in
examples/warmup_docs/, prints the summary, and then runs a dry run: every
input is already in the store, so nothing would be written.

A decode instance started with configs/decode.yaml against the same store
(and the same --model string and --dtype) now serves these prompts from the
store. The token-id lines of the example file only make sense for the
generated models' 2048-token vocabulary.
"""

import shutil
import sys
import tempfile
from pathlib import Path

from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
from lmcache_mooncake.testing.models import ModelSpec, build_model
from lmcache_mooncake.warmup import warmup

HERE = Path(__file__).resolve().parent


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(build_model(ModelSpec(arch="llama", size="tiny")))
    store_dir = Path(tempfile.mkdtemp(prefix="lmcm-example-store-"))
    start_store(StoreSpec(memory_bytes=1 << 30, state_dir=store_dir))
    try:
        kwargs = dict(
            model=model,
            config=HERE.parent / "configs" / "prefill.yaml",
            inputs=[HERE / "warmup_inputs.jsonl", HERE / "warmup_docs"],
            # Keys override the YAML file, as in kv_connector_extra_config.
            overrides={"mooncake": {"store_dir": str(store_dir)}},
            dtype="float32",  # the --dtype of the serving instances: the KV dtype is part of the keys
        )
        summary = warmup(**kwargs)
        print(summary.format())
        for item in summary.inputs:
            print(f"  {item.where:<45} {item.kind:<17} {len(item.token_ids):>5} tokens  "
                  f"{len(item.names)} chunks  {item.status}")
        again = warmup(**kwargs, dry_run=True)
        print(again.format())
        assert again.inputs_to_write == 0 and again.chunks_to_write == 0
    finally:
        stop_store(store_dir)
        shutil.rmtree(store_dir, ignore_errors=True)


if __name__ == "__main__":  # vLLM and LMCache start worker processes with "spawn"
    main()
