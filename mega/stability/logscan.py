"""Error patterns in a failed attempt's logs: what the ranks and their torchrun agents said before
they died, and (on GPU machines, where readable) the kernel's NVIDIA Xid lines.

An on-call engineer's first look: the gloo/NCCL error each rank raised (a peer's connection
closed, a reset, a timeout), a CUDA error or an out-of-memory, the last line of each traceback,
the drills' ``[fault]`` marker, and torchrun's own failure table (which rank exited with which
code or signal; its "Root Cause" is the first it saw fail). Bounded: only the last
``TAIL_BYTES`` of each log are read, at most ``MAX_MATCHES`` lines are kept, ``dmesg`` gets
``DMESG_TIMEOUT_S`` and anything unreadable is skipped, never raised.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TAIL_BYTES = 256 * 1024
MAX_MATCHES = 40
MAX_LINE = 300
DMESG_TIMEOUT_S = 2.0

# (name, pattern): the first that matches names a line. Order: the specific before the generic.
PATTERNS: list[tuple[str, re.Pattern]] = [
    (name, re.compile(rx))
    for name, rx in [
        ("injected-fault", r"^\[fault\] "),  # the drills' own marker (mega.train, mega.stability.rollback)
        ("gloo-peer-closed", r"Connection closed by peer"),
        ("connection-reset", r"Connection reset( by peer)?"),
        ("nccl-watchdog-timeout", r"Watchdog caught collective operation timeout"),
        (
            "nccl-error",
            r"NCCL error|nccl(System|Internal|Remote|UnhandledCuda|InvalidUsage|InvalidArgument)Error",
        ),
        ("collective-timeout", r"Timed out|timed out after|DistStoreError|Socket Timeout"),
        ("out-of-memory", r"out of memory|OutOfMemoryError|MemoryError"),
        ("cuda-error", r"CUDA error|cudaError|Cuda failure|CUBLAS_STATUS_\w+|illegal memory access"),
        ("xid", r"NVRM: Xid"),
        ("ecc", r"ECC error|[Uu]ncorrectable ECC"),
        ("process-group", r"ProcessGroup(Gloo|NCCL)"),
        ("oom-killed", r"^Killed$"),  # the shell's word for a SIGKILLed child (the kernel's OOM killer)
        # a traceback's last line: the exception (torchrun's ChildFailedError is the table below)
        ("exception", r"^(?:\w+\.)*\w*(?:Error|Exception|Interrupt)(?<!ChildFailedError): \S"),
    ]
]
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank(\d+)\]:\s?")  # torchrun --tee/--log-lines-prefix
# torchrun's ChildFailedError table: one entry per failed worker, the "Root Cause" one last
_FAILURE = re.compile(
    r"host\s*:\s*(?P<host>\S+)\s*\n\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)"
    r"\s*\n\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)"
)
_ROOT_CAUSE = "Root Cause (first observed failure)"


@dataclass
class Match:
    pattern: str
    line: str  # as logged, without torchrun's rank prefix, cut to MAX_LINE
    rank: int | None = None  # from the "[rankN]:" prefix, when there is one
    count: int = 1  # identical lines folded into one
    file: str | None = None


@dataclass
class Failure:
    """One row of torchrun's failure table: a worker that exited non-zero."""

    rank: int
    local_rank: int
    exitcode: int
    pid: int
    host: str
    root_cause: bool  # torchrun's "first observed failure" on its node
    node: int | None = None

    @property
    def signal(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exited with code {self.exitcode}"
        return f"rank {self.rank} {how}"


def read_tail(path: str | Path, limit: int = TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a file as text ('' when unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return text.split("\n", 1)[1] if size > limit and "\n" in text else text  # no half first line


def scan_text(text: str, file: str | None = None) -> list[Match]:
    """Lines matching a known error pattern, identical ones folded, oldest first."""
    found: dict[tuple, Match] = {}
    for raw in text.splitlines():
        m = _RANK_PREFIX.match(raw)
        rank = int(m.group(1)) if m else None
        line = (raw[m.end() :] if m else raw).strip()
        if not line:
            continue
        for name, rx in PATTERNS:
            if rx.search(line):
                key = (name, rank, line)
                if key in found:
                    found[key].count += 1
                elif len(found) < MAX_MATCHES:
                    found[key] = Match(name, line[:MAX_LINE], rank, 1, file)
                break
    return list(found.values())


def failures(text: str, node: int | None = None) -> list[Failure]:
    """torchrun's failure table in an agent log (its last one: a log holds one attempt)."""
    start = text.rfind("ChildFailedError")
    if start < 0:
        return []
    table = text[start:]
    root_at = table.find(_ROOT_CAUSE)
    return [
        Failure(
            int(m["rank"]),
            int(m["local"]),
            int(m["code"]),
            int(m["pid"]),
            m["host"],
            root_at >= 0 and m.start() > root_at,
            node,
        )
        for m in _FAILURE.finditer(table)
    ]


def culprit_ranks(fails: list[Failure], matches: list[Match], *, every_root: bool = True) -> list[int]:
    """Which failed ranks caused the failure rather than suffered it: the ones killed by a signal
    other than the SIGTERM torchrun stops survivors with (SIGKILL, SIGSEGV, SIGABRT, ...); else
    torchrun's root causes that raised no peer-connection error (a rank whose peer died reports
    'Connection closed by peer'); else (``every_root``) every root cause."""
    killed = sorted({f.rank for f in fails if f.exitcode < 0 and f.exitcode != -signal.SIGTERM})
    if killed:
        return killed
    victims = {m.rank for m in matches if m.pattern in ("gloo-peer-closed", "connection-reset")}
    roots = sorted({f.rank for f in fails if f.root_cause})
    return [r for r in roots if r not in victims] or (roots if every_root else [])


def dmesg_xid(since: float | None = None, timeout_s: float = DMESG_TIMEOUT_S) -> list[str]:
    """The kernel's NVIDIA Xid/ECC lines (``NVRM: Xid ...``) logged after unix time ``since``;
    [] when dmesg is missing, not permitted (kernel.dmesg_restrict) or slow. Lines carry seconds
    since boot; /proc/uptime converts them."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout_s)
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return []
    if out.returncode != 0:
        return []
    return xid_lines(out.stdout, None if since is None else since - boot)


def xid_lines(dmesg: str, after_s: float | None = None) -> list[str]:
    """Xid/ECC lines of ``dmesg`` output, logged ``after_s`` seconds since boot or later (the
    last MAX_MATCHES)."""
    stamp = re.compile(r"^\[\s*(\d+\.\d+)\]")
    keep = []
    for line in dmesg.splitlines():
        if "NVRM: Xid" not in line and not ("NVRM" in line and "ECC" in line):
            continue
        m = stamp.match(line)
        if after_s is not None and m and float(m.group(1)) < after_s:
            continue
        keep.append(line.strip()[:MAX_LINE])
    return keep[-MAX_MATCHES:]


def scan_logs(
    logs: dict[int, Path], *, device: str = "cpu", since: float | None = None, every_root: bool = True
) -> dict:
    """An attempt's agent logs (node -> path): the matches, torchrun's failures, the culprit ranks
    they point at (``culprit_ranks``' ``every_root``) and, when ``device`` is cuda, the kernel's
    Xid lines since ``since``."""
    matches: list[Match] = []
    fails: list[Failure] = []
    for node, path in sorted(logs.items()):
        text = read_tail(path)
        matches += scan_text(text, str(path))
        fails += failures(text, node)
    xids = dmesg_xid(since) if device == "cuda" else []
    return {
        "matches": [asdict(m) for m in matches][:MAX_MATCHES],
        "failures": [asdict(f) for f in fails],
        "culprit_ranks": culprit_ranks(fails, matches, every_root=every_root),
        "xid": xids,
        "summary": summarise(matches, fails, xids),
    }


def summarise(matches: list[Match], fails: list[Failure], xids: list[str]) -> str | None:
    """A few lines for people: how each culprit died, the distinct error kinds and an example of
    each, the Xid lines."""
    parts = []
    culprits = set(culprit_ranks(fails, matches))
    parts += [f.describe() for f in fails if f.rank in culprits and (f.root_cause or f.signal)]
    seen: dict[str, list[Match]] = {}
    for m in matches:
        seen.setdefault(m.pattern, []).append(m)
    for name, ms in seen.items():
        ranks = sorted({m.rank for m in ms if m.rank is not None})
        who = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks else ""
        parts.append(f"{name}{who}: {ms[0].line[:160]}")
    parts += [f"kernel: {x}" for x in xids[-3:]]
    return "\n".join(dict.fromkeys(parts)) or None
