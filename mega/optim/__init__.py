"""The optimizer of a training run: megatron-core's wrapper chain around a torch optimizer.

``build_optimizer`` asks megatron for its usual chain (``ChainedOptimizer`` of
``DistributedOptimizer`` / ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``), which owns
grad clipping, the fp32 main params, DP sharding and checkpointing. For ``optimizer.name=lamb``
megatron-core 0.16.1 has no LAMB and no hook for a custom torch optimizer (Muon builds its
wrappers by hand and refuses the distributed optimizer; ``DistributedOptimizer.__init__`` asserts
Adam), so the chain is built for Adam and its inner torch optimizer is then swapped for our
``Lamb`` over the very same param groups. Lamb keeps Adam's state keys, so everything around it
(scheduler, clipping, ``sharded_state_dict`` in ``fully_reshardable`` format) is unchanged.
"""

from __future__ import annotations

import torch

from mega.cluster.backend_flags import backend_flags
from mega.config import MegaConfig
from mega.optim.lamb import Lamb

__all__ = ["Lamb", "build_optimizer", "install_lamb", "optimizer_config"]


def optimizer_config(cfg: MegaConfig):
    """megatron's ``OptimizerConfig`` of ``cfg.optimizer`` (lamb: the Adam chain, see the module doc)."""
    from megatron.core.optimizer import OptimizerConfig

    o, p = cfg.optimizer, cfg.parallelism
    flags = backend_flags(cfg)
    return OptimizerConfig(
        # lamb: megatron builds the Adam chain, whose inner optimizer we replace below.
        optimizer="adam" if o.name == "lamb" else o.name,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=flags.precision == "bf16",
        fp16=flags.precision == "fp16",
        params_dtype=flags.torch_dtype(flags.params_dtype),
        use_distributed_optimizer=p.use_distributed_optimizer,
        # chunk 0's param all-gather dispatched at the end of the step (interleaved only; pp_dp.py)
        overlap_param_gather_with_optimizer_step=p.overlap_param_gather_with_optimizer_step,
    )


def build_optimizer(cfg: MegaConfig, model_chunks: list):
    """megatron's optimizer for DDP-wrapped ``model_chunks`` (-> ``MegatronOptimizer``)."""
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        optimizer_config(cfg),
        model_chunks,
        # explicit, on every backend: the distributed optimizer gathers its fully_reshardable
        # checkpoint over the gloo data-parallel group (mega.cluster.backend_flags)
        use_gloo_process_groups=backend_flags(cfg).optimizer_gloo_process_groups,
    )
    if cfg.optimizer.name == "lamb":
        install_lamb(optimizer, max_trust_ratio=cfg.optimizer.lamb_max_trust_ratio)
    return optimizer


def install_lamb(optimizer, max_trust_ratio: float) -> None:
    """Replace the inner torch Adam of every megatron optimizer in ``optimizer`` by ``Lamb``."""
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = wrapper.optimizer
        if inner is None:  # a stub: this rank has no trainable params
            continue
        if len(inner.state):
            raise RuntimeError("install_lamb must run before the first optimizer step")
        model_groups, universe, group = _whole_tensors(wrapper)
        index = {param: i for i, param in enumerate(universe)}
        groups = []
        for g in inner.param_groups:
            # Keep megatron's keys (wd_mult, lr_mult, max_lr, ... identify groups in checkpoints),
            # drop torch-Adam-only switches (amsgrad, foreach, fused, ...).
            group_dict = {k: v for k, v in g.items() if k not in inner.defaults or k in _LAMB_KEYS}
            # megatron's no-weight-decay groups (wd_mult 0: every 1-D param, i.e. norm weights,
            # and every ``*.bias``) are LAMB's exclusions: no weight decay, trust ratio 1.
            group_dict["lamb_exclude"] = g.get("wd_mult", 1.0) == 0.0
            groups.append(group_dict)
        beta1, beta2 = inner.defaults["betas"]
        wrapper.optimizer = Lamb(
            groups,
            lr=inner.defaults["lr"],
            betas=(beta1, beta2),
            eps=inner.defaults["eps"],
            weight_decay=inner.defaults["weight_decay"],
            max_trust_ratio=max_trust_ratio,
            tensor_ids=[[index[m] for m in ms] for ms in model_groups],
            counted=[[_counts_on_this_tp_rank(m) for m in ms] for ms in model_groups],
            num_tensors=len(universe),
            norm_group=group,
            device=universe[0].device if universe else None,
        )


_LAMB_KEYS = ("lr", "betas", "eps", "weight_decay")


def _whole_tensors(wrapper) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], object]:
    """For each inner param group, the model tensors its params are pieces of (same order); the
    universe of tensors, numbered the same way on every rank that holds pieces of them; and the
    process group over which those pieces are spread (None: each rank holds whole tensors).

    DistributedOptimizer: group i holds ``[*fp32 shards, *fp32 copies of 16-bit shards]``
    (``_build_model_and_main_param_groups``), i.e. pieces of ``model_fp32_groups[i] +
    model_float16_groups[i]``; the pieces are spread over DP, the tensors over TP, so the norms
    are summed over the tensor-and-data-parallel group. The universe is every param of the
    grad buffers (each DP rank holds pieces of only some), in buffer order. Otherwise the inner
    params are whole (fp32 copies of) TP partitions, numbered in group order: summed over TP only.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import DistributedOptimizer

    inner = wrapper.optimizer
    tp = ps.get_tensor_model_parallel_world_size()
    if isinstance(wrapper, DistributedOptimizer):
        model_groups = [
            fp32 + f16 for fp32, f16 in zip(wrapper.model_fp32_groups, wrapper.model_float16_groups)
        ]
        assert [len(m) for m in model_groups] == [len(g["params"]) for g in inner.param_groups]
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        dp = wrapper.data_parallel_group.size()
        if group.size() != tp * dp:
            # e.g. expert-parallel params or several distributed-optimizer instances: their
            # shards are spread over another group; not needed yet.
            raise NotImplementedError(
                f"lamb: the distributed optimizer shards over {dp} ranks, but the TPxDP group "
                f"has {group.size()} (tp={tp})"
            )
        universe = [param for buffer in wrapper.buffers for param in buffer.params]
        return model_groups, universe, group
    model_groups = [list(g["params"]) for g in inner.param_groups]
    universe = [param for ms in model_groups for param in ms]
    return model_groups, universe, ps.get_tensor_model_parallel_group() if tp > 1 else None


def _counts_on_this_tp_rank(param: torch.Tensor) -> bool:
    """A TP-partitioned tensor adds its part on every TP rank; a replicated one (norm weights,
    row-parallel biases) is counted on TP rank 0 only, as megatron does for the grad norm."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    return param_is_not_tensor_parallel_duplicate(param, ps.get_tensor_model_parallel_group())
