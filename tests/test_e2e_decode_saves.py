"""``up --decode-saves``: a conversation's new turn, computed by decode, is in the store for the next.

One ``up`` (store, 1 prefill, 1 decode that saves, proxy sending a request
straight to decode while at most 512 of its prompt tokens are missing) on the
generated tiny model. Turn 1 (600 tokens) goes through prefill, which stores
its two full chunks; turn 2 (900 tokens, 388 missing) goes straight to decode,
which computes and saves chunk 3; turn 3 (1,200 tokens) then finds three
chunks (432 missing) and goes straight to decode too, with the tokens of a
recompute. The control, a third turn as long whose second turn was never sent,
finds two chunks (688 missing) and goes through prefill: without the decode's
save, turn 3 would have too.
"""

from __future__ import annotations

import random
import re
import uuid

import httpx
import pytest

from lmcache_mooncake.testing.up_stack import UpSpec, up_stack

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("decode-saves")
    spec = UpSpec(model=str(model), work=work, store_memory="256MiB", decode_saves=True,
                  vllm_args=["--dtype=float32", "--max-model-len=4096"],
                  proxy_args=["--direct-decode-max-uncached=512"])
    with up_stack(spec) as s:
        yield s


def complete(url: str, model, prompt: list[int], **extra) -> tuple[str, str]:
    """(text, the prefill instance the proxy used or "skipped")."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers.get("x-prefill-instance", "")


def test_the_turn_decode_computed_is_found_by_the_next(stack, model):
    rng = random.Random(5)
    turn1 = [rng.randrange(16, 2000) for _ in range(600)]
    turn2 = turn1 + [rng.randrange(16, 2000) for _ in range(300)]
    turn3 = turn2 + [rng.randrange(16, 2000) for _ in range(300)]
    other3 = turn1 + [rng.randrange(16, 2000) for _ in range(600)]  # its turn 2 never sent

    _, via1 = complete(stack.url, model, turn1)
    assert via1 not in ("", "skipped")  # new to the store: through prefill
    _, via2 = complete(stack.url, model, turn2)
    assert via2 == "skipped"
    # The reference (a salt shares nothing cached) also gives the decode's asynchronous writes time.
    want = complete(stack.url, model, turn3, cache_salt=f"ref-{uuid.uuid4().hex}")[0]
    got, via3 = complete(stack.url, model, turn3)
    _, via_other = complete(stack.url, model, other3)

    log = (stack.work / "proxy.log").read_text(errors="replace")
    routes = re.findall(r"direct \(prompt (\d+) tokens, (\d+) in the store\)", log)
    assert via3 == "skipped", f"turn 3 went through {via3}; routes {routes}"
    assert ("1200", "768") in routes, routes  # turn 2's third chunk: saved by decode
    assert got == want
    assert via_other not in ("", "skipped"), routes  # the control: two chunks only, through prefill
