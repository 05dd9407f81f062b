"""Configs for planning: Hydra composition without launch checks first, the knobs a user fixed.

A plan is not a launch. ``cluster.nodes=1536`` with the default ``launcher=local`` is a launch
error (mega.config refuses it, rightly); the planner composes the same overrides unvalidated, and
when the overrides name no launcher it plans for the first multi-node launcher the cluster preset
pairs with (slurm for the GPU presets, local-nodes for local-cpu). Every candidate it evaluates is
then checked with ``mega.config.validate``, unchanged.

"Left open" = not named by the user: a knob is fixed when an override sets its key
(``parallelism.micro_batch_size=2``, also ``+key=``/``++key=``) or when a group option the user
selected sets it (``parallelism=paper-175b-256gpu`` fixes every key of that preset). Defaults that
came from config.yaml's default group options do not count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from mega.config import CONF_DIR, MegaConfig, compose

LAUNCHERS_FOR_PLANNING = ("slurm", "kubernetes", "local-nodes")


def _flatten(node: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for k, v in node.items():
        if k == "defaults":
            continue
        path = f"{prefix}{k}"
        keys.add(path)
        if isinstance(v, dict):
            keys |= _flatten(v, path + ".")
    return keys


def given_keys(overrides: list[str]) -> set[str]:
    """Dotted keys the overrides set: explicitly, or through a group option they select."""
    keys: set[str] = set()
    for raw in overrides:
        if "=" not in raw:
            continue
        key, value = raw.split("=", 1)
        key = key.lstrip("+~")
        path = CONF_DIR / key / f"{value}.yaml"
        if "." not in key and path.is_file():  # a group option: the keys its file sets
            text = path.read_text()
            node = OmegaConf.to_container(OmegaConf.create(text)) or {}
            glob = "@package _global_" in text
            keys |= _flatten(node, "" if glob else key + ".")
            keys.add(key)
        else:
            keys.add(key)
    return keys


@dataclass
class Planning:
    """A composed (unvalidated) config, the keys the user fixed, and what the planner set itself."""

    cfg: MegaConfig
    given: set[str]
    chosen: dict[str, object] = field(default_factory=dict)

    def is_open(self, key: str) -> bool:
        return key not in self.given


def for_planning(overrides: list[str]) -> Planning:
    """Compose ``overrides`` for planning: unvalidated, with a multi-node launcher when the user
    named none and the cluster has more than one node."""
    cfg = compose(list(overrides), validate_config=False)
    return prepare(cfg, given_keys(overrides))


def prepare(cfg: MegaConfig, given: set[str]) -> Planning:
    plan = Planning(cfg, given)
    c = cfg.cluster
    if (
        "launcher" not in given
        and "launcher.name" not in given
        and c.nodes > 1
        and cfg.launcher.name == "local"
    ):
        name = next((n for n in LAUNCHERS_FOR_PLANNING if n in c.launchers), None)
        if name is not None:
            plan.cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, name=name))
            plan.chosen["launcher"] = name
    return plan


class Composer:
    """Many compositions under one Hydra initialisation: the published-results fixtures compose
    dozens of configs. Hydra composes each distinct set of group options once (~0.3-0.6 s); the
    dotted ``key=value`` overrides of a row are merged into that typed config by OmegaConf, in
    order, as Hydra would apply them after the groups (~30 ms)."""

    def __enter__(self) -> Composer:
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from mega.config import register_schema

        register_schema()
        GlobalHydra.instance().clear()
        self._context = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
        self._context.__enter__()
        self._composed: dict[tuple[str, ...], object] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)

    def plan(self, overrides: list[str]) -> Planning:
        from hydra import compose as hydra_compose

        def is_group(o: str) -> bool:
            key = o.split("=", 1)[0]
            return "." not in key or key.startswith(("+", "~"))

        groups = tuple(o for o in overrides if is_group(o))
        dotted = [o for o in overrides if not is_group(o)]
        if groups not in self._composed:
            self._composed[groups] = hydra_compose(config_name="config", overrides=list(groups))
        merged = OmegaConf.merge(self._composed[groups], OmegaConf.from_dotlist(dotted))
        return prepare(OmegaConf.to_object(merged), given_keys(overrides))
