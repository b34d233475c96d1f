"""Every configuration key a driver is given reaches its workers' engines unchanged."""

import os
import re

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
}
SIZING = {"update_weights_bucket_memory_ratio", "bucket_bytes"}


def test_every_key_reaches_the_workers():
    # CONFIG_KEYS comes from the C++ configuration: the eleven keys of refit_cfg.nixl.
    assert len(CONFIG_KEYS) == 11
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


def test_docs_config_table_lists_every_key_with_the_parsers_default():
    # docs/CONFIG.md's table: one row per key, its default column as the C++ configuration writes it.
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "CONFIG.md")
    rows = {}
    for line in open(docs, encoding="utf-8"):
        m = re.match(r"^\| `refit_cfg\.nixl\.([a-z_0-9]+)` \| [^|]+ \| `([^`]+)`", line)
        if m:
            rows[m.group(1)] = m.group(2)
    assert set(rows) == set(CONFIG_KEYS)
    yaml = refit.as_config(None).to_yaml()
    defaults = dict(re.findall(r"^\s{4}([a-z_0-9]+): (.+)$", yaml[yaml.index("nixl:"):], flags=re.M))
    for key in CONFIG_KEYS:
        assert rows[key] == defaults[key].strip('"'), key
