"""The built-in tools, each run inside the task's sandbox.

``bash`` runs the command with ``bash -c``. The file tools run as a short
Python script inside the same sandbox rather than in this process: the
workspace is then the only tree they can see, so a symlink planted in the
workspace (even one swapped in while the tool runs) cannot lead them outside.
They open only regular files, and open them non-blocking first: a FIFO, socket or
device planted in the workspace is refused at once instead of holding the call (and
a tool slot) until its timeout.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from holdfast_shared.jobs import ToolOutcome

from holdfast_tool_runner.sandbox import Launchers, SandboxPolicy, SandboxResult, run_sandboxed

MAX_TIMEOUT_SECONDS = 600.0
# Files larger than this are refused by read_file (the model gets the reason).
MAX_READ_BYTES = 256 * 1024
SYSTEM_PYTHON = "/usr/bin/python3"

# Runs inside the sandbox with cwd = the workspace; reads one JSON request on
# stdin and prints one JSON answer. Paths are kept relative to the workspace.
_FILE_TOOL = r"""
import json, os, stat, sys
req = json.load(sys.stdin)
tool, args = req["tool"], req["input"]
root = os.getcwd()

def resolve(path):
    full = os.path.realpath(os.path.join(root, path or "."))
    if full != root and not full.startswith(root + os.sep):
        raise PermissionError(f"{path!r} is outside the workspace")
    return full

def answer(output=None, error=None):
    print(json.dumps({"output": output, "error": error}))
    sys.exit(0)

KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}

def refuse(shown, mode):
    kind = KINDS.get(stat.S_IFMT(mode), "not a regular file")
    answer(error=f"{shown} is {kind}; {tool} works on regular files only")

def open_regular(path, shown, flags):
    # Check before opening (a FIFO's open would wait for a writer), then open
    # non-blocking and check again: a file swapped for a FIFO in between cannot block.
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    else:
        if not stat.S_ISREG(mode):
            refuse(shown, mode)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == 6:  # ENXIO: a FIFO without a reader, or a socket
            refuse(shown, os.stat(path).st_mode)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        refuse(shown, st.st_mode)
    os.set_blocking(fd, True)
    return fd, st

def read_text(path, shown, limit=None):
    fd, st = open_regular(path, shown, os.O_RDONLY)
    if limit is not None and st.st_size > limit:
        os.close(fd)
        answer(error=f"{shown} is {st.st_size} bytes; read_file reads at most {limit}")
    with open(fd, encoding="utf-8", errors="replace" if limit is not None else "strict") as f:
        return f.read()

def write_text(path, shown, text):
    fd, _ = open_regular(path, shown, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)

