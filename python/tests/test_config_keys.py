"""Every configuration key a driver is given reaches its workers' engines unchanged."""

import refit
from refit.engine import CONFIG_KEYS, engine_kwargs_from_config, split_engine_kwargs

# A value other than the default for every key a worker's engine uses.
NON_DEFAULT = {
    "device": "cpu",
    "backend_name": "UCX",
    "backend_init_params": {"tls": "tcp,self", "ucx_error_handling_mode": "none"},
    "release_after_refit": True,
    "shard_expert_weights": True,
    "timeout_s": 42.5,
    "verify_checksums": True,
    "map_source_buffers": False,
    "direct_reads": False,
    "delta": True,
}
SIZING = {"update_weights_bucket_memory_ratio", "bucket_bytes"}


def test_every_key_reaches_the_workers():
    # CONFIG_KEYS comes from the C++ configuration: the twelve keys of refit_cfg.nixl.
    assert len(CONFIG_KEYS) == 12
    assert set(NON_DEFAULT) == set(CONFIG_KEYS) - SIZING
    config = refit.as_config(NON_DEFAULT)
    kwargs = engine_kwargs_from_config(config)
    assert set(kwargs) == set(CONFIG_KEYS) - SIZING
    worker_config, options = split_engine_kwargs("nixl", kwargs)
    assert options == {}
    for key, value in NON_DEFAULT.items():
        got = getattr(worker_config, key)
        assert (dict(got) if key == "backend_init_params" else got) == value, key
    # Defaults differ from every value above, so the check could fail.
    defaults = refit.as_config(None)
    for key in NON_DEFAULT:
        if key not in ("device", "backend_name"):
            assert getattr(defaults, key) != getattr(worker_config, key), key


def test_the_configuration_table_is_the_parsers():
    rows = refit.config_keys()
    nixl = [row for row in rows if row["scope"] == "nixl"]
    assert [row["name"] for row in nixl] == list(CONFIG_KEYS)
    # Every key is an attribute of RefitConfig, and the table's default is what RefitConfig() writes.
    yaml = refit.RefitConfig().to_yaml()
    for row in nixl:
        assert hasattr(refit.RefitConfig(), row["name"]), row["name"]
        assert f"    {row['name']}: " in yaml, row["name"]
        written = yaml.split(f"    {row['name']}: ", 1)[1].splitlines()[0].strip('"')
        assert written == row["default"], row["name"]
    # The NIXL backend's own params come from the table, and every scope has rows.
    from refit.nixl import REFIT_PARAMS
    assert set(REFIT_PARAMS) == {"device", "backend", "read_source_memory"}
    assert {row["scope"] for row in rows} == {"nixl", "backend_init_params", "environment"}
    assert all(row["name"].startswith("REFIT_") for row in rows if row["scope"] == "environment")


def test_delta_takes_auto_and_keeps_it():
    config = refit.as_config({"delta": "auto"})
    assert config.delta == "auto"
    assert "delta: auto" in config.to_yaml()
    worker_config, _ = split_engine_kwargs("nixl", engine_kwargs_from_config(config))
    assert worker_config.delta == "auto"
    assert refit.as_config({"delta": False}).delta is False
    try:
        refit.as_config({"delta": "sometimes"})
    except refit.ConfigError as e:
        assert "true, false or auto" in str(e)
    else:
        raise AssertionError("delta: sometimes was accepted")
