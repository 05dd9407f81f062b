"""LAMB (mega/optim): the update is Algorithm 2 of You et al. 2020; sharded tensors get the trust
ratio of the whole tensor through one batched all-reduce; under megatron's distributed optimizer
DP=2 trains the same model as one process and resumes from a checkpoint onto the same curve."""

import copy
import json

import numpy as np
import pytest
import torch
from helpers import assert_same_curve, tiny_run

from mega.checkpoint import iteration_dir
from mega.config import ConfigError, compose
from mega.optim import lamb as lamb_module
from mega.optim.lamb import Lamb

LR, BETAS, EPS, WD, MAX_RATIO = 0.1, (0.9, 0.99), 1e-6, 0.05, 10.0
LAMB = ["optimizer=lamb"]


def _tensors(seed=0):
    """name -> (initial value, excluded?): weights of ordinary, huge (clamped ratio) and zero
    norm, plus a bias and a norm weight, which LAMB excludes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(5, 7, generator=g, dtype=torch.float64), False),
        "w_big": (30.0 * torch.randn(4, 3, generator=g, dtype=torch.float64), False),  # |w|/|r| > 10
        "w_zero": (torch.zeros(6, dtype=torch.float64).reshape(2, 3), False),  # ratio 1
        "bias": (0.1 * torch.randn(7, generator=g, dtype=torch.float64), True),
        "norm": (1.0 + 0.1 * torch.randn(7, generator=g, dtype=torch.float64), True),
    }


def _grads(tensors, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, (v, _) in tensors.items()}
        for _ in range(steps)
    ]


def _reference(tensors, grads):
    """Algorithm 2 in float64 numpy, written from the paper, independent of mega.optim."""
    w = {k: v.numpy().copy() for k, (v, _) in tensors.items()}
    m = {k: np.zeros_like(x) for k, x in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    b1, b2 = BETAS
    raw_ratios = {k: [] for k in w}  # |w|/|r| before the clamp, to see which cases were hit
    for t, step_grads in enumerate(grads, start=1):
        for k, (_, excluded) in tensors.items():
            g = step_grads[k].numpy()
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            r = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + EPS)
            if excluded:
                ratio = 1.0
            else:
                r = r + WD * w[k]
                wn, rn = np.linalg.norm(w[k]), np.linalg.norm(r)
                raw_ratios[k].append(wn / rn)
                ratio = min(wn / rn, MAX_RATIO) if wn > 0 and rn > 0 else 1.0
            w[k] = w[k] - LR * ratio * r
    return w, raw_ratios


def _groups(params: dict, tensors):
    """megatron-style grouping: decayed weights, and a marked no-decay group."""
    return [
        {"params": [p for k, p in params.items() if not tensors[k][1]], "lamb_exclude": False},
        {
            "params": [p for k, p in params.items() if tensors[k][1]],
            "weight_decay": 0.0,
            "lamb_exclude": True,
        },
    ]


def _lamb(groups, **kwargs):
    return Lamb(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_trust_ratio=MAX_RATIO, **kwargs)


def test_one_step_and_more_match_the_paper_in_float64():
    tensors, steps = _tensors(), 3
    grads = _grads(tensors, steps)
    params = {k: v.float().clone() for k, (v, _) in tensors.items()}
    opt = _lamb(_groups(params, tensors))
    for step_grads in grads:
        for k, p in params.items():
            p.grad = step_grads[k].float()
        opt.step()
    want, raw_ratios = _reference(tensors, grads)
    for k, p in params.items():
        np.testing.assert_allclose(p.double().numpy(), want[k], rtol=2e-6, atol=1e-7, err_msg=k)
    # The cases the tensors are there for really happened.
    assert min(raw_ratios["w_big"]) > MAX_RATIO  # clamped every step
    assert raw_ratios["w_zero"][0] == 0 and not np.allclose(want["w_zero"], 0)  # ratio 1, then grows
    assert 0 < max(raw_ratios["w"]) < MAX_RATIO
    state = opt.state[params["w"]]
    assert set(state) == {"exp_avg", "exp_avg_sq", "step"} and state["step"].item() == steps  # Adam's keys


def test_uneven_shards_over_two_ranks_equal_the_whole_tensor_update():
    """Like megatron's DP shards: the tensors concatenated into one flat buffer, cut at points
    that ignore tensor boundaries; rank 0 holds two separate pieces of one tensor, rank 1 holds
    some tensors whole and rank 0 none of them. A fake group reduce (the sum of both ranks'
    partial norms) must give each piece the update of its whole tensor."""
    tensors, steps = _tensors(), 3
    grads = _grads(tensors, steps)
    names = list(tensors)
    whole = {k: v.float().clone() for k, (v, _) in tensors.items()}
    reference = _lamb(_groups(whole, tensors))

    flat = torch.cat([v.float().reshape(-1) for v, _ in tensors.values()])
    starts = np.cumsum([0] + [v.numel() for v, _ in tensors.values()])
    # rank 0: w[0:3] and w[20:], w_big, w_zero[:2]; rank 1: w[3:20], w_zero[2:], bias, norm.
    cuts = {0: [(0, 3), (20, 49)], 1: [(3, 20), (49, len(flat))]}
    ranks = []
    for _rank, spans in cuts.items():
        pieces = []  # (name, lo, hi) in flat coordinates, split at tensor boundaries
        for lo, hi in spans:
            for i, k in enumerate(names):
                a, b = max(lo, starts[i]), min(hi, starts[i + 1])
                if a < b:
                    pieces.append((k, a, b))
        params = [flat[a:b].clone() for _, a, b in pieces]
        excluded = [tensors[k][1] for k, _, _ in pieces]
        groups = [
            {"params": [p for p, e in zip(params, excluded) if not e], "lamb_exclude": False},
            {"params": [p for p, e in zip(params, excluded) if e], "weight_decay": 0.0, "lamb_exclude": True},
        ]
        ids = [[names.index(k) for (k, _, _), e in zip(pieces, excluded) if e == x] for x in (False, True)]
        opt = _lamb(groups, tensor_ids=ids, num_tensors=len(names))
        ranks.append((opt, [(k, a, b, p) for (k, a, b), p in zip(pieces, params)]))
    assert sum(k == "w" for k, *_ in ranks[0][1]) == 2  # two pieces of one tensor on a rank
    assert not any(k == "norm" for k, *_ in ranks[0][1])  # and tensors it holds nothing of

    for step_grads in grads:
        flat_grad = torch.cat([step_grads[k].float().reshape(-1) for k in names])
        for k, p in whole.items():
            p.grad = step_grads[k].float()
        reference.step()
        for _, pieces in ranks:
            for _, a, b, p in pieces:
                p.grad = flat_grad[a:b].clone()
        partial = [opt.local_sq_norms() for opt, _ in ranks]
        total = partial[0] + partial[1]  # the all-reduce over the DP group
        for opt, _ in ranks:
            opt.apply_update(total)

    for _, pieces in ranks:
        for k, a, b, p in pieces:
            i = names.index(k)
            want = whole[k].reshape(-1)[a - starts[i] : b - starts[i]]
            torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-7, msg=f"{k}[{a}:{b}]")


def test_trust_ratio_reduction_is_one_batched_all_reduce_per_step(monkeypatch):
    calls = []
    monkeypatch.setattr(lamb_module.dist, "all_reduce", lambda t, group=None: calls.append((t.shape, group)))
    group = object()  # stands in for the TPxDP process group
    params = [torch.randn(3, 4) for _ in range(12)]
    opt = _lamb([{"params": params}], tensor_ids=[list(range(12))], num_tensors=20, norm_group=group)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert calls == [((2, 20), group)] * 3
    assert opt.num_reductions == 3


def test_state_dict_round_trip_continues_identically():
    tensors = _tensors()
    grads = _grads(tensors, 4)
    a = {k: v.float().clone() for k, (v, _) in tensors.items()}
    opt_a = _lamb(_groups(a, tensors))
    for step_grads in grads[:2]:
        for k, p in a.items():
            p.grad = step_grads[k].float()
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())  # as if through a file: no shared tensors
    for g in saved["param_groups"]:
        g.pop("lamb_exclude")  # e.g. a checkpoint written by Adam: the marks stay the live ones
    b = {k: p.detach().clone() for k, p in a.items()}
    opt_b = _lamb(_groups(b, tensors))
    opt_b.load_state_dict(saved)
    assert [g["lamb_exclude"] for g in opt_b.param_groups] == [False, True]
    for step_grads in grads[2:]:
        for params, opt in ((a, opt_a), (b, opt_b)):
            for k, p in params.items():
                p.grad = step_grads[k].float()
            opt.step()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_config_accepts_lamb_and_checks_the_clamp():
    cfg = compose(LAMB)
    assert cfg.optimizer.name == "lamb" and cfg.optimizer.lamb_max_trust_ratio == 10.0
    with pytest.raises(ConfigError, match="optimizer.lamb_max_trust_ratio"):
        compose([*LAMB, "optimizer.lamb_max_trust_ratio=0"])


# ---------------------------------------------------------------------------------------------
# Real megatron runs (gloo processes): DistributedOptimizer shards, checkpoint, restart.

STEPS = 7
RTOL = 2e-5  # fp32 sums in another order (DP splits the batch and the norms): ~6 digits


def train(tmp_path, data_index, data_cache, overrides):
    result = tiny_run(tmp_path, data_index, data_cache, [*LAMB, *overrides], steps=STEPS)
    assert json.loads((tmp_path / "config.json").read_text())["optimizer"]["name"] == "lamb"
    return result


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_index, data_cache):
    """One process, checkpointed at the last step: the curve and the state to reproduce."""
    tmp = tmp_path_factory.mktemp("lamb-single")
    return tmp, train(tmp, data_index, data_cache, ["parallelism=single", f"checkpoint.interval={STEPS}"])


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, data_index, data_cache):
    """DP=2 with the distributed optimizer, checkpointing every 2 steps (used twice below)."""
    tmp = tmp_path_factory.mktemp("lamb-dp2")
    return tmp, train(tmp, data_index, data_cache, ["parallelism=dp2", "checkpoint.interval=2"])


def _final_state(run_dir) -> dict:
    """Params, exp_avg and exp_avg_sq of the last checkpoint, in model space (megatron's
    fully_reshardable format: full tensors whatever the layout), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / "final-state.pt"
    dcp_to_torch_save(str(iteration_dir(run_dir / "checkpoints", STEPS)), str(out))
    state = torch.load(out, weights_only=True)
    return {k: v for k, v in state.items() if k.startswith("optimizer.state.")}


