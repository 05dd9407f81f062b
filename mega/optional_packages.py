"""The optional GPU packages megatron-core can use, said once per run instead of six times per rank.

megatron-core imports Transformer Engine and Apex where they exist and otherwise warns, at import,
in every process: four ``UserWarning: Transformer Engine and Apex are not installed ...`` and two
``Apex is not installed. Falling back to Torch Norm`` per rank, 48 blocks in an 8-rank job's log.
``notice(device)`` says once which of these packages are absent and what that costs (the flow's
train task logs it); ``quiet_megatron()`` filters exactly those warnings, and the
few other messages megatron-core repeats on every rank or save that say nothing actionable here,
each matched by its message and the module that issues it. Nothing here imports a GPU package:
presence is looked up with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

# module name -> what megatron-core / mega use it for when it is installed
OPTIONAL_GPU_PACKAGES = {
    "transformer_engine": "Transformer Engine (fused LayerNorm and linear layers, FP8)",
    "apex": "Apex (fused LayerNorm, fused Adam, multi-tensor kernels)",
    "flash_attn": "flash-attn (fused causal and sliding-window attention)",
}

# (message regex, category, module regex) of the warnings quiet_megatron() filters
_ABSENT_PACKAGE_WARNINGS = [
    # megatron.core.optimizer, .optimizer.optimizer, .optimizer.clip_grads, megatron_fsdp's mixed precision
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\.core\."),
    # megatron.core.models.backends and .models.gpt.gpt_layer_specs
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.core\."),
]
_CHATTER = [
    # megatron-core calls torch's old collective names; nothing a user can change
    (
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.",
    ),
    # megatron's zero_grad touches .grad of the distributed optimizer's fp32 shard views (None, harmless)
    (
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        r"megatron\.core\.optimizer\.optimizer",
    ),
]
_CPU_ONLY = [
    # advice about CUDA streams: meaningless without a GPU (on GPUs it stays)
    (
        r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment "
        r"variable CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
        r"megatron\.core\.tensor_parallel\.layers",
    ),
]
# megatron's dist_checkpointing logs this at every save whose directory is not empty; mega's
# checkpointer creates each save's staging directory (with its rng/ subdirectory) before calling
# it and clears debris of unfinished saves itself (mega/checkpoint/save.py)
_CHECKPOINT_LOGGER = "megatron.core.dist_checkpointing.serialization"
_CHECKPOINT_OVERWRITE = "Overwriting old incomplete / corrupted checkpoint"


def missing() -> list[str]:
    """The optional GPU packages that are not installed (looked up, not imported)."""
    return [name for name in OPTIONAL_GPU_PACKAGES if not _installed(name)]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def notice(device: str) -> str | None:
    """One sentence on the absent optional GPU packages and what that means on ``device``
    ("cpu" | "cuda"); None when all are installed."""
    absent = missing()
    if not absent:
        return None
    names = ", ".join(OPTIONAL_GPU_PACKAGES[name].split(" (")[0] for name in absent)
    if device == "cpu":
        return (
            f"optional GPU packages not installed: {names}. Nothing is lost on this CPU run (they are "
            "CUDA kernels); on a GPU, megatron-core would fall back to torch's LayerNorm, optimizers and "
            "attention: the same math, slower."
        )
    return (
        f"optional GPU packages not installed: {names}. megatron-core falls back to torch's LayerNorm, "
        "optimizers and multi-tensor kernels, and attention to its unfused kernel: the same math, slower "
        "(see docs/model.md, 'Fused operators')."
    )


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_megatron(cuda: bool = True) -> None:
    """Filter, in this process, megatron-core's warnings about the absent optional packages (the
    train task's one ``notice`` replaces them), the messages in ``_CHATTER``, the CUDA-streams advice
    when ``cuda`` is false, and dist_checkpointing's "Overwriting old incomplete / corrupted
    checkpoint" at every save. Call it before megatron-core is imported; calling it again adds
    nothing."""
    rules = [*_ABSENT_PACKAGE_WARNINGS, *_CHATTER, *([] if cuda else _CPU_ONLY)]
    for message, category, module in rules:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    logger = logging.getLogger(_CHECKPOINT_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(_CHECKPOINT_OVERWRITE))
