"""A real local Redis Cluster for tests: 3 masters and 3 replicas of ``redis-server``.

Each node runs in its own directory under a temporary one, on a free port, with
AOF on (``appendfsync everysec``) and a short ``cluster-node-timeout``, so a
master killed with SIGKILL is replaced by its replica within a few seconds.
:meth:`RedisClusterServers.kill_master` does that, and :meth:`restart` brings the
killed node back (it rejoins as a replica of the promoted one).
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import redis

from holdfast.testing.timescale import scaled

NODE_TIMEOUT_MS = 1000
READY_TIMEOUT_SECONDS = 30.0


@dataclass
class Node:
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def info(self, section: str) -> dict[str, object]:
        with self.client() as client:
            return dict(client.info(section))


class RedisClusterServers:
    """Six ``redis-server`` processes formed into one cluster; stopped on exit."""

    def __init__(self, *, masters: int = 3, replicas_per_master: int = 1) -> None:
        self.masters = masters
        self.replicas_per_master = replicas_per_master
        self.directory = Path(tempfile.mkdtemp(prefix="holdfast-cluster-"))
        self.nodes: list[Node] = []

    @property
    def url(self) -> str:
        """Any node's URL: the first one that is up."""
        return next(n.url for n in self.nodes if n.process is not None)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        server = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError("redis-server and redis-cli must be on PATH for a cluster")
        for n in range(self.masters * (1 + self.replicas_per_master)):
            directory = self.directory / f"node{n}"
            directory.mkdir()
            self.nodes.append(Node(_free_cluster_port({n.port for n in self.nodes}), directory))
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            self._wait_ping(node)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas_per_master),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()

    def _spawn(self, node: Node) -> None:
        server = shutil.which("redis-server")
        assert server is not None
        node.process = subprocess.Popen(
            [
                server,
                "--port",
                str(node.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(node.directory),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--logfile",
                str(node.directory / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _wait_ping(self, node: Node) -> None:
        deadline = time.monotonic() + scaled(READY_TIMEOUT_SECONDS)
        while True:
            try:
                with node.client() as client:
                    client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_ok(self, timeout: float | None = None) -> None:
        """Until every live node says ``cluster_state:ok`` and all 16384 slots are served
        (at most ``timeout`` seconds; default ``READY_TIMEOUT_SECONDS``, scaled)."""
        within = scaled(READY_TIMEOUT_SECONDS) if timeout is None else timeout
        deadline = time.monotonic() + within
        while True:
            states = []
            for node in self.nodes:
                if node.process is None:
                    continue
                try:
                    info = _cluster_info(node)
                except redis.RedisError:
                    info = {}
                states.append(
                    info.get("cluster_state") == "ok" and info.get("cluster_slots_ok") == "16384"
                )
            if states and all(states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def masters_now(self) -> list[Node]:
        out = []
        for node in self.nodes:
            if node.process is None:
                continue
            try:
                if node.info("replication").get("role") == "master":
                    out.append(node)
            except redis.RedisError:
                continue
        return out

    def serving(self, key: str) -> tuple[Node, Node | None]:
        """The master serving ``key``'s slot now, and its replica (None while it has none)."""
        seed = self._live()[0]
        with seed.client() as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            ranges = client.execute_command("CLUSTER", "SLOTS")
        by_port = {node.port: node for node in self.nodes}
        for entry in ranges:
            if int(entry[0]) <= slot <= int(entry[1]):
                replicas = [by_port[int(r[1])] for r in entry[3:]]
                return by_port[int(entry[2][1])], (replicas[0] if replicas else None)
        raise AssertionError(f"no node serves slot {slot}")

    def wait_in_sync(self, key: str, timeout: float = 30.0) -> None:
        """Until the replica of ``key``'s slot holds all its master has: a node just
        restarted may still be syncing, and the cluster does not promote such a one."""
        deadline = time.monotonic() + timeout
        while True:
            master, _replica = self.serving(key)
            info = master.info("replication")
            replica = info.get("slave0")
            if (
                isinstance(replica, dict)
                and replica.get("state") == "online"
                and replica.get("offset") == info.get("master_repl_offset")
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the replica of the master on port {master.port} never caught up"
                )
            time.sleep(0.1)

    def kill_master(self, key: str | None = None) -> Node:
        """SIGKILL a master (the one serving ``key``, else the first); returns it."""
        victim = self.serving(key)[0] if key is not None else self.masters_now()[0]
        assert victim.process is not None
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        victim.process = None
        return victim

    def wait_failover(self, dead: Node, timeout: float = 30.0) -> float:
        """Until no slot is served by the killed ``dead`` node any more (its replica was
        promoted) and the cluster is ok again; how many seconds that took."""
        began = time.monotonic()
        deadline = began + timeout
        while True:
            if not any(_primary_ports(node) & {dead.port} for node in self._live()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica took over from the master on port {dead.port}")
            time.sleep(0.1)
        self.wait_ok(max(1.0, deadline - time.monotonic()))
        return time.monotonic() - began

    def _live(self) -> list[Node]:
        return [n for n in self.nodes if n.process is not None]

    def restart(self, node: Node) -> None:
        """Start a killed node again from its directory: it rejoins as a replica."""
        self._spawn(node)
        self._wait_ping(node)

    def heal(self) -> None:
        """Restart every node a test killed and left dead (a test that failed before its
        own ``restart``), then wait for the cluster to be ok: the next test starts whole."""
        dead = [node for node in self.nodes if node.process is None]
        for node in dead:
            self.restart(node)
        if dead:
            self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait()
                node.process = None
        shutil.rmtree(self.directory, ignore_errors=True)


def _cluster_info(node: Node) -> dict[str, str]:
    with node.client() as client:
        raw = client.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.strip().split(":", 1) for line in text.splitlines() if ":" in line)


def _free_cluster_port(taken: set[int]) -> int:
    """A port that is free together with its cluster bus port (+10000, so at most 55535)."""
    for _ in range(1000):
        port = random.randint(20000, 45000)
        if port in taken or port + 10000 in taken:
            continue
        if all(_bindable(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_enabled_at(url: str) -> bool:
    """Whether the Redis at ``url`` is a node of a Redis Cluster."""
    with redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5) as client:
        return bool(client.info("cluster").get("cluster_enabled"))


def _primary_ports(node: Node) -> set[int]:
    """The ports of the masters serving slots, as ``node`` sees the cluster."""
    try:
        with node.client() as client:
            return {int(entry[2][1]) for entry in client.execute_command("CLUSTER", "SLOTS")}
    except redis.RedisError:
        return set()
