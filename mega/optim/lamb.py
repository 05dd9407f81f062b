"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2) as a torch
optimizer that also works on the flat parameter shards of megatron's distributed optimizer.

For every tensor w with gradient g, at step t::

    m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2
    r = m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
    ratio = min(|w| / |r|, max_trust_ratio)   if |w| > 0 and |r| > 0, else 1
    w = w - lr * ratio * r

Groups marked ``lamb_exclude`` (norm weights and biases) get no weight decay and ratio 1.

The trust ratio needs the norms of whole tensors, but a param of this optimizer may be only a
piece of one (a DP shard, a TP partition). Each param therefore carries the id of the tensor it
belongs to, and the step runs in two phases: ``local_sq_norms`` adds every piece's |w|^2 and |r|^2
into one [2, num_tensors] tensor, which is summed over ``norm_group`` with a single all-reduce,
then ``apply_update`` gives every piece the ratio of its whole tensor. Without ``norm_group``
every param is its own whole tensor and nothing is communicated.

State keys are those of torch Adam (``exp_avg``, ``exp_avg_sq``, ``step``), so megatron's
optimizer wrappers save, reshard and restore it as they do Adam's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust_ratio: float = 10.0,
        *,
        tensor_ids: list[list[int]] | None = None,
        counted: list[list[bool]] | None = None,
        num_tensors: int | None = None,
        norm_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ):
        """``tensor_ids[i][j]``: the whole tensor that param j of group i is a piece of (the same
        numbering on every rank of ``norm_group``); ``counted[i][j]``: whether that piece adds to
        the tensor's norms on this rank (False for a copy that another rank counts already, e.g.
        a TP-replicated norm weight on tp_rank > 0). Defaults: each param is a whole tensor."""
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"invalid lr={lr}, eps={eps} or weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}")
        if not max_trust_ratio > 0:
            raise ValueError(f"max_trust_ratio must be positive, got {max_trust_ratio}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        # torch's add_param_group refuses non-leaf tensors, and megatron's distributed optimizer
        # hands over views into its flat buffers. Like DistributedOptimizer itself, install the
        # groups directly.
        super().__init__([{"params": []}], defaults)
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in params]
        self.max_trust_ratio = max_trust_ratio
        self.norm_group = norm_group

        groups = [g["params"] for g in self.param_groups]
        if tensor_ids is None:
            flat = iter(range(sum(len(g) for g in groups)))
            tensor_ids = [[next(flat) for _ in g] for g in groups]
        if counted is None:
            counted = [[True] * len(g) for g in groups]
        sizes = [len(g) for g in groups]
        if [len(t) for t in tensor_ids] != sizes or [len(c) for c in counted] != sizes:
            raise ValueError("tensor_ids and counted need one entry per param of every group")
        # Keyed by the param tensor, not stored in the groups: load_state_dict replaces the group
        # dicts with the saved ones, and a checkpoint may come from another shard layout.
        self._tensor_id = {p: t for g, ts in zip(groups, tensor_ids) for p, t in zip(g, ts)}
        self._counted = {p: c for g, cs in zip(groups, counted) for p, c in zip(g, cs)}
        self.num_tensors = num_tensors if num_tensors is not None else len(self._tensor_id)
        if any(not 0 <= t < self.num_tensors for t in self._tensor_id.values()):
            raise ValueError(f"tensor ids must lie in [0, {self.num_tensors})")
        first = next((p for g in groups for p in g), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.num_reductions = 0  # all-reduces issued (one per step with a norm_group)

    # -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sq_norms = self.local_sq_norms()
        if self.norm_group is not None:
            # Every rank of the group must get here, also one that holds no piece this step.
            dist.all_reduce(sq_norms, group=self.norm_group)
            self.num_reductions += 1
        self.apply_update(sq_norms)
        return loss

    @torch.no_grad()
    def local_sq_norms(self) -> torch.Tensor:
        """Phase 1: advance the moments and return this rank's partial squared norms, a
        [2, num_tensors] float32 tensor: row 0 sum(w^2), row 1 sum(r^2) over the local pieces."""
        ids, w_sq, r_sq = [], [], []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # One step count per group (like fused Adam): megatron restores ``step`` from the
            # param groups with TE/Apex present and per param without; both land here.
            group["step"] = int(group.get("step", 0)) + 1
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # A fresh tensor, never += : megatron's loader may hand one step tensor to all
                # params, and Adam-style per-param steps are what its checkpoint code reads.
                state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
                grad = p.grad
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if not group.get("lamb_exclude", False) and self._counted[p]:
                    r = self._direction(p, group)
                    ids.append(self._tensor_id[p])
                    w_sq.append(p.float().square().sum())
                    r_sq.append(r.square().sum())
        sq_norms = torch.zeros(2, self.num_tensors, dtype=torch.float32, device=self.device)
        if ids:
            # Several pieces of one tensor on a rank add up. (megatron gives a rank at most one
            # piece per tensor, so CUDA's unordered index_add_ cannot reorder sums there.)
            index = torch.tensor(ids, device=self.device)
            sq_norms[0].index_add_(0, index, torch.stack(w_sq).to(self.device))
            sq_norms[1].index_add_(0, index, torch.stack(r_sq).to(self.device))
        return sq_norms

    @torch.no_grad()
    def apply_update(self, sq_norms: torch.Tensor) -> None:
        """Phase 2: w -= lr * ratio * r with the whole-tensor norms in ``sq_norms`` (summed over
        all pieces). r is recomputed from the updated moments rather than kept from phase 1: the
        same arithmetic on the same inputs, without holding a second copy of the shard."""
        w_norm, r_norm = sq_norms.sqrt()
        ratio = torch.where(
            (w_norm > 0) & (r_norm > 0),
            (w_norm / r_norm).clamp(max=self.max_trust_ratio),
            torch.ones_like(w_norm),
        )
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                r = self._direction(p, group)
                if group.get("lamb_exclude", False):
                    p.add_(r, alpha=-group["lr"])
                else:
                    p.sub_(r * (group["lr"] * ratio[self._tensor_id[p]]).to(r.device))

    def _direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """r = m_hat / (sqrt(v_hat) + eps) + wd * w (no weight decay for excluded groups)."""
        state = self.state[p]
        beta1, beta2 = group["betas"]
        t = group["step"]
        m_hat = state["exp_avg"] / (1 - beta1**t)
        v_hat = state["exp_avg_sq"] / (1 - beta2**t)
        r = m_hat / (v_hat.sqrt() + group["eps"])
        wd = 0.0 if group.get("lamb_exclude", False) else group["weight_decay"]
        if wd:
            r.add_(p, alpha=wd)
        return r

    # -----------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict):
        # Which groups are excluded is a property of today's param grouping, not of the
        # checkpoint (which may come from Adam): keep the marks across the group replacement.
        marks = [g.get("lamb_exclude", False) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mark in zip(self.param_groups, marks):
            group["lamb_exclude"] = mark
