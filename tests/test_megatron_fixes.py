"""The corrections of megatron-core (mega/megatron_fixes.py) still fit the installed release, are
still needed, and work through the code a GPU rank runs.

A GPU rank applies every correction and no CPU adaptation; a CPU rank adds exactly the CPU
adaptations (mega/megatron_cpu.py) that gloo and host memory need. The restore check below runs
mega's own build, save and restore on one gloo rank with those adaptations, once with the
corrections and once with the distributed-optimizer correction taken out again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mega import megatron_cpu, megatron_fixes


def test_megatron_core_version_is_the_verified_one():
    import megatron.core

    assert megatron.core.__version__ == megatron_fixes.MEGATRON_VERSION


@pytest.mark.parametrize("target", sorted(megatron_fixes.PATCHED_SOURCES))
def test_corrected_function_source_unchanged(target):
    assert megatron_fixes.source_fingerprint(target) == megatron_fixes.PATCHED_SOURCES[target], (
        f"{target} changed in megatron-core: re-verify its correction in mega/megatron_fixes.py"
    )


def test_the_two_lists_do_not_overlap():
    assert set(megatron_fixes.PATCHED_SOURCES).isdisjoint(megatron_cpu.PATCHED_SOURCES)
    assert megatron_cpu.ADAPTATIONS == (
        "cuda_runtime",
        "rng_tracker",
        "cuda_factories",
        "cuda_type_checks",
        "gloo_reduce_scatter",
    )
    assert megatron_fixes.FIXES == ("sequence_parallel_norm", "distopt_restore")


PROBE = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from mega import checkpoint, megatron_cpu, megatron_fixes
    from mega import config as mega_config
    from mega.train import build, train_step

    cfg = mega_config.load(sys.argv[1])
    report = {"cpu_adaptations": list(megatron_cpu.apply()), "fixes": list(megatron_fixes.apply())}
    trainer = build(cfg, sys.argv[2])

    def states():
        opt = trainer.optimizer.optimizer
        return [{k: v.clone() for k, v in opt.state[p].items()} | {"param": p.detach().clone()}
                for g in opt.param_groups for p in g["params"]]

    def restore():
        try:
            checkpoint.restore(cfg, [m.module for m in trainer.model], trainer.optimizer, trainer.scheduler,
                               log=lambda m: None)
        except KeyError as e:
            return f"KeyError: {e}"
        return None

    train_step(trainer, 0)
    saver = checkpoint.Checkpointer(cfg, [m.module for m in trainer.model], trainer.optimizer, trainer.scheduler,
                                    mega_config.to_dict(cfg), log=lambda m: None)
    saver.save(1)
    saver.close()
    saved = states()
    train_step(trainer, 1)  # the live state moves on; a restore must bring back the saved one
    report["corrected"] = restore()
    restored = states()
    report["equal"] = all(torch.equal(a[k], b[k]) for a, b in zip(saved, restored) for k in a)
    report["steps_shared"] = len({id(s["step"]) for s in trainer.optimizer.optimizer.state.values() if "step" in s}) \\
        < sum("step" in s for s in trainer.optimizer.optimizer.state.values())
    # megatron's own methods again: the restore fails as it would on a GPU without the correction
    DistributedOptimizer._set_main_param_and_optimizer_states = \\
        DistributedOptimizer._set_main_param_and_optimizer_states.__wrapped__
    DistributedOptimizer.load_state_dict = DistributedOptimizer.load_state_dict.__wrapped__
    report["uncorrected"] = restore()
    # the torch LayerNorm under sequence parallelism, without and with the correction
    sp = trainer.model[0].module.config
    sp.sequence_parallel = True
    try:
        WrappedTorchNorm.__new__.__wrapped__(WrappedTorchNorm, sp, 8)
        report["norm_uncorrected"] = None
    except AssertionError as e:
        report["norm_uncorrected"] = str(e)
    norm = WrappedTorchNorm(sp, 8)
    report["norm_corrected"] = all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    print("REPORT", json.dumps(report))
    """
)


@pytest.mark.parametrize("optimizer", ["lamb", "adam"])
def test_restore_needs_the_correction_and_works_with_it(
    optimizer, tmp_path, data_index, data_cache, free_port
):
    from mega.config import compose, save

    cfg = compose(
        [
            "model=tiny",
            "parallelism=single",
            f"optimizer={optimizer}",
            f"train.run_dir={tmp_path}",
            f"checkpoint.dir={tmp_path / 'checkpoints'}",
            f"data.cache_dir={data_cache}",
            "checkpoint.async_save=false",
            "train.tensorboard=false",
        ]
    )
    save(cfg, tmp_path / "config.json")
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    import os

    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "config.json"), str(data_index)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("REPORT"))[7:])
    # exactly the CPU adaptations gloo/CPU needs, and every correction a GPU rank applies
    assert report["cpu_adaptations"] == list(megatron_cpu.ADAPTATIONS)
    assert report["fixes"] == list(megatron_fixes.FIXES)
    assert report["corrected"] is None and report["equal"], report
    assert not report["steps_shared"]  # one step tensor per parameter after the restore
    assert report["uncorrected"] == "KeyError: 'step'", report  # megatron's own restore fails
    assert "sequence parallel not supported" in report["norm_uncorrected"]
    assert report["norm_corrected"]