try:
    if tool == "read_file":
        path = resolve(args["path"])
        content = read_text(path, args["path"], req["max_read"])
        answer({"path": args["path"], "content": content})
    elif tool == "write_file":
        path = resolve(args["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text(path, args["path"], args["content"])
        answer({"path": args["path"], "bytes_written": len(args["content"].encode())})
    elif tool == "edit_file":
        path = resolve(args["path"])
        text = read_text(path, args["path"])
        count = text.count(args["old_string"])
        if count != 1:
            where = args["path"]
            answer(error=f"old_string occurs {count} times in {where}; it must occur exactly once")
        write_text(path, args["path"], text.replace(args["old_string"], args["new_string"], 1))
        answer({"path": args["path"], "replaced": 1})
    elif tool == "list_dir":
        path = resolve(args.get("path", "."))
        entries = []
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            kind = "dir" if entry.is_dir(follow_symlinks=False) else (
                "symlink" if entry.is_symlink() else "file")
            size = entry.stat(follow_symlinks=False).st_size if kind == "file" else None
            entries.append({"name": entry.name, "type": kind, "size": size})
        answer({"path": args.get("path", "."), "entries": entries})
    else:
        answer(error=f"unknown tool {tool!r}")
except (OSError, ValueError, KeyError) as exc:
    answer(error=f"{type(exc).__name__}: {exc}")
"""


def _killed(result: SandboxResult, policy: SandboxPolicy) -> str:
    """Why the call was killed, in words the model can act on."""
    reason = result.killed_reason
    mib = 1024 * 1024
    if reason == "memory":
        return (
            f"killed: memory: the command's processes together went over the "
            f"{policy.memory_bytes // mib} MiB memory limit of a tool call"
        )
    if reason == "cpu_time":
        return "killed: cpu_time: the command's processes together used up the call's CPU time"
    if reason == "file_size":
        return f"killed: file_size: a file grew past {policy.file_size_bytes // mib} MiB"
    return f"killed: {reason}"


def _bash_outcome(result: SandboxResult, policy: SandboxPolicy) -> ToolOutcome:
    output = {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "truncated": result.truncated,
    }
    if result.timed_out:
        return ToolOutcome(output=output, error=f"timed out; {result.killed_reason or 'killed'}")
    if result.killed_reason:
        return ToolOutcome(output=output, error=_killed(result, policy))
    if result.exit_code != 0:
        tail = result.stderr.strip()[-2000:]
        detail = f": {tail}" if tail else ""
        return ToolOutcome(output=output, error=f"exit code {result.exit_code}{detail}")
    return ToolOutcome(output=output)


async def run_tool(
    tool: str,
    tool_input: dict[str, Any],
    workspace: Path,
    *,
    network: bool,
    timeout_seconds: float,
    launchers: Launchers | None = None,
    skill_mounts: tuple[tuple[Path, str], ...] = (),
    idempotency_key: str | None = None,
) -> ToolOutcome:
    """Run one built-in tool in the task's sandbox; failures come back as ``error``.

    ``launchers``: the runner's pool of processes spawned ahead of calls;
    ``skill_mounts``: skills' folders to mount read-only at ``.skills/<name>``;
    ``idempotency_key``: the call's, as ``HOLDFAST_IDEMPOTENCY_KEY`` in its
    environment (the same on every attempt, so a command can dedupe its effect).
    """
    timeout = max(0.1, min(timeout_seconds, MAX_TIMEOUT_SECONDS))
    policy = SandboxPolicy(
        workspace=workspace,
        network=network,
        timeout_seconds=timeout,
        skill_mounts=skill_mounts,
        env=(("HOLDFAST_IDEMPOTENCY_KEY", idempotency_key),) if idempotency_key else (),
    )
    if tool == "bash":
        command = tool_input.get("command")
        if not isinstance(command, str) or not command:
            return ToolOutcome(error="bash needs a non-empty 'command' string")
        if "\0" in command:
            return ToolOutcome(error="bash: the command contains a NUL character")
        return _bash_outcome(
            await run_sandboxed(["/bin/bash", "-c", command], policy, launchers=launchers),
            policy,
        )
    request = json.dumps({"tool": tool, "input": tool_input, "max_read": MAX_READ_BYTES})
    # The answer is JSON (escaping can double a file's size): never cut it.
    file_policy = replace(policy, max_output_bytes=4 * MAX_READ_BYTES + 64 * 1024)
    result = await run_sandboxed(
        [SYSTEM_PYTHON, "-I", "-S", "-c", _FILE_TOOL],
        file_policy,
        stdin=request.encode(),
        launchers=launchers,
    )
    if result.killed_reason:
        return ToolOutcome(error=f"{tool} failed: {_killed(result, file_policy)}")
    if result.exit_code != 0:
        return ToolOutcome(error=f"{tool} failed: {result.stderr.strip()[-2000:] or 'no output'}")
    try:
        answer = json.loads(result.stdout)
    except json.JSONDecodeError:
        return ToolOutcome(error=f"{tool} returned unreadable output")
    return ToolOutcome(output=answer.get("output"), error=answer.get("error"))
