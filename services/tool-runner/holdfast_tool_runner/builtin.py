"""The built-in tools, each run inside the task's sandbox.

``bash`` runs the command with ``bash -c``. The file tools run as a short
Python script inside the same sandbox rather than in this process: the
workspace is then the only tree they can see, so a symlink planted in the
workspace (even one swapped in while the tool runs) cannot lead them outside.
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
import json, os, sys
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

try:
    if tool == "read_file":
        path = resolve(args["path"])
        size = os.path.getsize(path)
        if size > req["max_read"]:
            limit = req["max_read"]
            answer(error=f"{args['path']} is {size} bytes; read_file reads at most {limit}")
        with open(path, encoding="utf-8", errors="replace") as f:
            answer({"path": args["path"], "content": f.read()})
    elif tool == "write_file":
        path = resolve(args["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(args["content"])
        answer({"path": args["path"], "bytes_written": len(args["content"].encode())})
    elif tool == "edit_file":
        path = resolve(args["path"])
        with open(path, encoding="utf-8") as f:
            text = f.read()
        count = text.count(args["old_string"])
        if count != 1:
            where = args["path"]
            answer(error=f"old_string occurs {count} times in {where}; it must occur exactly once")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(args["old_string"], args["new_string"], 1))
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


def _bash_outcome(result: SandboxResult) -> ToolOutcome:
    output = {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "truncated": result.truncated,
    }
    if result.timed_out:
        return ToolOutcome(output=output, error=f"timed out; {result.killed_reason or 'killed'}")
    if result.killed_reason:
        return ToolOutcome(output=output, error=f"killed: {result.killed_reason}")
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
) -> ToolOutcome:
    """Run one built-in tool in the task's sandbox; failures come back as ``error``.

    ``launchers``: the runner's pool of processes spawned ahead of calls.
    """
    timeout = max(0.1, min(timeout_seconds, MAX_TIMEOUT_SECONDS))
    policy = SandboxPolicy(workspace=workspace, network=network, timeout_seconds=timeout)
    if tool == "bash":
        command = tool_input.get("command")
        if not isinstance(command, str) or not command:
            return ToolOutcome(error="bash needs a non-empty 'command' string")
        if "\0" in command:
            return ToolOutcome(error="bash: the command contains a NUL character")
        return _bash_outcome(
            await run_sandboxed(["/bin/bash", "-c", command], policy, launchers=launchers)
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
    if result.exit_code != 0 or result.timed_out:
        return ToolOutcome(error=f"{tool} failed: {result.stderr.strip()[-2000:] or 'killed'}")
    try:
        answer = json.loads(result.stdout)
    except json.JSONDecodeError:
        return ToolOutcome(error=f"{tool} returned unreadable output")
    return ToolOutcome(output=answer.get("output"), error=answer.get("error"))
