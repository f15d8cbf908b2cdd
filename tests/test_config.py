"""Configuration files: valid ones load, each class of error names file and key."""

from pathlib import Path

import pytest

from lmcache_mooncake.config import CacheConfig, ConfigError, config_from_extra, load_config

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cache.yaml"
    p.write_text(text)
    return p


def test_shipped_configs_load():
    for name in ("both.yaml", "prefill.yaml", "decode.yaml", "local.yaml"):
        cfg = load_config(REPO / "configs" / name, environ={})
        assert isinstance(cfg, CacheConfig)
        assert cfg.chunk_size == 256


def test_values_are_read_and_converted(tmp_path):
    p = write(tmp_path, "chunk_size: 128\nmax_local_cpu_size: 1\nlocal_disk: /tmp/x\n")
    cfg = load_config(p, environ={})
    assert cfg.chunk_size == 128
    assert cfg.max_local_cpu_size == 1.0 and isinstance(cfg.max_local_cpu_size, float)
    assert cfg.disk_path == Path("/tmp/x")


def test_unknown_key_names_file_and_key(tmp_path):
    p = write(tmp_path, "chunk_sise: 256\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert str(p) in str(e.value) and "chunk_sise" in str(e.value)
    assert "chunk_size" in str(e.value)  # suggests the right key


def test_wrong_type_names_file_key_and_type(tmp_path):
    p = write(tmp_path, "max_local_cpu_size: lots\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    msg = str(e.value)
    assert str(p) in msg and "max_local_cpu_size" in msg and "number" in msg


def test_bool_is_not_a_size(tmp_path):
    p = write(tmp_path, "chunk_size: true\n")
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config(p, environ={})


@pytest.mark.parametrize(
    "text, key",
    [
        ("chunk_size: 0\n", "chunk_size"),
        ("chunk_size: 100\n", "chunk_size"),
        ("max_local_cpu_size: -1\n", "max_local_cpu_size"),
        ("local_disk: /tmp/d\nmax_local_disk_size: 0\n", "max_local_disk_size"),
        ("load_failure_policy: ignore\n", "load_failure_policy"),
    ],
)
def test_impossible_sizes_and_values(tmp_path, text, key):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert str(p) in str(e.value) and key in str(e.value)


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "chunk_size: [\n"), environ={})


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(missing, environ={})
    assert str(missing) in str(e.value)


def test_env_and_extra_config_override_single_keys(tmp_path):
    p = write(tmp_path, "chunk_size: 256\nlocal_disk: /tmp/a\n")
    cfg = load_config(p, environ={"LMCACHE_MOONCAKE_CHUNK_SIZE": "128"})
    assert cfg.chunk_size == 128
    with pytest.raises(ConfigError, match="LMCACHE_MOONCAKE_CHUNK_SIZE"):
        load_config(p, environ={"LMCACHE_MOONCAKE_CHUNK_SIZE": "big"})
    cfg = config_from_extra({"config_file": str(p), "local_disk": "/tmp/b"})
    assert cfg.disk_path == Path("/tmp/b")
    with pytest.raises(ConfigError, match="kv_connector_extra_config.*colour"):
        config_from_extra({"config_file": str(p), "colour": 1})


# -- the mooncake: section ---------------------------------------------------

def test_mooncake_section_loads_with_sizes_and_defaults(tmp_path):
    p = write(tmp_path, "mooncake:\n  master_address: 10.0.0.1:50051\n  local_buffer_size: 512MiB\n")
    mc = load_config(p, environ={}).mooncake
    assert mc.master_address == "10.0.0.1:50051"
    assert mc.local_buffer_size == 512 * 2**20
    assert mc.protocol == "tcp" and mc.global_segment_size == 0


def test_mooncake_absent_means_no_remote_tier(tmp_path):
    assert load_config(write(tmp_path, "chunk_size: 256\n"), environ={}).mooncake is None
    assert load_config(write(tmp_path, "mooncake: null\n"), environ={}).mooncake is None


def test_mooncake_misspelled_key_is_an_error_not_a_default(tmp_path):
    # LMCache 0.5.6 forwards master_server_address, which Mooncake ignores.
    p = write(tmp_path, "mooncake:\n  master_server_address: 127.0.0.1:50051\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    msg = str(e.value)
    assert str(p) in msg and "mooncake.master_server_address" in msg
    assert "mooncake.master_address" in msg


@pytest.mark.parametrize(
    "body, key",
    [
        ("  protocol: udp\n", "mooncake.protocol"),
        ("  protocol: rdma\n", "mooncake.rdma_devices"),
        ("  master_address: nohost\n", "mooncake.master_address"),
        ("  metadata_server: ftp://x\n", "mooncake.metadata_server"),
        ("  local_buffer_size: lots\n", "mooncake.local_buffer_size"),
        ("  local_buffer_size: 0\n", "mooncake.local_buffer_size"),
        ("  timeout: 0\n", "mooncake.timeout"),
        ("  replica_num: 0\n", "mooncake.replica_num"),
        ("  timeout: soon\n", "mooncake.timeout"),
        ("  pin: always\n", "mooncake.pin"),
        ("  pin: soft\n  pin_ttl: 0\n", "mooncake.pin_ttl"),
        ("  timeout: .nan\n", "mooncake.timeout"),
    ],
)
def test_mooncake_bad_values_name_the_key(tmp_path, body, key):
    p = write(tmp_path, "mooncake:\n" + body)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert str(p) in str(e.value) and key in str(e.value)


def test_mooncake_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="mooncake.*mapping"):
        load_config(write(tmp_path, "mooncake: yes-please\n"), environ={})