def _assert_same_state(run_dir, reference_dir):
    """The losses alone are blind to a trust ratio taken from a shard's norms instead of the
    tensor's (tried: the curve still agrees to 2e-5); the parameters are not: that error moves
    the split tensor by ~1e-4 of its size, fp32 reordering by ~1e-7."""
    got, want = _final_state(run_dir), _final_state(reference_dir)
    assert got.keys() == want.keys() and any(".param." in k for k in got)
    for key, value in want.items():
        scale = value.abs().max().item()
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5 * scale, msg=key)


def test_lamb_learns_in_one_process(single):
    losses = [m["loss"] for m in single[1].metrics]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]


def test_dp2_distributed_optimizer_matches_one_process(dp2, single):
    assert compose(["parallelism=dp2"]).parallelism.use_distributed_optimizer
    assert_same_curve(dp2[1].metrics, single[1].metrics, RTOL, grad_norm_rtol=1e-4)
    _assert_same_state(dp2[0], single[0])


@pytest.mark.slow  # 4 ranks on a shared CPU: ~60 s; deselect with -m "not slow"
def test_tp2_dp2_matches_one_process(tmp_path, data_index, data_cache, single):
    """TP partitions are pieces too: their norms are summed over TPxDP in the same all-reduce,
    and TP-replicated tensors (position embeddings) are counted once."""
    result = train(
        tmp_path,
        data_index,
        data_cache,
        ["parallelism=dp2", "parallelism.tp=2", f"checkpoint.interval={STEPS}"],
    )
    assert_same_curve(result.metrics, single[1].metrics, RTOL, grad_norm_rtol=1e-4)
    _assert_same_state(tmp_path, single[0])


def test_killed_dp2_run_resumes_on_the_same_curve(tmp_path, data_index, data_cache, dp2):
    """Kill rank 1 at step 5: the restart loads the step-4 checkpoint (Lamb's exp_avg,
    exp_avg_sq, step through megatron's fully_reshardable format) and every later step is
    bit-identical to the uninterrupted run. Synchronous saves: `latest` is iter_0000004 before step 5
    starts (an asynchronous one may still be uploading when the kill strikes; CI saw iter_0000002)."""
    clean_dir, clean = dp2
    killed = train(
        tmp_path,
        data_index,
        data_cache,
        [
            "parallelism=dp2",
            "checkpoint.interval=2",
            "checkpoint.async_save=false",
            "checkpoint.memory_interval=0",  # the durable format is the point, not the in-memory copies
            "fault.kill_rank=1",
            "fault.kill_at_step=5",
        ],
    )
    assert killed.attempts == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["attempt"] == 1][0] == 5, "should resume from step 4"
    assert [m["loss"] for m in killed.metrics] == [m["loss"] for m in clean.metrics]
    assert [m["grad_norm"] for m in killed.metrics] == [m["grad_norm"] for m in clean.metrics]
    got, want = _final_state(tmp_path), _final_state(clean_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)
