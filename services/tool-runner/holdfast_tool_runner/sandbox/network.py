"""The network of a sandbox whose policy allows it: its own namespace, behind slirp4netns.

Sharing the host's network namespace would let a tool reach everything listening on
the host's loopback: the engine's Redis and PostgreSQL, the gateway, a metadata
proxy. So a sandbox with network keeps its own namespace, and slirp4netns (user-mode
networking, the one rootless containers use) gives it a ``tap0`` routed through a
userspace TCP/IP stack in the host's namespace:

* ``--disable-host-loopback``: the host's 127.0.0.1 (slirp's 10.0.2.2) is refused;
  the sandbox's own 127.0.0.1 is its own;
* DNS goes to slirp's forwarder, 10.0.2.3 (a generated resolv.conf), which asks the
  host's resolvers;
* ``--enable-sandbox --enable-seccomp``: slirp4netns confines itself (a private mount
  namespace, capabilities dropped, a syscall filter), since it parses what the
  sandbox sends.

bwrap reports the sandbox's pid on ``--info-fd`` (slirp4netns is handed its network
namespace and that namespace's owning user namespace, by fd) and holds the command on
``--block-fd`` until slirp4netns says the interface is up; the command never runs
without its network. slirp4netns exits when its exit pipe closes: at the call's end,
or with the runner.

Without slirp4netns the sandbox shares the host's network, as bwrap does with
``--share-net``; ``probe()`` and every result say so (``network: host``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
from collections.abc import Callable

from .policy import SandboxUnavailable

RESOLV_CONF = b"nameserver 10.0.2.3\n"
_NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1), linux/nsfs.h
_SETUP_SECONDS = 10.0
_EXIT_GRACE_SECONDS = 2.0


def slirp4netns() -> str | None:
    return shutil.which("slirp4netns")


async def _read(fd: int, *, enough: Callable[[bytes], bool]) -> bytes:
    """Read a pipe until EOF or ``enough(data)``, on the event loop (cancellable)."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    data = b""
    while True:
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _resolve, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            return data
        data += chunk
        if enough(data):
            return data


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _namespaces(pid: int) -> tuple[int, int]:
    """Fds of ``pid``'s network namespace and of the user namespace that owns it.

    Not simply ``pid``'s user namespace: bwrap may have moved the sandbox into a nested
    one (to map its uid), which holds no rights over the network namespace created
    with the outer one, and when it does so is a race with us.
    """
    netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        owner = fcntl.ioctl(netns, _NS_GET_USERNS)
    except BaseException:
        os.close(netns)
        raise
    return netns, owner


async def _sandbox_pid(info_fd: int) -> int:
    raw = await _read(info_fd, enough=_is_json)  # bwrap closes it when it exits
    try:
        return int(json.loads(raw)["child-pid"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SandboxUnavailable(f"network: bwrap reported no sandbox pid ({raw[:200]!r})") from exc


class Uplink:
    """A running slirp4netns for one call."""

    def __init__(self, process: asyncio.subprocess.Process, exit_fd: int) -> None:
        self.process = process
        self._exit_fd: int | None = exit_fd

    @classmethod
    async def connect(cls, slirp: str, info_fd: int, block_fd: int) -> Uplink:
        """Give the sandbox behind ``info_fd`` its network, then release its command."""
        try:
            async with asyncio.timeout(_SETUP_SECONDS):
                return await cls._connect(slirp, info_fd, block_fd)
        except TimeoutError as exc:
            raise SandboxUnavailable("network: slirp4netns did not come up in time") from exc

    @classmethod
    async def _connect(cls, slirp: str, info_fd: int, block_fd: int) -> Uplink:
        pid = await _sandbox_pid(info_fd)
        try:
            netns, owner = _namespaces(pid)
        except OSError as exc:
            raise SandboxUnavailable(f"network: cannot open the sandbox namespace: {exc}") from exc
        ready_read, ready_write = os.pipe()
        exit_read, exit_write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                slirp,
                "--configure",
                "--mtu=65520",
                "--disable-host-loopback",
                "--enable-sandbox",
                "--enable-seccomp",
                f"--ready-fd={ready_write}",
                f"--exit-fd={exit_read}",
                "--netns-type=path",
                f"--userns-path=/proc/self/fd/{owner}",
                f"/proc/self/fd/{netns}",
                "tap0",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(ready_write, exit_read, netns, owner),
                start_new_session=True,
            )
        except OSError as exc:
            os.close(ready_read)
            os.close(exit_write)
            raise SandboxUnavailable(f"network: cannot start slirp4netns: {exc}") from exc
        finally:
            for fd in (ready_write, exit_read, netns, owner):
                os.close(fd)
        uplink = cls(process, exit_write)
        try:
            ready = await _read(ready_read, enough=bool)  # EOF if it failed
            if ready != b"1":
                uplink.close()
                await asyncio.wait_for(process.wait(), _EXIT_GRACE_SECONDS)
                assert process.stderr is not None
                detail = (await process.stderr.read()).decode(errors="replace").strip()
                raise SandboxUnavailable(f"network: slirp4netns failed: {detail[-500:]}")
            try:
                os.write(block_fd, b"1")  # bwrap may run the command now
            except BrokenPipeError as exc:
                # bwrap gave up setting up the namespace meanwhile (see
                # runner.SETUP_ATTEMPTS): nothing ran.
                raise SandboxUnavailable(
                    "network: the sandbox exited while its network was set up", transient=True
                ) from exc
        except BaseException:
            uplink.close()
            raise
        finally:
            os.close(ready_read)
        return uplink

    def close(self) -> None:
        """Stop slirp4netns without waiting for it: its exit tears down a network device,
        which takes the kernel 10-20 ms that the call need not wait for (``settle``)."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)  # slirp4netns exits
            self._exit_fd = None
            task = asyncio.get_running_loop().create_task(self._reap(), name="slirp4netns-exit")
            _exiting.add(task)
            task.add_done_callback(_exiting.discard)

    async def _reap(self) -> None:
        try:
            await asyncio.wait_for(self.process.wait(), _EXIT_GRACE_SECONDS)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
            await self.process.wait()


_exiting: set[asyncio.Task[None]] = set()


async def settle() -> None:
    """Wait until every slirp4netns this process stopped has exited."""
    while _exiting:
        await asyncio.gather(*_exiting, return_exceptions=True)
