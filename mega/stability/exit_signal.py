"""Rank side of a scheduler's warning signal: finish the step, save, exit with ``EXIT_CODE``.

Slurm sends SIGUSR1 ``launcher.slurm.signal_grace_s`` before a job's time limit (and on
preemption); each node's task passes it on to its ranks (mega/launch/slurm.py), whose launcher
sets ``$MEGA_EXIT_SIGNAL``. A rank only notes the signal; at the end of every step all ranks agree
(one 1-element all-reduce, MAX) whether any saw it -- the signal reaches the nodes at slightly
different moments, and the save is collective -- then save that step and exit with
``EXIT_CODE``, which the driver answers with a resubmission from the save (no failure counted,
no step lost). Without ``$MEGA_EXIT_SIGNAL`` nothing is installed and no collective runs.
"""

from __future__ import annotations

import os
import signal

ENV = "MEGA_EXIT_SIGNAL"  # the signal's name, e.g. USR1
EXIT_CODE = 85  # saved and exited on the signal: distinct from a failure (1) and torchrun's codes


class ExitSignal:
    def __init__(self, signum: int):
        self.seen = False
        self.signum = signum
        signal.signal(signum, self._note)

    def _note(self, signum, frame) -> None:
        self.seen = True

    def agreed(self, group) -> bool:
        """Collective over ``group``: whether any rank has seen the signal."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.seen else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            self.ignore()
        return bool(flag.item())

    def ignore(self) -> None:
        """From here on the signal changes nothing (the last step is done, or the save decided);
        ignored, it also cannot kill this process while Python shuts down, which restores the
        default action of every signal it handled."""
        signal.signal(self.signum, signal.SIG_IGN)


def install() -> ExitSignal | None:
    """The handler of ``$MEGA_EXIT_SIGNAL`` (None when unset)."""
    name = os.environ.get(ENV)
    if not name:
        return None
    return ExitSignal(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))
