"""ServiceConfig: defaults sized from the machine, TOML, KVBANK_* and flags, in that order."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvbank.config import BankConfig, WritePolicy
from kvbank.errors import ConfigError
from kvbank.service.config import MIN_BUDGET, ServiceConfig, default_data_dir
from kvbank.wire.node import DEFAULT_BIND, DEFAULT_PORT


def test_service_config_embedded_default_sizes_budgets_and_uses_the_cache_dir(tmp_path: Path) -> None:
    cfg = ServiceConfig.load(env={"XDG_CACHE_HOME": str(tmp_path)})
    assert cfg.bind == DEFAULT_BIND == "127.0.0.1" and cfg.port == DEFAULT_PORT
    assert cfg.bank.data_dir == tmp_path / "kvbank"
    assert cfg.bank.host_bytes >= MIN_BUDGET and cfg.bank.disk_bytes >= MIN_BUDGET
    assert cfg.url == f"http://127.0.0.1:{DEFAULT_PORT}"


def test_service_config_precedence_toml_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('port = 9000\nthreads = 3\n[bank]\nhost_bytes = "32M"\ndisk_bytes = "1G"\n'
                 f'data_dir = "{tmp_path}"\nwrite_policy = "write-through"\n')
    env = {"KVBANK_PORT": "9100", "KVBANK_HOST_BYTES": "48M"}
    cfg = ServiceConfig.load(f, env=env, flags={"host_bytes": "80M", "threads": None})
    assert cfg.port == 9100  # env over TOML
    assert cfg.threads == 3  # TOML; a None flag is unset
    assert cfg.bank.host_bytes == 80 << 20  # flag over env over TOML
    assert cfg.bank.disk_bytes == 1 << 30 and cfg.bank.data_dir == tmp_path
    assert cfg.bank.write_policy is WritePolicy.WRITE_THROUGH


def test_service_config_print_form_reads_back_equal(tmp_path: Path) -> None:
    cfg = ServiceConfig.load(env={"XDG_CACHE_HOME": str(tmp_path)}, flags={"port": 0})
    text = cfg.to_toml()
    tomllib.loads(text)  # valid TOML
    f = tmp_path / "again.toml"
    f.write_text(text)
    assert ServiceConfig.load(f, env={}) == cfg


@pytest.mark.parametrize(
    ("toml", "field"),
    [("porty = 1\n", "porty"), ("[bank]\nhost_byte = 1\n", "bank.host_byte"),
     ("port = 70000\n", "port"), ("threads = 0\n", "threads"),
     ("body_timeout_s = -1\n", "body_timeout_s"), ("port = 'x'\n", "port"),
     ("header_timeout_s = 0\n", "header_timeout_s"), ("max_header_bytes = 100\n", "max_header_bytes"),
     ("max_json_bytes = '1K'\n", "max_json_bytes"),
     ("port = = 1\n", "config")],
)
def test_service_config_refuses_bad_settings_naming_the_field(tmp_path: Path, toml: str, field: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ServiceConfig.load(f, env={"XDG_CACHE_HOME": str(tmp_path)})


def test_service_config_bad_env_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVBANK_PORT"):
        ServiceConfig.load(env={"KVBANK_PORT": "eighty", "XDG_CACHE_HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="nonsense"):
        ServiceConfig.load(env={"XDG_CACHE_HOME": str(tmp_path)}, flags={"nonsense": 1})


def test_service_config_holds_a_bank_config() -> None:
    with pytest.raises(ConfigError, match="bank"):
        ServiceConfig(bank="not a config")  # type: ignore[arg-type]
    assert isinstance(ServiceConfig().bank, BankConfig)
    assert default_data_dir({}).name == "kvbank"


def test_service_config_refuses_a_misspelt_variable(tmp_path: Path) -> None:
    """W7: ``kvbank serve`` with ``KVBANK_HOST_BYTE=1G`` printed a config without it."""
    with pytest.raises(ConfigError, match="KVBANK_HOST_BYTE: not a setting; did you mean KVBANK_HOST_BYTES"):
        ServiceConfig.load(env={"KVBANK_HOST_BYTE": "1G", "XDG_CACHE_HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="did you mean KVBANK_DATA_PORT"):
        ServiceConfig.load(env={"KVBANK_DATA_PORTS": "0", "XDG_CACHE_HOME": str(tmp_path)})


@pytest.mark.parametrize(("flags", "field"), [({"redis": "http://x"}, "redis"),
                                              ({"redis": "127.0.0.1:6379"}, "redis"),
                                              ({"redis_cluster": "nohostport"}, "redis_cluster"),
                                              ({"redis_cluster": "a:1,b:x"}, "redis_cluster")])
def test_service_config_refuses_a_redis_that_is_no_redis(tmp_path: Path, flags: dict[str, str],
                                                         field: str) -> None:
    """W3: ``--redis http://x`` and ``--redis-cluster nohostport`` started a node whose
    fleet loop then failed forever, logging no reason. Refused at start now."""
    with pytest.raises(ConfigError, match=f"^{field}: expected") as e:
        ServiceConfig.load(env={"XDG_CACHE_HOME": str(tmp_path)}, flags=flags)
    assert e.value.field == field
