"""The stack split across simulated hosts: the store, the prefill instance, the decode
instance and the proxy each in their own network, IPC and /dev/shm namespaces
(``lmcache_mooncake.testing.hosts``), configs with explicit addresses and
``mode: tcp``, as on several machines. Greedy tokens through the proxy equal a
single instance's, and the decode's chunks come from the store over the network."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml
from servers import Server, xfail_if_tcp_put_stalled

from lmcache_mooncake.obs.metrics_client import parse
from lmcache_mooncake.runtime.procs import free_port
from lmcache_mooncake.testing import hosts as simhosts
from lmcache_mooncake.testing.offline import vllm_env

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "lmcache_mooncake.cli"]
VLLM_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4096", "--enable-prompt-tokens-details"]
HOSTS = ["store", "prefill", "decode", "proxy"]
PORT = 8000  # every host has its own network: the same port on each


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    why = simhosts.unavailable()
    if why:
        pytest.skip(f"cannot create namespaces here: {why}")
    work = tmp_path_factory.mktemp("hosts")
    port = free_port()
    baseline = Server("baseline", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                   str(model), "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS],
                      vllm_env(work / "baseline"), port, work / "baseline.log")
    with simhosts.SimulatedHosts(HOSTS) as h:
        try:
            baseline.start()
            store_ip = h.address("store")
            r = h.run("store", [*CLI, "store", "up", "--host", store_ip, "--memory", "512MiB",
                                "--state-dir", str(work / "store")], timeout=90)
            assert r.returncode == 0, r.stdout + r.stderr
            st = json.loads((work / "store" / "store.json").read_text())
            urls = {}
            for role in ("prefill", "decode"):
                ip = h.address(role)
                cfg = work / f"{role}.yaml"
                cfg.write_text(yaml.safe_dump({
                    "run_dir": str(work / f"{role}-run"),
                    "load_wait_timeout": 10.0,
                    "mooncake": {"master_address": f"{store_ip}:{st['master_port']}",
                                 "metadata_server": f"http://{store_ip}:{st['metadata_port']}/metadata",
                                 "mode": "tcp", "local_hostname": ip, "timeout": 5.0},
                }))
                urls[role] = f"http://{ip}:{PORT}"
                cmd = [*CLI, "serve", "--role", role, "--model", str(model), "--host", ip, "--port", str(PORT),
                       "--config", str(cfg), *VLLM_ARGS]
                p = h.spawn(role, cmd, work / f"{role}.log", env=vllm_env(work / role, {
                    "LMCACHE_MOONCAKE_STALL_DUMP": str(work / "stalls")}))  # Mooncake's TCP stall
                urls[role + "_proc"] = p
            for role in ("prefill", "decode"):
                h.wait_http(role, f"{urls[role]}/health", urls[role + "_proc"], work / f"{role}.log")
            proxy_ip = h.address("proxy")
            proxy = h.spawn("proxy", [*CLI, "proxy", "--host", proxy_ip, "--port", str(PORT), "--prefill",
                                      urls["prefill"], "--decode", urls["decode"]], work / "proxy.log")
            urls["proxy"] = f"http://{proxy_ip}:{PORT}"
            h.wait_http("proxy", f"{urls['proxy']}/health", proxy, work / "proxy.log", timeout_s=60)
            baseline.wait_ready()
            yield h, urls, st, baseline, work
        finally:
            baseline.kill()
    assert not h.leftovers(), "namespaces left behind"


def complete(h, host: str, url: str, model: Path, prompt: list[int]) -> tuple[str, int]:
    status, body = h.http(host, "POST", f"{url}/v1/completions",
                          {"model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0.0})
    assert status == 200, body
    out = json.loads(body)
    return out["choices"][0]["text"], (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def store_hits(h, urls) -> int:
    """The decode instance's chunks read from the store, from its /metrics (read on the proxy host)."""
    status, body = h.http("proxy", "GET", f"{urls['decode']}/metrics", timeout=30)
    assert status == 200, body
    return parse(body).count("vllm:lmcm_chunk_hits", tier="store")


def test_hosts_share_nothing_but_the_addresses_given(stack):
    h, urls, st, _, _ = stack
    store_ip = h.address("store")
    assert h.can_connect("decode", store_ip, st["master_port"])
    # The store is not on the decode host's loopback, and the decode host has
    # its own /dev/shm (no shared-memory segment of the store's in it).
    assert not h.can_connect("decode", "127.0.0.1", st["master_port"])
    shm = h.run("decode", ["ls", "/dev/shm"]).stdout.split()
    assert not [f for f in shm if "mooncake" in f.lower()], shm


def test_tokens_through_the_proxy_across_hosts_equal_a_single_instance(stack, model):
    h, urls, _, baseline, work = stack
    base = openai.OpenAI(base_url=f"{baseline.url}/v1", api_key="none", max_retries=0, timeout=300)
    rng = random.Random(21)
    before = store_hits(h, urls)
    for n in (300, 777):
        prompt = [rng.randrange(16, 2000) for _ in range(n)]
        want = base.completions.create(model=str(model), prompt=prompt, max_tokens=12, temperature=0.0)
        got, cached = complete(h, "proxy", urls["proxy"], model, prompt)
        assert got == want.choices[0].text, n
        xfail_if_tcp_put_stalled(cached, work / "prefill.log")  # the decode computed, tokens right
        assert cached == n - 1, (n, cached)  # every chunk came over the network from the store
    time.sleep(1)  # vLLM publishes a step's counters just after the answer
    assert store_hits(h, urls) > before

    # The control: a prompt the prefill host never saw, sent straight to the
    # decode host, has nothing to load.
    prompt = [rng.randrange(16, 2000) for _ in range(400)]
    want = base.completions.create(model=str(model), prompt=prompt, max_tokens=12, temperature=0.0)
    got, cached = complete(h, "proxy", urls["decode"], model, prompt)
    assert got == want.choices[0].text and cached == 0
