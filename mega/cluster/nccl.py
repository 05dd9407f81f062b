"""Known NCCL (and torch-NCCL) environment variables and the values they accept.

``cluster.env`` is exported to every rank. NCCL reads most of these variables with ``atoi`` and
copies them into hardware fields without checking them, so a bad value does not fail at launch:
``NCCL_IB_RETRY_CNT=12`` goes into the 3-bit retry-count field of every InfiniBand queue pair and
surfaces, if at all, as a failed ``ibv_modify_qp`` or a different retry count on the first
inter-node collective, on every node at once. ``check_env`` rejects such values before launch
(``mega.config.validate`` turns each problem into a ``ConfigError`` naming ``cluster.env.<NAME>``).

Sources for the ranges:

* NCCL passes ``NCCL_IB_TIMEOUT`` and ``NCCL_IB_RETRY_CNT`` straight into ``ibv_qp_attr.timeout``
  and ``.retry_cnt`` when it moves a queue pair to RTS (``ncclIbRtsQp`` in NCCL's
  ``src/transport/net_ib``; defaults 20 and 7 since NCCL 2.23, timeout 18 before, 14 before 2.14).
  The InfiniBand specification (vol. 1, "Local ACK Timeout" and "Retry Count" of the QP
  attributes; rdma-core's ``ibv_modify_qp(3)``) makes the timeout a 5-bit exponent -- the ACK
  timeout is 4.096 us * 2^n, 0 meaning wait forever -- and the retry count a 3-bit field: 0-7.
  NCCL's environment documentation
  (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) describes both.
* ``NCCL_IB_SL``: the 4-bit InfiniBand service level (0-15); ``NCCL_IB_TC``: the 8-bit traffic
  class (0-255).
* ``NCCL_SOCKET_NTHREADS`` (1-16) and ``NCCL_NSOCKS_PERTHREAD``, whose product NCCL caps at 64
  (NCCL's environment documentation).
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (and its deprecated name ``NCCL_ASYNC_ERROR_HANDLING``):
  0-3 in torch's ``ProcessGroupNCCL`` (0 off, 1 tear down the process, 2 clean up only, 3 tear
  down without clean-up).

Variables not in the table pass unchecked (NCCL has many, and new releases add more).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IntRange:
    low: int
    high: int
    meaning: str

    def problem(self, value: str) -> str | None:
        try:
            number = int(value.strip(), 10)
        except ValueError:
            return f"must be an integer in [{self.low}, {self.high}] ({self.meaning}), got {value!r}"
        if not self.low <= number <= self.high:
            return f"must be in [{self.low}, {self.high}] ({self.meaning}), got {number}"
        return None


@dataclass(frozen=True)
class OneOf:
    values: tuple[str, ...]
    meaning: str

    def problem(self, value: str) -> str | None:
        if value.strip().upper() not in self.values:
            return f"must be one of {list(self.values)} ({self.meaning}), got {value!r}"
        return None


_SWITCH = OneOf(("0", "1"), "0 or 1")

KNOWN = {
    "NCCL_IB_TIMEOUT": IntRange(
        1, 31, "InfiniBand ACK timeout exponent, 4.096 us * 2^n: a 5-bit field; 0 would disable it"
    ),
    "NCCL_IB_RETRY_CNT": IntRange(0, 7, "InfiniBand retry count: a 3-bit field"),
    "NCCL_IB_SL": IntRange(0, 15, "InfiniBand service level: a 4-bit field"),
    "NCCL_IB_TC": IntRange(0, 255, "InfiniBand traffic class: an 8-bit field"),
    "NCCL_IB_DISABLE": _SWITCH,
    "NCCL_P2P_DISABLE": _SWITCH,
    "NCCL_SHM_DISABLE": _SWITCH,
    "NCCL_SOCKET_NTHREADS": IntRange(1, 16, "threads per network connection"),
    "NCCL_NSOCKS_PERTHREAD": IntRange(1, 64, "sockets per thread"),
    "NCCL_DEBUG": OneOf(("VERSION", "WARN", "INFO", "TRACE"), "NCCL log level"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": IntRange(0, 3, "torch ProcessGroupNCCL error handling mode"),
    "NCCL_ASYNC_ERROR_HANDLING": IntRange(0, 3, "deprecated name of TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    "TORCH_NCCL_BLOCKING_WAIT": _SWITCH,
}

MAX_SOCKETS = 64  # NCCL_SOCKET_NTHREADS * NCCL_NSOCKS_PERTHREAD


def check_env(env: dict[str, str]) -> dict[str, str]:
    """{variable: what is wrong} for every known variable with a value NCCL/torch would misuse."""
    problems = {}
    for name, value in env.items():
        rule = KNOWN.get(name)
        if rule is None:
            continue
        if not isinstance(value, str):
            problems[name] = f"must be a string, got {type(value).__name__}"
            continue
        problem = rule.problem(value)
        if problem:
            problems[name] = problem
    threads, socks = env.get("NCCL_SOCKET_NTHREADS"), env.get("NCCL_NSOCKS_PERTHREAD")
    if threads and socks and not problems.keys() & {"NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"}:
        if int(threads) * int(socks) > MAX_SOCKETS:
            problems["NCCL_NSOCKS_PERTHREAD"] = (
                f"NCCL_SOCKET_NTHREADS * NCCL_NSOCKS_PERTHREAD = {int(threads) * int(socks)} "
                f"exceeds NCCL's limit of {MAX_SOCKETS}"
            )
    return problems
