"""``parallelism.tp_overlap`` in the model: the three places mega/model.py calls.

* ``transformer_config_kwargs``: megatron TransformerConfig fields (``te``: ``tp_comm_overlap``...);
* ``layer_spec``: the layer spec with the backend's linears swapped in (by spec, no fork);
* ``before_model_build``: set-up that must precede the layers (``te``: TE userbuffers), once per
  process.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from mega.config import MegaConfig

_userbuffers: dict | None = None  # what initialize_ub was called with, once per process


def transformer_config_kwargs(cfg: MegaConfig) -> dict:
    if cfg.parallelism.tp_overlap == "te":
        from mega.overlap.te import TRANSFORMER_CONFIG

        return dict(TRANSFORMER_CONFIG)
    return {}


def layer_spec(cfg: MegaConfig, spec: ModuleSpec) -> ModuleSpec:
    mode = cfg.parallelism.tp_overlap
    if mode in ("ring", "symm_mem"):
        from mega.overlap.tp_layers import overlap_layer_spec

        return overlap_layer_spec(spec, mode)
    if mode == "te":
        from mega.overlap.te import te_layer_spec

        return te_layer_spec(spec)
    return spec


def before_model_build(cfg: MegaConfig, dtype) -> None:
    global _userbuffers
    if cfg.parallelism.tp_overlap == "te" and _userbuffers is None:
        from mega.overlap.te import initialize_userbuffers

        _userbuffers = initialize_userbuffers(cfg, dtype)