def test_extra_config_merges_into_the_mooncake_section(tmp_path):
    p = write(tmp_path, "mooncake:\n  master_address: 127.0.0.1:1\n  timeout: 3\n")
    cfg = config_from_extra({"config_file": str(p), "mooncake": {"timeout": 0.5}})
    assert cfg.mooncake.master_address == "127.0.0.1:1" and cfg.mooncake.timeout == 0.5


def test_chunk_auth_key_file_is_checked_at_load(tmp_path):
    from lmcache_mooncake.chunks.chunk_format import CHECKSUM_SEAL

    assert load_config(None, environ={}).seal() is CHECKSUM_SEAL
    missing = tmp_path / "no-such-secret"
    with pytest.raises(ConfigError, match="chunk_auth_key_file: cannot read .*no-such-secret.*openssl rand"):
        load_config(write(tmp_path, f"chunk_auth_key_file: {missing}\n"), environ={})
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        load_config(None, environ={"LMCACHE_MOONCAKE_CHUNK_AUTH_KEY_FILE": str(short)})
    good = tmp_path / "secret"
    good.write_text("0123456789abcdef0123456789abcdef\n")
    seal = load_config(None, environ={"LMCACHE_MOONCAKE_CHUNK_AUTH_KEY_FILE": str(good)}).seal()
    assert seal.is_mac and seal == load_config(write(tmp_path, f"chunk_auth_key_file: {good}\n"), environ={}).seal()


# -- fuzzing: any YAML is a valid config or a ConfigError naming the file ------

def _fuzz_strategies():
    from dataclasses import fields

    from hypothesis import strategies as st

    from lmcache_mooncake.config import MooncakeConfig

    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12), st.sampled_from(["256MiB", "4GiB", "1.5 gb", "auto", "tcp", "shm", "rdma",
                                               "127.0.0.1:50051", "http://h:1/metadata", "recompute", "-1"]),
    )
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
    mooncake_keys = st.sampled_from([f.name for f in fields(MooncakeConfig)] + ["master_adress", ""])
    mooncake = st.dictionaries(mooncake_keys, values, max_size=5)
    top_keys = st.sampled_from([f.name for f in fields(CacheConfig) if f.name != "chunk_auth_key_file"]
                               + ["chunk_sise", "mooncake ", "1"])
    doc = st.dictionaries(top_keys, values, max_size=6).flatmap(
        lambda d: st.one_of(st.just(d), mooncake.map(lambda m: {**d, "mooncake": m})))
    return st.one_of(doc, values)


def test_fuzzed_yaml_is_a_config_or_a_clean_error(tmp_path_factory):
    import yaml
    from hypothesis import HealthCheck, given, settings

    path = tmp_path_factory.mktemp("fuzz") / "cache.yaml"

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_fuzz_strategies())
    def check(doc):
        path.write_text(yaml.safe_dump(doc))
        try:
            cfg = load_config(path, environ={})
        except ConfigError as e:
            assert str(path) in str(e), str(e)
        else:
            import math
            from dataclasses import astuple

            assert isinstance(cfg, CacheConfig)
            numbers = [v for v in astuple(cfg) if isinstance(v, float)]
            numbers += [v for v in astuple(cfg.mooncake or CacheConfig()) if isinstance(v, float)]
            assert all(math.isfinite(v) for v in numbers), cfg

    check()


def test_fuzzed_text_is_a_config_or_a_clean_error(tmp_path_factory):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    path = tmp_path_factory.mktemp("fuzz") / "cache.yaml"
    pieces = st.sampled_from(["chunk_size:", " 256", "\n", "mooncake:", "  timeout: ", "- ", "{", "}", "[", ":",
                              "&a ", "*a", "!!python/object:os.system", "'", '"', "\t", "local_disk: ", "~"])

    @settings(max_examples=300, deadline=None)
    @given(st.one_of(st.lists(pieces, max_size=12).map("".join), st.text(max_size=40)))
    def check(text):
        path.write_text(text)
        try:
            load_config(path, environ={})
        except ConfigError as e:
            assert str(path) in str(e), str(e)

    check()
