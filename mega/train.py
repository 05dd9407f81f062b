"""The training rank: ``torchrun ... -m mega.train --config run/config.json --data-index index.json``.

Reads like a recipe: set up the process groups, build the model, optimizer and schedule, restore
``latest`` if there is one, then for each step run the pipeline schedule over the step's
microbatches, step the optimizer, log, and checkpoint every ``checkpoint.interval`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from mega import config as mega_config
from mega import megatron_cpu, megatron_fixes, obs, optional_packages, validation
from mega.cluster.backend_flags import backend_flags, launch_env_problems
from mega.config import MegaConfig
from mega.goodput import marks as goodput_marks
from mega.goodput import samples as goodput_samples
from mega.overlap import pp_dp
from mega.stability import exit_signal, rollback

# megatron-core warns about every optional GPU package it lacks, in every rank (and every helper
# process the checkpoint writer spawns, which re-imports this module); the train task says it once
optional_packages.quiet_megatron(cuda=torch.cuda.is_available())

# Variables that CUDA reads when it initialises: each rank's value, as launched, goes to init.json.
LAUNCH_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS",)


@dataclass
class Trainer:
    cfg: MegaConfig
    model: list  # DDP-wrapped chunks, one per virtual pipeline stage
    optimizer: object
    scheduler: object
    dataset: object
    device: torch.device
    init_times: dict


def setup_distributed(cfg: MegaConfig) -> dict:
    """Process group (over cluster.store), megatron's model-parallel groups (built the
    cluster.group_init way) and seeds; returns how long init took."""
    from megatron.core import tensor_parallel

    from mega.cluster import parallel_groups, rendezvous

    p = cfg.parallelism
    flags = backend_flags(cfg)
    t0 = time.perf_counter()
    if flags.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    recorder = rendezvous.init_process_group(cfg)
    t1 = time.perf_counter()
    parallel_groups.initialize_model_parallel(
        cfg.cluster.group_init,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if (p.vpp or 1) > 1 else None,
        # on every backend: the distributed optimizer's checkpoint gathers over the gloo DP group
        create_gloo_process_groups=flags.create_gloo_process_groups,
    )
    t2 = time.perf_counter()
    rendezvous.dump_store_traffic(cfg, recorder, f"train-attempt{os.environ.get('MEGA_ATTEMPT', '0')}")
    # megatron seeds the default generator through torch.cuda.manual_seed, a no-op without CUDA.
    torch.manual_seed(cfg.train.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    return {
        "pg_init_s": t1 - t0,
        "model_parallel_init_s": t2 - t1,
        "world_size": dist.get_world_size(),
        "store": cfg.cluster.store,
        "group_init": cfg.cluster.group_init,
    }


def build(cfg: MegaConfig, data_index: str) -> Trainer:
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from mega.data.loader import open_batches
    from mega.model import build_model_chunks, transformer_config
    from mega.optim import build_optimizer

    init_times = setup_distributed(cfg)
    p, o = cfg.parallelism, cfg.optimizer
    tcfg = transformer_config(cfg)
    chunks = build_model_chunks(cfg, tcfg)

    model = [
        DistributedDataParallel(
            config=tcfg, ddp_config=ddp_config(cfg), module=chunk, disable_bucketing=i > 0
        )
        for i, chunk in enumerate(chunks)
    ]
    # Hooks the pipeline schedules call: gradient reduction starts per chunk as soon as its last
    # microbatch's backward is done, overlapping with the rest of the pipeline.
    single = len(model) == 1
    tcfg.no_sync_func = model[0].no_sync if single else [m.no_sync for m in model]
    if p.overlap_grad_reduce:
        tcfg.grad_sync_func = model[0].start_grad_sync if single else [m.start_grad_sync for m in model]
    # The parameter all-gather: forward pre-hooks dispatch it, or with align_param_gather the
    # interleaved schedule does, per chunk (as Megatron-LM's training.py wires it; pp_dp.py).
    tcfg.param_sync_func = pp_dp.param_sync_funcs(cfg, model)
    tcfg.finalize_model_grads_func = finalize_model_grads

    optimizer = build_optimizer(cfg, model)
    tcfg.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=cfg.train.steps,
        lr_decay_style=o.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=cfg.train.steps,
        wd_incr_style="constant",
    )
    dataset = open_batches(cfg, data_index)  # data.loader: this rank's reads, or the node's loader process
    if dataset.vocab_size > cfg.model.vocab_size:
        raise mega_config.ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({dataset.vocab_size})",
        )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend_flags(cfg).device == "cuda"
        else torch.device("cpu")
    )
    return Trainer(cfg, model, optimizer, scheduler, dataset, device, init_times)


def ddp_config(cfg: MegaConfig):
    """megatron DDP's settings: overlapped, bucketed gradient reduction into the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig

    p, flags = cfg.parallelism, backend_flags(cfg)
    return DistributedDataParallelConfig(
        **pp_dp.ddp_config_kwargs(cfg),  # overlap_param_gather, align_param_gather
        grad_reduce_in_fp32=flags.grad_reduce_in_fp32,
        reduce_scatter_with_fp32_accumulation=flags.grad_reduce_scatter_all_to_all,
        overlap_grad_reduce=p.overlap_grad_reduce,
        use_distributed_optimizer=p.use_distributed_optimizer,
        bucket_size=p.ddp_bucket_size,
    )


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    loss = (output.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    # A copy: the schedule divides the returned loss in place by the number of microbatches.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def step_microbatches(trainer: Trainer, step: int) -> list[dict]:
    return trainer.dataset.step_microbatches(step, trainer.device)  # mega.data.loader


def train_step(trainer: Trainer, step: int) -> dict:
    """One optimizer step over the global batch; returns loss (DP-averaged, last stage), grad norm, lr."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = trainer.cfg
    pp_dp.prefetch_first_chunk(cfg, trainer.model)  # chunk 0's param all-gather, before the data
    with obs.span("data"):
        microbatches = step_microbatches(trainer, step)
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=[iter(microbatches) for _ in trainer.model]
        if len(trainer.model) > 1
        else iter(microbatches),
        model=trainer.model if len(trainer.model) > 1 else trainer.model[0],
        num_microbatches=cfg.parallelism.num_microbatches,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.parallelism.micro_batch_size,
        forward_only=False,
    )
    with obs.span("optimizer"):
        update_ok, grad_norm, _ = trainer.optimizer.step()
        if update_ok:
            trainer.scheduler.step(increment=1)
    loss = float("nan")
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        mean = torch.stack([x["lm loss"] for x in losses]).mean().reshape(1)
        dist.all_reduce(mean, group=ps.get_data_parallel_group())
        loss = mean.item() / ps.get_data_parallel_world_size()
    return {
        "loss": loss,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "skipped": not update_ok,
    }


def rank_facts(trainer: Trainer, launch_env: dict) -> dict:
    """Collective: what every rank ran with, for init.json -- the GPU-relevant launch variables
    as each rank found them, and the dtypes of the model's parameters and of the optimizer's main
    copies (under bf16: bf16 parameters, fp32 main parameters)."""
    params = sorted({str(p.dtype) for m in trainer.model for p in m.module.parameters()})
    main = sorted({str(p.dtype) for g in trainer.optimizer.param_groups for p in g["params"]})
    facts = [None] * dist.get_world_size()
    dist.all_gather_object(facts, (launch_env, params, main))
    return {
        "launch_env": {key: [env[key] for env, _, _ in facts] for key in launch_env},
        "param_dtypes": sorted({d for _, ps, _ in facts for d in ps}),
        "main_param_dtypes": sorted({d for _, _, ms in facts for d in ms}),
    }


def is_logging_rank() -> bool:
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )


def measure_peak_flops(cfg: MegaConfig) -> float:
    """Per-device peak for MFU: the datasheet on GPUs, a GEMM measured now on CPU (all ranks at
    once, so it reflects the cores they share), averaged over ranks."""
    from mega import flops

    flags = backend_flags(cfg)
    if flags.peak_flops == "datasheet":
        peak = flops.peak_flops(torch.cuda.get_device_name(), flags.precision)
        return float(peak or "nan")
    local = torch.tensor([flops.measure_cpu_gemm_flops()], dtype=torch.float64)
    dist.all_reduce(local)
    return local.item() / dist.get_world_size()


def maybe_inject_fault(cfg: MegaConfig, step: int) -> None:
    from mega.cluster import node

    f = cfg.fault
    attempt = int(os.environ.get("MEGA_ATTEMPT", "0"))
    struck = f.kill_rank == dist.get_rank() or (f.kill_node is not None and f.kill_node == node.node_rank())
    # kill_in_upload strikes in the checkpointer's stage 2 (mega/checkpoint/save.py), not here.
    if attempt == 0 and f.mode != "kill_in_upload" and struck and f.kill_at_step == step:
        print(
            f"[fault] {f.mode}: rank {dist.get_rank()} (node {node.node_rank()}) at step {step}",
            file=sys.stderr,
            flush=True,
        )
        if f.mode == "kill_agent":  # the node's agent dies; its ranks run on until someone stops them
            if node.local_rank() == 0:
                node.record_fault(cfg.train.run_dir, "kill_agent", step, node.agent_pid())
                os.kill(node.agent_pid(), signal.SIGKILL)
            return
        node.record_fault(cfg.train.run_dir, f.mode, step, os.getpid())
        if f.mode == "hang":
            while True:  # alive but silent, like a rank stuck in a driver call
                time.sleep(60)
        os.kill(os.getpid(), signal.SIGKILL)


def run(cfg: MegaConfig, data_index: str, main_t: float | None = None) -> int:
    from mega import checkpoint, flops
    from mega.cluster import node
    from mega.metrics import MetricsLogger
    from mega.obs.session import Session
    from mega.stability import heartbeat

    # Slurm's warning before a time limit: save and exit (docs/cluster.md). Listening from the start:
    # a signal during start-up is acted on after the first step.
    warned = exit_signal.install()
    flags = backend_flags(cfg)
    launch_env = {key: os.environ.get(key) for key in LAUNCH_ENV}  # as launched, before anything sets it
    missing = launch_env_problems(cfg, dict(os.environ))
    if missing:  # CUDA read the environment when it initialised: too late to set it from here
        raise RuntimeError(
            f"this GPU rank was launched without {', '.join(missing)} in its environment; "
            "launch it through mega.launch (cluster.env) or export it in the job script"
        )
    patched = {
        "megatron_fixes": list(megatron_fixes.apply()),  # on every device
        "megatron_cpu": list(megatron_cpu.apply()) if flags.megatron_cpu_patches else [],
    }
    if flags.limit_cpu_threads:
        # One rank per core at most: oversubscribed OpenMP threads make every step slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // node.ranks_on_host()))
    os.environ.update(cfg.cluster.env)

    # phase timestamps on the ledger's one clock (docs/goodput.md)
    marks = goodput_marks.RankMarks(
        cfg.train.run_dir,
        int(os.environ.get("MEGA_ATTEMPT", "0")),
        int(os.environ.get("RANK", "0")),
        main_t or time.time(),
    )
    t_build = marks.now()
    trainer = build(cfg, data_index)
    trainer.init_times["megatron_patches"] = patched  # what this rank changed in megatron-core
    trainer.init_times.update(rank_facts(trainer, launch_env))
    marks.phase(
        "group_creation",
        t_build,
        t_build + trainer.init_times["pg_init_s"] + trainer.init_times["model_parallel_init_s"],
    )
    held_out = validation.held_out_dataset(cfg, data_index)  # None with train.eval_batches=0
    run_dir = Path(cfg.train.run_dir)
    node.record_process(run_dir, int(os.environ.get("MEGA_ATTEMPT", "0")))  # which pid ran where
    trainer.init_times["nodes"] = node.gather_table()
    trainer.init_times["comm_overlap"] = pp_dp.record(cfg.parallelism)  # PP/DP overlap on/left off
    peak = measure_peak_flops(cfg)  # before the restore: its random matrices draw from the RNG
    start_step = 0
    chunks = [m.module for m in trainer.model]
    # in-memory copies on a peer node (checkpoint.memory_interval; None when off)
    memory = checkpoint.MemoryCheckpoints.create(cfg, chunks, trainer.optimizer, trainer.scheduler)
    if cfg.checkpoint.load:
        # the newest complete in-memory copy, else `latest` of the durable store, verified; one
        # store read per DP group, shared over DP.
        t_restore, info = marks.now(), {}
        try:
            start_step, info = checkpoint.restore(
                cfg, chunks, trainer.optimizer, trainer.scheduler, memory=memory
            )
        finally:  # the ledger says where the attempt resumed from: memory-own, memory-peer, durable
            marks.phase("restore", t_restore, source=checkpoint.restore_source(info))
        trainer.init_times["restore"] = info
    flops_per_step = flops.model_flops_per_step(cfg)
    tokens_per_step = cfg.parallelism.global_batch_size * cfg.model.seq_length
    attempt = int(os.environ.get("MEGA_ATTEMPT", "0"))

    logger = MetricsLogger(run_dir, enabled=is_logging_rank(), tensorboard=cfg.train.tensorboard)
    if dist.get_rank() == 0:
        (run_dir / "init.json").write_text(json.dumps(trainer.init_times))
    logger.event(f"attempt {attempt}: starting at step {start_step} of {cfg.train.steps}")
    logger.event(pp_dp.log_line(cfg.parallelism))  # which PP/DP overlap this layout got
    checkpointer = checkpoint.Checkpointer(
        cfg, chunks, trainer.optimizer, trainer.scheduler, mega_config.to_dict(cfg)
    )
    # span recorder + clock offsets + megatron instrumentation + controlled GC (docs/observability.md)
    session = Session.start(cfg)
    beat = heartbeat.start(
        cfg
    )  # to the driver's watcher: step, phase, group sequence numbers (docs/stability.md)
    skips = rollback.steps_to_skip(cfg)  # batches never trained on (docs/stability.md)
    losses = rollback.LossWindow(cfg)  # recent losses: the spike rule
    verdicts = rollback.verdict_group()  # a gloo group of the training thread's own
    code = 0
    for step in range(start_step, cfg.train.steps):
        t_step = marks.now()
        maybe_inject_fault(cfg, step)
        done = step + 1
        if memory is not None and done in (cfg.fault.nan_at_step, cfg.fault.spike_at_step):
            memory.fence()  # the drill changes weights outside the optimizer: after the copy read them
        rollback.maybe_poison(cfg, trainer, done, skips)
        session.begin_step(step)
        t0 = time.perf_counter()
        result = rollback.skipped_step(trainer) if done in skips else train_step(trainer, step)
        step_s = time.perf_counter() - t0
        step_obs = session.end_step()  # compute time, exposed communication per kind
        marks.step(
            done,
            t_step,
            marks.now(),
            done in skips,
            obs.current().last_step.get("data_s"),
            goodput_samples.consumed(cfg, step),
        )
        if beat:
            beat.step_done(done, result, step_s, tokens_per_step)
        bad = (
            None if done in skips else rollback.check_step(result, losses, verdicts)
        )  # NaN/Inf or spike: all agree
        if bad:  # nothing of this step is logged or saved: the driver relaunches from `latest`
            if memory is not None:
                memory.discard()  # the rollback goes back to `latest`, past the in-memory copies
            rollback.request_rollback(cfg, done, bad, checkpointer)
        if validation.due(cfg, done):
            with (
                obs.paused(),
                marks.span("validation"),
            ):  # evaluation is not training: out of the step's timeline
                result["val_loss"] = validation.validation_loss(trainer, held_out, _forward_step)
        logger.log(
            {
                "step": done,
                **result,
                "step_s": step_s,
                "tokens_per_s": tokens_per_step / step_s,
                "mfu": flops.mfu(flops_per_step, step_s, dist.get_world_size(), peak),
                "attempt": attempt,
                "time": time.time(),  # wall clock at the step's end: steps/s including checkpoint stalls
                "node": node.node_rank(),  # the logging rank's node
                **step_obs,
            }
        )
        checkpointer.poll()  # advances the save in flight, if any (one small all-reduce)
        interval = cfg.checkpoint.interval
        if interval and (done % interval == 0 or done == cfg.train.steps):
            with obs.span("checkpoint"), marks.span("checkpoint"):
                saved = checkpointer.save(done)
            logger.event(
                f"checkpoint {checkpoint.iteration_name(done)}: training blocked {saved['stall_s']:.3f}s "
                f"(waited {saved['wait_s']:.3f}s for the previous save); uploading in the background"
            )
        if memory is not None and memory.due(done) and done < cfg.train.steps:
            with obs.span("memory checkpoint", "checkpoint"), marks.span("checkpoint", memory=True):
                memory.copy(done)  # the memcpy; checksum and replication to the peer in the background
        session.after_step(done)  # every train.gc_interval steps: GC on every rank at this boundary
        if warned is not None and done < cfg.train.steps and warned.agreed(verdicts):
            if not (interval and done % interval == 0):
                with obs.span("checkpoint"), marks.span("checkpoint"):
                    checkpointer.save(done)
            logger.event(f"attempt {attempt}: signalled by the scheduler; saved step {done}, exiting")
            code = exit_signal.EXIT_CODE
            break
    if warned is not None:
        warned.ignore()  # a signal after the last step: nothing left to save early
    with (
        obs.span("checkpoint"),
        marks.span("checkpoint"),
    ):  # the heartbeat's phase while the last upload commits
        checkpointer.close()  # the last save is committed before the job ends
        if memory is not None:
            memory.close()  # the last step is durable now: the copies are removed
    t_close = marks.now()
    if beat:
        beat.close()
    session.close()
    logger.close()
    marks.phase("close", t_close)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON written by the launcher")
    parser.add_argument("--data-index", required=True, help="index.json of the prepared dataset")
    main_t = time.time()  # the imports are done
    args = parser.parse_args(argv)
    cfg = mega_config.load(args.config)
    try:
        code = run(cfg, args.data_index, main_t)
    finally:
        from megatron.core import parallel_state as ps

        if dist.is_initialized():
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    return code


if __name__ == "__main__":  # the checkpoint writer's spawned helpers re-import __main__
    sys.exit(main())
