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
    for name in ("both.yaml",):
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
