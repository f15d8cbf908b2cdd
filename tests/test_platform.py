"""CPU or CUDA, decided in one place, and what ``up``, ``serve`` and offline runs build from the answer.

No GPU is lent to this project's machines: the CUDA cases fake the platform
module's answer (its detection function, or ``LMCACHE_MOONCAKE_PLATFORM``) and
assert the commands and environments built, which is all that differs before
vLLM starts. Nothing here starts vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_mooncake import platform
from lmcache_mooncake.cli import main
from lmcache_mooncake.commands.up import core_sets
from lmcache_mooncake.platform import Platform, PlatformError, assign_gpus, detect_platform

TWO_GPUS = Platform("cuda", ("0", "1"), "faked for the test")
CPU = Platform("cpu", detected_by="faked for the test")
PLATFORM_VARS = ("LMCACHE_MOONCAKE_PLATFORM", "CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "GLIBC_TUNABLES", "LMCACHE_MOONCAKE_MALLOC")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in PLATFORM_VARS:
        monkeypatch.delenv(name, raising=False)


def fake(monkeypatch, plat: Platform) -> None:
    monkeypatch.setattr(platform, "detect_platform", lambda environ=None: plat)


def up_plan(capsys, *flags: str) -> list[tuple[dict[str, str], list[str]]]:
    """(variables added, command) of each vLLM instance ``up --print-commands`` would start."""
    assert main(["up", "--model", "/models/m", "--print-commands", *flags]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln and not ln.startswith("#")]
    out = []
    for line in lines[:-1]:  # the last is the proxy
        words = shlex.split(line)
        cut = next(i for i, w in enumerate(words) if "=" not in w)
        out.append((dict(w.split("=", 1) for w in words[:cut]), words[cut:]))
    return out


def kv_role(cmd: list[str]) -> str:
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_role"]


# -- detection -----------------------------------------------------------------------------


def test_the_override_decides_before_anything_is_probed(monkeypatch):
    def no_probe() -> int:
        raise AssertionError("probed torch despite the override")

    monkeypatch.setattr(platform, "_torch_gpu_count", lambda: 0)  # a CPU torch: the GPUs are the ones listed
    assert detect_platform({"LMCACHE_MOONCAKE_PLATFORM": "cuda", "CUDA_VISIBLE_DEVICES": "2,3"}) == \
        Platform("cuda", ("2", "3"), "LMCACHE_MOONCAKE_PLATFORM=cuda")
    monkeypatch.setattr(platform, "_torch_gpu_count", no_probe)
    assert detect_platform({"LMCACHE_MOONCAKE_PLATFORM": " CPU "}).kind == "cpu"
    with pytest.raises(PlatformError, match="LMCACHE_MOONCAKE_PLATFORM='gpu': use cpu or cuda"):
        detect_platform({"LMCACHE_MOONCAKE_PLATFORM": "gpu"})


def test_this_host_runs_the_cpu_build(monkeypatch):
    # Not vLLM's answer (earlier tests of the suite may have imported vLLM): the installed build's.
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert detect_platform({}) == Platform("cpu", detected_by="vLLM's CPU build (vllm-cpu) is installed")


def test_a_cuda_build_with_gpus_is_cuda_with_the_visible_devices(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(platform, "_only_vllm_cpu_installed", lambda: False)
    monkeypatch.setattr(platform, "_torch_gpu_count", lambda: 2)
    assert detect_platform({}).devices == ("0", "1")
    # torch counts what CUDA_VISIBLE_DEVICES lets it see; the ids are its entries.
    assert detect_platform({"CUDA_VISIBLE_DEVICES": "5, 7"}) == Platform("cuda", ("5", "7"), "torch sees 2 CUDA devices")
    monkeypatch.setattr(platform, "_torch_gpu_count", lambda: 0)
    assert detect_platform({}).kind == "cpu"


def test_inside_vllm_its_current_platform_decides_and_its_flags_exist():
    """In a process that imported vLLM (0.32's CPU build here) its ``current_platform`` answers; and the
    flag and LLM arguments this module gives CUDA instances are ones this vLLM parses."""
    code = """
import json
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from lmcache_mooncake import platform
cuda = platform.Platform("cuda", ("0",))
flags = platform.instance_vllm_args(cuda, 4)
args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", *flags])
fields = set(EngineArgs.__dataclass_fields__)
kwargs = [*platform.engine_kwargs(cuda, 1), *platform.engine_kwargs(platform.Platform("cpu"), 1)]
print(json.dumps({"detected": platform.detect_platform({}).detected_by, "bytes": args.kv_cache_memory_bytes,
                  "eager": args.enforce_eager, "unknown": [k for k in kwargs if k not in fields]}))
"""
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_VARS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"detected": "vLLM's current_platform is cpu", "bytes": 4 << 30, "eager": False, "unknown": []}


# -- GPUs for `up --gpus` ---------------------------------------------------------------------


def test_gpus_default_to_one_per_instance_in_order():
    assert assign_gpus(TWO_GPUS, 2) == ["0", "1"]
    assert assign_gpus(Platform("cuda", ("0", "1", "2")), 2) == ["0", "1"]
    assert assign_gpus(TWO_GPUS, 2, "1,0") == ["1", "0"]
    assert assign_gpus(CPU, 2) == []


@pytest.mark.parametrize(("plat", "n", "gpus", "says"), [
    (TWO_GPUS, 3, None, "3 vLLM instances need one GPU each and 2 are visible"),
    (TWO_GPUS, 3, "0,1", "--gpus 0,1 names 2 GPU(s) for 3 vLLM instances"),
    (TWO_GPUS, 2, "0,0", "GPU 0 given twice"),
    (TWO_GPUS, 2, "0,4", "GPU 4 is not visible here (visible: 0,1)"),
    (TWO_GPUS, 2, "0,", "expected GPU ids separated by commas"),
    (CPU, 2, "0,1", "vLLM runs on the CPU here"),
])
def test_gpu_assignment_refusals_name_the_flag_and_counts(plat, n, gpus, says):
    with pytest.raises(PlatformError) as ei:
        assign_gpus(plat, n, gpus)
    assert says in str(ei.value) and "--gpus" in str(ei.value)


# -- what `up` starts ---------------------------------------------------------------------------


def test_up_on_two_gpus_starts_one_instance_per_gpu_with_cuda_graphs(monkeypatch, capsys):
    fake(monkeypatch, TWO_GPUS)
    plan = up_plan(capsys, "--kv-cache-gib", "4")
    assert [(kv_role(cmd), env["CUDA_VISIBLE_DEVICES"]) for env, cmd in plan] == [("kv_producer", "0"),
                                                                                   ("kv_consumer", "1")]
    for env, cmd in plan:
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(4 << 30)
        assert "--enforce-eager" not in cmd
        assert [k for k in env if k.startswith("VLLM_CPU_") or k == "GLIBC_TUNABLES"] == []
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in up_plan(capsys, "--gpus", "1,0")] == ["1", "0"]


def test_up_on_cuda_leaves_the_kv_cache_to_vllm_unless_asked(monkeypatch, capsys):
    fake(monkeypatch, TWO_GPUS)
    for flags in ([], ["--kv-cache-gib", "2", "--vllm-arg=--gpu-memory-utilization=0.5"]):
        for _, cmd in up_plan(capsys, *flags):
            assert "--kv-cache-memory-bytes" not in cmd


def test_up_refuses_three_instances_on_two_gpus(monkeypatch, capsys):
    fake(monkeypatch, TWO_GPUS)
    with pytest.raises(SystemExit) as ei:
        main(["up", "--model", "/models/m", "--decode", "2", "--print-commands"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--prefill 1 --decode 2: 3 vLLM instances need one GPU each and 2 are visible" in err
    assert "--gpus" in err


def test_up_decode_saves_makes_decode_instances_kv_both(monkeypatch, capsys):
    fake(monkeypatch, CPU)
    assert [kv_role(cmd) for _, cmd in up_plan(capsys, "--decode", "2")] == ["kv_producer", "kv_consumer",
                                                                            "kv_consumer"]
    assert [kv_role(cmd) for _, cmd in up_plan(capsys, "--decode", "2", "--decode-saves")] == [
        "kv_producer", "kv_both", "kv_both"]


def test_up_on_cpu_builds_the_commands_it_always_did(monkeypatch, capsys):
    fake(monkeypatch, CPU)
    cores = sorted(os.sched_getaffinity(0))
    plan = up_plan(capsys)
    assert len(plan) == 2
    for (env, cmd), mine in zip(plan, core_sets(2, cores), strict=True):
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        assert env.get("VLLM_CPU_OMP_THREADS_BIND") == (",".join(map(str, mine)) if len(cores) >= 2 else None)
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert cmd[-4:] == ["--shutdown-timeout", "60", "--enable-prompt-tokens-details", "--enforce-eager"]
    with pytest.raises(SystemExit):
        main(["up", "--model", "/models/m", "--gpus", "0,1", "--print-commands"])
    assert "vLLM runs on the CPU here" in capsys.readouterr().err


# -- serve and offline runs ---------------------------------------------------------------------


def test_serve_adds_only_the_platforms_variables(monkeypatch, capsys):
    from lmcache_mooncake.runtime import malloc_env as me

    monkeypatch.setattr(me, "vllm_bundles_tcmalloc", lambda: False)
    fake(monkeypatch, TWO_GPUS)
    assert main(["serve", "--role", "both", "--model", "m", "--print-command"]) == 0
    line = capsys.readouterr().out
    assert line.split()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "GLIBC_TUNABLES" not in line
    fake(monkeypatch, CPU)
    assert main(["serve", "--role", "both", "--model", "m", "--print-command"]) == 0
    assert capsys.readouterr().out.startswith("GLIBC_TUNABLES=")


def test_offline_runs_ask_the_platform(monkeypatch, tmp_path: Path):
    from lmcache_mooncake.testing import offline

    monkeypatch.setattr(offline, "detect_platform", lambda: TWO_GPUS)
    env = offline.vllm_env(tmp_path / "cuda", kv_cache_gib=3)
    assert [k for k in env if k.startswith("VLLM_CPU_") or k == "GLIBC_TUNABLES"] == []
    assert platform.engine_kwargs(TWO_GPUS, 3) == {"kv_cache_memory_bytes": 3 << 30}
    monkeypatch.setattr(offline, "detect_platform", lambda: CPU)
    env = offline.vllm_env(tmp_path / "cpu", kv_cache_gib=3)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert platform.engine_kwargs(CPU, 3) == {"enforce_eager": True}
