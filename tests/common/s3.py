"""A real S3 server for tests: moto's standalone server in a subprocess on a free local port, behind a TCP
relay the tests can take down and bring back (the server keeps its objects: moto holds them in memory).

    server = S3Server.start(); server.env -> AWS_* variables; server.down(); server.up(); server.close()
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import suppress
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        with suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"moto server did not listen on port {port} within {timeout} s")


class Relay:
    """TCP relay 127.0.0.1:port -> the server; `down()` drops every connection and refuses new ones."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            for s in self._open:
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        with suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
        for s in (a, b):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class S3Server:
    """moto's S3 server. With `auth` it checks credentials (moto's IAM auth): the first three requests,
    unauthenticated, make the one user whose key `env` holds; any other key or secret is refused, as a real
    service refuses it (moto 5.2 then also refuses its own listings with a prefix: use it for reads only)."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, auth: bool = False):
        import boto3

        self.proc, self.server_port, self.log = proc, port, log
        self.relay = Relay(port)
        self.endpoint = f"http://127.0.0.1:{self.relay.port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "dflash-test-key",
            "AWS_SECRET_ACCESS_KEY": "dflash-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        if not auth:
            return
        iam = boto3.client(
            "iam", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )  # fmt: skip
        iam.create_user(UserName="dflash-test")
        key = iam.create_access_key(UserName="dflash-test")["AccessKey"]
        everything = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="dflash-test", PolicyName="all", PolicyDocument=json.dumps(everything))
        self.env |= {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    @classmethod
    def start(cls, log_dir: Path, *, auth: bool = False) -> S3Server:
        port = free_port()
        log = log_dir / "moto.log"
        env = {**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"}
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        _wait_for_port(port, proc)
        return cls(proc, port, log, auth)

    def bypass_relay(self) -> None:
        """Talk to moto directly from now on (`endpoint`, `env`): the relay's Python threads copy every byte and
        cap throughput near 20 MB/s, so the benches measure through this; `down()` then stops nothing."""
        self.endpoint = f"http://127.0.0.1:{self.server_port}"
        self.env["AWS_ENDPOINT_URL"] = self.endpoint

    def bench_bucket(self) -> str:
        """For the benches: talk to moto directly (`bypass_relay`), put its endpoint and credentials in this
        process's environment (where dflash's storage and boto read them) and return a new bucket."""
        self.bypass_relay()
        os.environ.update(self.env)
        return self.new_bucket()

    def client(self):  # boto3, for setting up and inspecting buckets
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"dflash-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}

    def down(self) -> None:
        self.relay.down()

    def up(self) -> None:
        self.relay.up()

    def close(self) -> None:
        self.relay.down()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def upload_dir(server: S3Server, bucket: str, prefix: str, root: Path) -> None:
    """Every file under `root` as `prefix/<relative path>` (a local cache copied to the bucket)."""
    client = server.client()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")


def uploaded(server: S3Server, root: Path, prefix: str = "c") -> str:
    """`root` copied into a new bucket: its URL (`s3://bucket/prefix`)."""
    bucket = server.new_bucket()
    upload_dir(server, bucket, prefix, root)
    return f"s3://{bucket}/{prefix}"
