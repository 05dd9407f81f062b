"""The entry point of one node's pod: ``python -m mega.launch.pod [--selfcheck] [--watch] -- TORCHRUN...``.

``TORCHRUN...`` is the node's torchrun agent for training (mega.launch.backend.agent_argv). Before
it starts, the entry:

1. numbers the attempt: ``$MEGA_ATTEMPT`` (the JobSet's restart count), or one past the last
   attempt the in-cluster watcher stopped (``heartbeat_redis.generation_key``) if that is later; a fault
   drill of attempt 0 does not strike again, and no heartbeat key is reused;
2. publishes its Kubernetes node name (``$MEGA_NODE_NAME``, the downward API's ``spec.nodeName``;
   else the host name) under its node rank, so the watcher can name a culprit's node;
3. with ``--selfcheck``: runs the node self-check (mega.cluster.selfcheck) as a job of every pod,
   on the same rendezvous; node 0 reads the verdict, and an unhealthy node becomes a stop order
   of this attempt naming it (``evict``), so no training starts on it;
4. with ``--watch`` (node 0): runs the in-cluster watcher (mega.launch.incluster_watch) beside
   the agent.

Exit code: the agent's (0 done, 1 a rank failed), or the stop order's (``heartbeat_redis.RESTART_EXIT_CODE``)
when the watcher ended this attempt: the workload's podFailurePolicy tells them apart
(mega/launch/kubernetes.py). SIGTERM (eviction, preemption) is passed on to the agent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from mega import rank_env
from mega.stability import heartbeat_redis

NODE_NAME_ENV = "MEGA_NODE_NAME"
SELFCHECK_TIMEOUT_S = 600.0
ORDER_POLL_S = 2.0  # how often the entry looks for a stop order while its agent runs
AGENT_TERM_S = 30.0  # SIGTERM -> SIGKILL of an agent told to stop


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in ``argv``."""
    for i, a in enumerate(argv):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _attempt(client, prefix: str | None) -> int:
    import redis

    from mega.launch.incluster_watch import generation

    own = int(os.environ.get(rank_env.ATTEMPT_ENV) or 0)
    try:
        return max(own, generation(client, prefix)) if client is not None else own
    except (redis.RedisError, OSError):  # heartbeats are never required to train
        return own


def _order(client, prefix: str | None, attempt: int) -> dict | None:
    """The watcher's stop order of ``attempt`` (None when there is none or Redis does not answer)."""
    import redis

    try:
        value = client.get(heartbeat_redis.stop_key(prefix, attempt)) if client is not None else None
    except (redis.RedisError, OSError):
        return None
    return json.loads(value) if value else None


def _selfcheck(agent: list[str], cfg, node: int, attempt: int, client, prefix: str | None) -> None:
    """Every pod runs the self-check job; node 0 turns an unhealthy verdict into a stop order."""
    from mega.cluster.selfcheck import selfcheck_floors
    from mega.launch.incluster_watch import ORDER_TTL_S, evicted_key, node_name_key

    out = Path(cfg.train.run_dir) / "selfcheck" / f"attempt-{attempt}.json"
    pg_timeout = max(10.0, min(float(cfg.cluster.pg_timeout_s), SELFCHECK_TIMEOUT_S - 10.0))
    module = len(agent) - 1 - agent[::-1].index("-m")  # the ranks' module, after torchrun's own -m
    check = agent[:module] + [
        "-m",
        "mega.cluster.selfcheck",
        "--out",
        str(out),
        "--floors",
        json.dumps(selfcheck_floors(cfg)),
        "--device",
        cfg.cluster.device,
        "--timeout-s",
        str(pg_timeout),
    ]
    code = subprocess.run(check, timeout=SELFCHECK_TIMEOUT_S).returncode
    if node != 0 or client is None:
        return
    verdict = json.loads(out.read_text()) if code == 0 and out.exists() else None
    if verdict is not None and verdict["healthy"]:
        print(f"node self-check of attempt {attempt}: healthy", flush=True)
        return
    bad = [n["node"] for n in verdict["nodes"] if not n["healthy"]] if verdict else []
    names = [v.decode() for v in (client.get(node_name_key(prefix, k)) for k in bad) if v]
    reason = "; ".join(verdict["reasons"]) if verdict else f"the self-check job exited with {code}"
    order = {
        "attempt": attempt,
        "reason": f"self-check: {reason}",
        "exit_code": heartbeat_redis.RESTART_EXIT_CODE,
        "culprit": {"nodes": bad},
        "evict": names,
    }
    pipe = client.pipeline(transaction=True)
    pipe.set(heartbeat_redis.stop_key(prefix, attempt), json.dumps(order), ex=ORDER_TTL_S)
    pipe.set(heartbeat_redis.generation_key(prefix), attempt + 1)
    if names:
        pipe.sadd(evicted_key(prefix), *names)
    pipe.execute()
    print(f"node self-check of attempt {attempt} failed: {reason}", flush=True)


def _run_agent(agent: list[str], client, prefix: str | None, attempt: int) -> int:
    """The agent to its end; SIGTERM passed on. A stop order of this attempt ends it too: ranks
    obey it themselves, but an agent still waiting in the rendezvous (a peer that never came) has
    none to obey."""
    proc = subprocess.Popen(agent)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    while True:
        try:
            return proc.wait(timeout=ORDER_POLL_S)
        except subprocess.TimeoutExpired:
            if _order(client, prefix, attempt) is not None:
                proc.terminate()
                try:
                    return proc.wait(timeout=AGENT_TERM_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m mega.launch.pod", description=__doc__.splitlines()[0])
    parser.add_argument("--selfcheck", action="store_true", help="run the node self-check before training")
    parser.add_argument(
        "--watch", action="store_true", help="on node 0: run the in-cluster hang watcher beside the agent"
    )
    args = parser.parse_args(argv[:split])
    agent = argv[split + 1 :]
    if not agent:
        parser.error("no torchrun command after --")

    from mega import config as mega_config
    from mega.launch import incluster_watch

    cfg = mega_config.load(_flag(agent, "--config"))
    node = int(_flag(agent, "--node-rank") or 0)
    client, prefix = heartbeat_redis.client_from_env()
    attempt = _attempt(client, prefix)
    os.environ[rank_env.ATTEMPT_ENV] = str(attempt)
    if client is not None:
        with contextlib.suppress(Exception):
            client.set(
                incluster_watch.node_name_key(prefix, node),
                os.environ.get(NODE_NAME_ENV) or socket.gethostname(),
                ex=incluster_watch.ORDER_TTL_S,
            )
    print(f"node {node}: attempt {attempt}", flush=True)

    if args.selfcheck:
        _selfcheck(agent, cfg, node, attempt, client, prefix)
    done = None
    if args.watch and node == 0 and client is not None:
        _, done = incluster_watch.watch_in_thread(cfg, dict(os.environ))
    if _order(client, prefix, attempt) is None:
        code = _run_agent(agent, client, prefix, attempt)
    else:
        code = 1  # stopped before training (a self-check verdict)
    if done is not None:
        done.set()
    order = _order(client, prefix, attempt) if code != 0 else None
    if order is not None:
        print(f"node {node}: attempt {attempt} ended by the watcher: {order['reason']}", flush=True)
        return int(order["exit_code"])
    return code


if __name__ == "__main__":
    sys.exit(main())
