"""The training rank: ``torchrun ... -m mega.train --config run/config.json --data-index index.json``.

Reads like a recipe: set up the process groups, build the model, optimizer and schedule, restore
``latest`` if there is one, then for each step run the pipeline schedule over the step's
microbatches, step the optimizer, log, and checkpoint every ``checkpoint.interval`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from mega import config as mega_config
from mega import faults, heldout, megatron_cpu, megatron_fixes, obs, optional_packages, rank_env
from mega.cluster.backend_flags import backend_flags, launch_env_problems
from mega.config import MegaConfig
from mega.goodput import marks as goodput_marks
from mega.goodput import samples as goodput_samples
from mega.overlap import pp_dp
from mega.stability import exit_signal, rollback

# megatron-core warns about every optional GPU package it lacks, in every rank (and every helper
# process the checkpoint writer spawns, which re-imports this module); the train task says it once.
# The CPU-only filter waits for the config's device (main): probing the device here started the
# CUDA driver on an H200 node (torch.cuda.is_available(), with PYTORCH_NVML_BASED_CUDA_CHECK=1
# too), and a warm zygote importing this module could then not fork ranks that use CUDA.
optional_packages.quiet_megatron(cuda=True)

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
    """Process group (over store.kind), megatron's model-parallel groups (built the
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
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_size,
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
        "store": cfg.store.kind,
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
    once, so it reflects the cores they share), averaged over ranks; a relaunch of the same size
    reuses its previous attempt's measurement (0.3 s of GEMMs less on the recovery path)."""
    from mega import flops

    flags = backend_flags(cfg)
    if flags.peak_flops == "datasheet":
        peak = flops.peak_flops(torch.cuda.get_device_name(), flags.precision)
        return float(peak or "nan")
    if (known := rank_env.peak_flops(dist.get_world_size())) is not None:
        return known
    local = torch.tensor([flops.measure_cpu_gemm_flops()], dtype=torch.float64)
    dist.all_reduce(local)
    return local.item() / dist.get_world_size()


@dataclass
class RankRun:
    """What the step loop of one attempt works with, besides the trainer."""

    cfg: MegaConfig
    trainer: Trainer
    marks: goodput_marks.RankMarks
    warned: exit_signal.ExitSignal | None  # Slurm's warning before the time limit, when listening
    held_out: object  # the held-out batches (None with train.eval_batches=0)
    memory: object  # in-memory copies on a peer node (None when off)
    checkpointer: object
    logger: object
    session: object  # span recorder, clock offsets, GC control
    beat: object  # heartbeat to the driver's watcher (None when off)
    skips: set[int]  # 1-based steps whose batch is never trained on
    losses: rollback.LossWindow
    verdicts: object  # the gloo group the per-step verdicts reduce over
    me: dict  # this rank's node identity (the fault hooks' records)
    start_step: int = 0
    attempt: int = 0
    peak: float = float("nan")
    flops_per_step: float = 0.0
    tokens_per_step: int = 0


def prepare_process(cfg: MegaConfig) -> tuple[dict, dict]:
    """Before any group exists: the GPU launch environment checked, megatron-core patched, the
    thread count set. Returns the launch variables as launched and the patches applied."""
    from mega.cluster import node

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
    return launch_env, patched


def build_and_restore(cfg: MegaConfig, data_index: str, marks, launch_env: dict, patched: dict):
    """Build the trainer, record what this rank runs with, and restore ``latest`` (or the newest
    in-memory copy). Returns (trainer, held-out batches, in-memory copies, start step, peak FLOP/s,
    heartbeat). The heartbeat starts once the groups exist: a rank stopped in the set-up or the
    restore is then a silent rank amid beating peers to the driver's watcher, not a wait for the
    process group's timeout."""
    from mega import checkpoint
    from mega.cluster import node
    from mega.stability import heartbeat

    t_build = marks.now()
    trainer = build(cfg, data_index)
    trainer.init_times["megatron_patches"] = patched  # what this rank changed in megatron-core
    trainer.init_times.update(rank_facts(trainer, launch_env))
    marks.phase(
        "group_creation",
        t_build,
        t_build + trainer.init_times["pg_init_s"] + trainer.init_times["model_parallel_init_s"],
    )
    beat = heartbeat.start(cfg)  # to the driver's watcher: step, phase, group sequence numbers
    held_out = heldout.held_out_dataset(cfg, data_index)  # None with train.eval_batches=0
    node.record_process(Path(cfg.train.run_dir), rank_env.attempt())  # which pid ran where
    trainer.init_times["nodes"] = node.gather_table()
    trainer.init_times["comm_overlap"] = pp_dp.record(cfg.parallelism)  # PP/DP overlap on/left off
    peak = measure_peak_flops(cfg)
    trainer.init_times["peak_flops"] = peak  # the driver hands it to a relaunch of the same size
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
    return trainer, held_out, memory, start_step, peak, beat


