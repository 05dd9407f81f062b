"""Keys that moved into the section their name says: an old key fails before launch naming its new
place (override, conf/ file, dict, the CLI); a config.json saved with the old keys still loads."""

import dataclasses
import json
import shutil
import subprocess
import sys
import typing

import pytest

from mega import config as mega_config
from mega.config import (
    MOVED_KEYS,
    ConfigError,
    MegaConfig,
    SelfcheckConfig,
    check_moved,
    compose,
    from_dict,
    load,
    save,
    to_dict,
)


def _is_field(dotted: str) -> bool:
    *sections, name = dotted.split(".")
    cls = MegaConfig
    for section in sections:
        hints = typing.get_type_hints(cls)
        if section not in hints:
            return False
        cls = hints[section]
    return name in {f.name for f in dataclasses.fields(cls)}


def _section(data: dict, dotted: str) -> tuple[dict, str]:
    """The dict holding the key ``dotted`` of a saved config, and the key's name there."""
    *sections, name = dotted.split(".")
    for section in sections:
        data = data[section]
    return data, name


@pytest.mark.parametrize("old, new", sorted(MOVED_KEYS.items()))
def test_each_moved_key_names_a_field_of_the_schema_and_its_old_key_fails(old, new):
    assert _is_field(new) and not _is_field(old)
    for override in (f"{old}=1", f"+{old}=1", f"{old}=0,1"):
        with pytest.raises(ConfigError, match=f"moved to {new}") as err:
            check_moved([override])
        assert err.value.key == old


@pytest.mark.parametrize(
    "overrides, key, new",
    [
        (["cluster.spare_nodes=1"], "cluster.spare_nodes", "restart.spare_nodes"),
        (["model=tiny", "checkpoint.max_restarts=2"], "checkpoint.max_restarts", "restart.max_restarts"),
        (
            ["launcher=slurm", "launcher.slurm.spare_nodes=1"],
            "launcher.slurm.spare_nodes",
            "restart.spare_nodes",
        ),
    ],
)
def test_compose_with_an_old_override_names_the_new_key(overrides, key, new):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert err.value.key == key and str(err.value) == f"{key}: moved to {new}"


def test_a_dict_with_an_old_key_names_the_new_key():
    with pytest.raises(ConfigError) as err:
        from_dict({"cluster": {"nodes": 1, "store": "redis"}})
    assert (err.value.key, str(err.value)) == ("cluster.store", "cluster.store: moved to store.kind")
    with pytest.raises(ConfigError, match="moved to restart.backoff_s"):
        from_dict({"checkpoint": {"restart_backoff_s": 0.0}})


def test_a_conf_preset_with_an_old_key_names_the_new_key(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(mega_config.CONF_DIR, conf)
    (conf / "cluster" / "mine.yaml").write_text(
        (conf / "cluster" / "h100-8x.yaml").read_text() + "selfcheck_min_gemm_gflops: 2.0\n"
    )
    monkeypatch.setattr(mega_config, "CONF_DIR", conf)
    with pytest.raises(ConfigError) as err:
        compose(["cluster=mine"])
    assert err.value.key == "cluster.selfcheck_min_gemm_gflops"
    assert "moved to selfcheck.min_gemm_gflops" in str(err.value)


def test_cluster_presets_keep_their_selfcheck_floors():
    """local-cpu sets the CPU floors from its global package; a GPU preset keeps the defaults."""
    assert compose(["cluster=local-cpu"]).selfcheck == SelfcheckConfig(
        min_gemm_gflops=0.5, min_alltoall_mb_per_s=10.0, min_inter_node_mb_per_s=10.0
    )
    h100 = compose(["cluster=h100-8x", "parallelism=single", "cluster.procs_per_node=1"])
    assert h100.selfcheck == SelfcheckConfig() and h100.cluster.name == "h100-8x"


def test_a_config_saved_before_the_move_loads_with_its_values_in_their_new_places(tmp_path):
    cfg = from_dict(
        {
            "parallelism": {"dp": 2, "tp": 1, "pp": 1},
            "cluster": {"nodes": 2, "procs_per_node": 1},
            "launcher": {"name": "local-nodes"},
            "store": {"kind": "redis", "redis_url": "redis://10.0.0.5:6379/0", "record": True},
            "selfcheck": {"min_gemm_gflops": 3.0, "nic_fraction": 0.2},
            "restart": {"max_restarts": 7, "backoff_s": 0.0, "spare_nodes": 1, "min_nodes": 1},
            "stability": {"hang_timeout_s": 199},
        }
    )
    old = to_dict(cfg)  # the same config in the layout earlier versions saved
    for old_key, new_key in MOVED_KEYS.items():
        (old_section, old_name), (new_section, new_name) = _section(old, old_key), _section(old, new_key)
        if new_name in new_section:  # a key that moved twice (two old places, one new) is saved once
            old_section[old_name] = new_section.pop(new_name)
    for section in ("store", "selfcheck", "restart"):
        assert not old.pop(section)
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert load(tmp_path / "config.json") == cfg
    save(cfg, tmp_path / "new.json")  # and what is saved now has no old key
    saved = json.loads((tmp_path / "new.json").read_text())
    assert not [k for k in MOVED_KEYS if _section(saved, k)[1] in _section(saved, k)[0]]


def test_a_saved_slurm_spare_count_loads_as_the_one_spare_nodes_field(tmp_path):
    """The allocation's spares (launcher.slurm.spare_nodes) and the membership's are one field."""
    data = to_dict(from_dict({}))
    data["launcher"]["slurm"]["spare_nodes"] = 2
    del data["restart"]["spare_nodes"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert load(tmp_path / "config.json").restart.spare_nodes == 2
    with pytest.raises(ConfigError, match="launcher.slurm.spare_nodes: moved to restart.spare_nodes"):
        from_dict({"launcher": {"slurm": {"spare_nodes": 1}}})


def test_the_cli_refuses_an_old_override_with_exit_2_naming_the_new_key():
    proc = subprocess.run(
        [sys.executable, "-m", "flows.pretrain", "cluster.spare_nodes=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cluster.spare_nodes: moved to restart.spare_nodes" in proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["mega.plan", "-m", "model=tiny", "cluster.min_nodes=1,2"],  # a sweep, composed by Hydra
        ["flows.pretrain", "--config-dir", "{conf}", "cluster=mine"],  # a user's preset
        ["flows.pretrain", "--config-dir", "{conf}", "-m", "cluster=mine,local-cpu"],
    ],
)
def test_hydra_entry_points_name_the_new_key_of_an_old_one(tmp_path, argv):
    (tmp_path / "cluster").mkdir()
    preset = (mega_config.CONF_DIR / "cluster" / "h100-8x.yaml").read_text() + "min_nodes: 1\n"
    (tmp_path / "cluster" / "mine.yaml").write_text(preset)
    proc = subprocess.run(
        [sys.executable, "-m", *(a.format(conf=tmp_path) for a in argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("invalid config: cluster.min_nodes: moved to restart.min_nodes\n")