def setup(cfg: MegaConfig, data_index: str, main_t: float | None, warned) -> RankRun:
    """Everything before the first step: the process, the trainer (restored), the logger, the
    checkpointer, observability, the heartbeat and the rollback rule."""
    from mega import checkpoint, flops
    from mega.cluster import node
    from mega.metrics import MetricsLogger
    from mega.obs.session import Session

    launch_env, patched = prepare_process(cfg)
    attempt = rank_env.attempt()
    # phase timestamps on the ledger's one clock (docs/goodput.md)
    marks = goodput_marks.RankMarks(
        cfg.train.run_dir, attempt, int(os.environ.get("RANK", "0")), main_t or time.time()
    )
    trainer, held_out, memory, start_step, peak, beat = build_and_restore(
        cfg, data_index, marks, launch_env, patched
    )
    run_dir = Path(cfg.train.run_dir)
    logger = MetricsLogger(run_dir, enabled=is_logging_rank(), tensorboard=cfg.train.tensorboard)
    if dist.get_rank() == 0:
        (run_dir / "init.json").write_text(json.dumps(trainer.init_times))
    logger.event(f"attempt {attempt}: starting at step {start_step} of {cfg.train.steps}")
    logger.event(pp_dp.log_line(cfg.parallelism))  # which PP/DP overlap this layout got
    chunks = [m.module for m in trainer.model]
    checkpointer = checkpoint.Checkpointer(
        cfg, chunks, trainer.optimizer, trainer.scheduler, mega_config.to_dict(cfg)
    )
    return RankRun(
        cfg,
        trainer,
        marks,
        warned,
        held_out,
        memory,
        checkpointer,
        logger,
        # span recorder + clock offsets + megatron instrumentation + controlled GC (docs/observability.md)
        session=Session.start(cfg),
        beat=beat,  # docs/stability.md
        skips=rollback.steps_to_skip(cfg),  # batches never trained on (docs/stability.md)
        losses=rollback.LossWindow.resumed(cfg, start_step),  # recent losses: the spike rule
        verdicts=rollback.verdict_group(cfg),  # a gloo group of the training thread's own
        me=node.identity(),
        start_step=start_step,
        attempt=attempt,
        peak=peak,
        flops_per_step=flops.model_flops_per_step(cfg),
        tokens_per_step=cfg.parallelism.global_batch_size * cfg.model.seq_length,
    )


def run_step(r: RankRun, step: int) -> None:
    """One step of the loop (0-based ``step``): the fault hooks, the step (or its skip), the
    rollback verdict, held-out evaluation when due, and the metrics row."""
    from mega import flops
    from mega.cluster import node

    cfg, marks, trainer = r.cfg, r.marks, r.trainer
    t_step = marks.now()
    faults.at_step_start(cfg, step, r.me, node.agent_pid)
    done = step + 1
    # the in-memory copy must have read the weights before a drill changes them outside the optimizer
    fence = r.memory.fence if r.memory is not None else None
    faults.poison_weights(cfg, [m.module for m in trainer.model], done, r.skips, r.me, before=fence)
    r.session.begin_step(step)
    t0 = time.perf_counter()
    result = rollback.skipped_step(trainer) if done in r.skips else train_step(trainer, step)
    step_s = time.perf_counter() - t0
    step_obs = r.session.end_step()  # compute time, exposed communication per kind
    data_s = obs.current().last_step.get("data_s")
    marks.step(done, t_step, marks.now(), done in r.skips, data_s, goodput_samples.consumed(cfg, step))
    if r.beat:
        r.beat.step_done(done, result, step_s, r.tokens_per_step)
    # NaN/Inf or spike: all agree
    bad = None if done in r.skips else rollback.check_step(result, r.losses, r.verdicts)
    if bad:  # nothing of this step is logged or saved: the driver relaunches from `latest`
        if r.memory is not None:
            r.memory.discard()  # the rollback goes back to `latest`, past the in-memory copies
        rollback.request_rollback(cfg, done, bad, r.checkpointer, r.start_step, r.skips)
    if heldout.due(cfg, done):
        # evaluation is not training: out of the step's timeline
        with obs.paused(), marks.span("validation"):
            result["val_loss"] = heldout.validation_loss(trainer, r.held_out, _forward_step)
    r.logger.log(
        {
            "step": done,
            **result,
            "step_s": step_s,
            "tokens_per_s": r.tokens_per_step / step_s,
            "mfu": flops.mfu(r.flops_per_step, step_s, dist.get_world_size(), r.peak),
            "attempt": r.attempt,
            "time": time.time(),  # wall clock at the step's end: steps/s including checkpoint stalls
            "node": node.node_rank(),  # the logging rank's node
            **step_obs,
        }
    )


def after_step(r: RankRun, done: int) -> bool:
    """The step's checkpoint work (the save in flight advanced, a save or in-memory copy when
    due), GC, and the scheduler's warning; True when the rank must stop (saved, warned)."""
    from mega import checkpoint

    cfg, marks = r.cfg, r.marks
    r.checkpointer.poll()  # advances the save in flight, if any (one small all-reduce)
    interval, saved = cfg.checkpoint.interval, None
    if interval and (done % interval == 0 or done == cfg.train.steps):
        with obs.span("checkpoint"), marks.span("checkpoint"):
            # a periodic save may be skipped while the previous one retries the store; the last never
            saved = r.checkpointer.save(done, skippable=done < cfg.train.steps)
        what = "skipped: " + saved["reason"] if saved.get("skipped") else "uploading in the background"
        r.logger.event(
            f"checkpoint {checkpoint.iteration_name(done)}: training blocked {saved['stall_s']:.3f}s "
            f"(waited {saved['wait_s']:.3f}s for the previous save); {what}"
        )
    if r.memory is not None and r.memory.due(done) and done < cfg.train.steps:
        with obs.span("memory checkpoint", "checkpoint"), marks.span("checkpoint", memory=True):
            r.memory.copy(done)  # the memcpy; checksum and replication to the peer in the background
    r.session.after_step(done)  # every train.gc_interval steps: GC on every rank at this boundary
    if r.warned is not None and done < cfg.train.steps and r.warned.agreed(r.verdicts):
        if saved is None or saved.get("skipped"):  # the scheduler's save is never skipped
            with obs.span("checkpoint"), marks.span("checkpoint"):
                r.checkpointer.save(done)
        r.logger.event(f"attempt {r.attempt}: signalled by the scheduler; saved step {done}, exiting")
        return True
    return False


def teardown(r: RankRun) -> None:
    """After the last step: the last save committed, the in-memory copies removed, the heartbeat,
    recorder and logger closed."""
    if r.warned is not None:
        r.warned.ignore()  # a signal after the last step: nothing left to save early
    # the heartbeat's phase while the last upload commits
    with obs.span("checkpoint"), r.marks.span("checkpoint"):
        r.checkpointer.close()  # the last save is committed before the job ends
        if r.memory is not None:
            r.memory.close()  # the last step is durable now: the copies are removed
    t_close = r.marks.now()
    if r.beat:
        r.beat.close()
    r.session.close()
    r.logger.close()
    r.marks.phase("close", t_close)


def run(cfg: MegaConfig, data_index: str, main_t: float | None = None) -> int:
    """The rank's recipe: set up, train step after step (each followed by its checkpoint work),
    tear down. Returns the exit status (exit_signal.EXIT_CODE when the scheduler's warning stopped it)."""
    # Slurm's warning before a time limit: save and exit (docs/cluster.md). Listening from the start:
    # a signal during start-up is acted on after the first step.
    warned = exit_signal.install()
    r = setup(cfg, data_index, main_t, warned)
    code = 0
    for step in range(r.start_step, cfg.train.steps):
        run_step(r, step)
        if after_step(r, step + 1):
            code = exit_signal.EXIT_CODE
            break
    teardown(r)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config JSON written by the launcher")
    parser.add_argument("--data-index", required=True, help="index.json of the prepared dataset")
    main_t = time.time()  # the imports are done
    args = parser.parse_args(argv)
    cfg = mega_config.load(args.config)
    optional_packages.quiet_megatron(cuda=cfg.cluster.device == "cuda")
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
