"""Skills: ``/skills`` per tenant, what the model is told, the skill tool, the sandbox.

Black-box through real engine processes, as ``test_agents.py``. The scripted
model answers ``{"echo_request": true}`` with the system prompt it got, makes
the tool calls a ``/script`` names, and answers a skill's sub-call with
``Skill <name> says: <input>``; after tool calls it answers with their
results.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import stat
import zipfile
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from holdfast_gateway.skillupload import read_archive
from holdfast_shared.skills import (
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_TOTAL_BYTES,
    SkillInvalid,
    SkillTooLarge,
    builtin_skills,
    new_skill,
)

from tests.processes import EngineProcesses
from tests.sse_client import Received, execute

pytestmark = pytest.mark.timeout(90)

ECHO = "/script " + json.dumps({"echo_request": True})
BUILTIN = ["code-review", "commit-message", "csv-summary"]


def script(*calls: dict[str, Any]) -> str:
    return "/script " + json.dumps({"text": "", "tool_calls": list(calls)})


def by_type(got: Received, event_type: str) -> list[dict[str, Any]]:
    return [e for e in got.events if e["type"] == event_type]


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def skill_md(name: str, description: str = "Does a test thing.", body: str = "Do it.") -> str:
    return f"---\nname: {name}\ndescription: {description}\n---\n\n{body}\n"


def zipped(entries: dict[str, bytes | str], *, compress: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compress) as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def with_symlink(name: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("SKILL.md", skill_md(name))
        link = zipfile.ZipInfo("scripts/passwd")
        link.create_system = 3  # Unix: the mode bits are in external_attr
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(link, "/etc/passwd")
    return buffer.getvalue()


def lying_header(name: str) -> bytes:
    """A zip bomb whose headers say its 50 MiB entry holds 100 bytes."""
    real = 50 * 1024 * 1024
    data = zipped({"SKILL.md": skill_md(name), "big.bin": b"\0" * real})
    claimed = (100).to_bytes(4, "little")
    # The uncompressed size, in the local header (offset 22) and the central
    # directory (offset 24), of the entry whose size is ``real``.
    out = bytearray(data)
    marker = real.to_bytes(4, "little")
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        start = 0
        while (start := out.find(signature, start)) >= 0:
            if out[start + offset : start + offset + 4] == marker:
                out[start + offset : start + offset + 4] = claimed
            start += 4
    assert bytes(out) != data
    return bytes(out)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as http:
        yield http


class Api:
    """``/skills`` (and ``/agents``, ``/execute``) as one tenant calls them."""

    def __init__(self, client: httpx.AsyncClient, base: str, key: str) -> None:
        self.client = client
        self.base = base
        self.key = key

    async def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return await self.client.request(
            method, f"{self.base}{path}", json=body, headers={"X-Engine-Key": self.key}
        )

    async def upload(self, data: bytes, content_type: str = "application/zip") -> httpx.Response:
        return await self.client.post(
            f"{self.base}/skills",
            content=data,
            headers={"X-Engine-Key": self.key, "content-type": content_type},
        )

    async def agent(self, skills: list[str], **fields: Any) -> str:
        name = unique("skilled")
        created = await self.call(
            "POST",
            "/agents",
            {
                "name": name,
                "description": "An agent with skills",
                "system_prompt": f"You are {name}.",
                "skills": skills,
                **fields,
            },
        )
        assert created.status_code == 201, created.text
        return name

    async def turn(self, message: str, **body: Any) -> Received:
        got = await execute(self.client, self.base, self.key, {"message": message, **body})
        assert got.status == 200, got.body
        assert got.events[-1]["phase"] == "completed", got.events[-3:]
        return got


@pytest.fixture
def main(engine: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient) -> Api:
    return Api(client, engine.url, api_keys["main"])


@pytest.fixture
def other(engine: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient) -> Api:
    return Api(client, engine.url, api_keys["other"])


# -- the format and the built-ins ---------------------------------------------------


def test_the_builtin_skills_ship_in_the_package() -> None:
    skills = builtin_skills()
    assert sorted(skills) == BUILTIN
    assert dict(skills["csv-summary"].files).keys() == {"scripts/summarize.py"}
    for skill in skills.values():
        assert skill.builtin and skill.description and len(skill.body) > 500
        # Prompt-only, or a script of the standard library alone.
        for content in skill.files.values():
            assert b"import" in content
    # The same content, the same digest (the runners' cache key).
    assert skills["code-review"].digest == builtin_skills()["code-review"].digest
    assert len({skill.digest for skill in skills.values()}) == len(skills)


def test_a_zip_is_read_without_trusting_its_headers() -> None:
    skill = read_archive(zipped({"x/SKILL.md": skill_md("x"), "x/scripts/a.py": "print(1)"}))
    assert skill.name == "x" and dict(skill.files) == {"scripts/a.py": b"print(1)"}
    with pytest.raises(SkillInvalid) as invalid:
        read_archive(lying_header("liar"))
    assert invalid.value.entry == "big.bin"
    with pytest.raises(SkillTooLarge):
        read_archive(zipped({"SKILL.md": skill_md("big"), "a.bin": b"\0" * (MAX_FILE_BYTES + 1)}))
    # bzip2 would decompress a whole read's input at once: refused outright.
    with pytest.raises(SkillInvalid, match="deflate"):
        read_archive(zipped({"SKILL.md": skill_md("bz")}, compress=zipfile.ZIP_BZIP2))


# -- /skills -----------------------------------------------------------------------------


async def test_the_list_has_the_builtins_and_the_tenants_own(main: Api, other: Api) -> None:
    name = unique("mine")
    assert (await main.upload(zipped({"SKILL.md": skill_md(name)}))).status_code == 201
    listed = await main.call("GET", "/skills")
    assert listed.status_code == 200
    skills = {s["name"]: s for s in listed.json()["skills"]}
    assert [s["name"] for s in listed.json()["skills"][:3]] == BUILTIN
    csv = skills["csv-summary"]
    assert csv["builtin"] is True and csv["files"] == ["scripts/summarize.py"]
    assert csv["size_bytes"] > 1000 and csv["created_at"] is None and "body" not in csv
    mine = skills[name]
    assert mine["builtin"] is False and mine["files"] == []
    assert mine["description"] == "Does a test thing." and isinstance(mine["created_at"], int)
    # The other tenant sees the built-ins, not this one.
    theirs = {s["name"] for s in (await other.call("GET", "/skills")).json()["skills"]}
    assert set(BUILTIN) <= theirs and name not in theirs


async def test_a_zip_upload_is_read_got_and_deleted(main: Api, other: Api) -> None:
    name = unique("zipped")
    script_text = "import sys\nprint('hello from', sys.argv[1:])\n"
    # The folder itself at the archive's root (as `zip -r name.zip name/` makes it).
    data = zipped(
        {
            f"{name}/": b"",
            f"{name}/SKILL.md": skill_md(name, "Greets.", "# Greeting\n\nRun the script."),
            f"{name}/scripts/hello.py": script_text,
            f"{name}/reference/notes.md": "Notes.",
            "__MACOSX/._SKILL.md": b"junk",
        }
    )
    created = await main.upload(data)
    assert created.status_code == 201, created.text
    skill = created.json()
    assert skill["name"] == name and skill["body"] == "# Greeting\n\nRun the script."
    assert skill["files"] == ["reference/notes.md", "scripts/hello.py"]
    assert skill["builtin"] is False and skill["size_bytes"] > len(script_text)

    shown = await main.call("GET", f"/skills/{name}")
    assert shown.status_code == 200 and shown.json() == skill
    # Another tenant: 404, as for a name nobody has.
    for method in ("GET", "DELETE"):
        hidden = await other.call(method, f"/skills/{name}")
        assert hidden.status_code == 404 and hidden.json()["error"] == "SKILL_NOT_FOUND"

    again = await main.upload(data)
    assert again.status_code == 409 and again.json()["error"] == "SKILL_EXISTS"

    deleted = await main.call("DELETE", f"/skills/{name}")
    assert deleted.status_code == 204 and deleted.content == b""
    for method in ("GET", "DELETE"):
        gone = await main.call(method, f"/skills/{name}")
        assert gone.status_code == 404 and gone.json()["error"] == "SKILL_NOT_FOUND"
        assert gone.json()["details"] == {"skill": name}


async def test_a_json_upload_makes_the_same_kind_of_skill(main: Api) -> None:
    name = unique("json")
    created = await main.call(
        "POST",
        "/skills",
        {
            "name": name,
            "description": "Counts words.",
            "body": "Run scripts/count.py on the file.",
            "files": {"scripts/count.py": "print(42)\n"},
        },
    )
    assert created.status_code == 201, created.text
    assert created.json()["files"] == ["scripts/count.py"]
    shown = (await main.call("GET", f"/skills/{name}")).json()
    assert shown["body"] == "Run scripts/count.py on the file."
    assert shown["description"] == "Counts words."


async def test_builtins_are_reserved(main: Api) -> None:
    taken = await main.upload(zipped({"SKILL.md": skill_md("csv-summary")}))
    assert taken.status_code == 409 and taken.json()["error"] == "SKILL_EXISTS"
    taken = await main.call(
        "POST", "/skills", {"name": "code-review", "description": "Mine", "body": "Mine."}
    )
    assert taken.status_code == 409 and taken.json()["error"] == "SKILL_EXISTS"
    kept = await main.call("DELETE", "/skills/code-review")
    assert kept.status_code == 409 and kept.json()["error"] == "SKILL_BUILTIN"
    shown = await main.call("GET", "/skills/code-review")
    assert shown.status_code == 200 and shown.json()["builtin"] is True
    assert shown.json()["body"] == builtin_skills()["code-review"].body


@pytest.mark.parametrize(
    ("entries", "entry", "said"),
    [
        ({"../evil.txt": "x"}, "../evil.txt", ".."),
        ({"scripts/../../evil.txt": "x"}, "scripts/../../evil.txt", ".."),
        ({"/etc/cron.d/evil": "x"}, "/etc/cron.d/evil", "absolute"),
        ({"a\\b.txt": "x"}, "a\\b.txt", "backslash"),
    ],
    ids=["dot-dot", "dot-dot-deeper", "absolute", "backslash"],
)
async def test_paths_out_of_the_folder_are_refused(
    main: Api, entries: dict[str, str], entry: str, said: str
) -> None:
    name = unique("hostile")
    refused = await main.upload(zipped({"SKILL.md": skill_md(name), **entries}))
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["error"] == "INVALID_REQUEST" and body["details"]["entry"] == entry
    assert body["details"]["errors"][0]["loc"] == ["body", entry]
    assert said in body["message"]
    assert (await main.call("GET", f"/skills/{name}")).status_code == 404


async def test_links_and_lying_headers_are_refused(main: Api) -> None:
    name = unique("linked")
    refused = await main.upload(with_symlink(name))
    assert refused.status_code == 422, refused.text
    assert refused.json()["details"]["entry"] == "scripts/passwd"
    assert "symbolic link" in refused.json()["message"]

    name = unique("liar")
    refused = await main.upload(lying_header(name))
    assert refused.status_code == 422, refused.text
    assert refused.json()["details"]["entry"] == "big.bin"
    assert (await main.call("GET", f"/skills/{name}")).status_code == 404


async def test_caps_are_413_counted_while_decompressing(main: Api) -> None:
    cases = {
        # 50 MiB of zeros deflate to 50 KiB: a zip bomb, refused by what it inflates to.
        "bomb": {"big.bin": b"\0" * (50 * 1024 * 1024)},
        "file": {"data.bin": os.urandom(MAX_FILE_BYTES + 1)},
        "total": {
            f"part{i}.bin": b"\0" * MAX_FILE_BYTES
            for i in range(MAX_TOTAL_BYTES // MAX_FILE_BYTES + 1)
        },
        "count": {f"f/{i}.txt": "x" for i in range(MAX_FILES + 1)},
    }
    for case, entries in cases.items():
        name = unique(case)
        refused = await main.upload(zipped({"SKILL.md": skill_md(name), **entries}))
        assert refused.status_code == 413, (case, refused.text)
        assert refused.json()["error"] == "SKILL_TOO_LARGE", case
        assert refused.json()["details"]["limit"] > 0
        assert (await main.call("GET", f"/skills/{name}")).status_code == 404
    # Past the gateway's body limit (8 MiB here): refused before it is read whole.
    over = await main.upload(os.urandom(9 * 1024 * 1024))
    assert over.status_code == 413 and over.json()["error"] == "BODY_TOO_LARGE"


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"name": "Bad Name", "description": "d", "body": "b"}, ["body", "name"]),
        ({"name": "-lead", "description": "d", "body": "b"}, ["body", "name"]),
        ({"name": "ok-name", "description": "", "body": "b"}, ["body", "description"]),
        ({"name": "ok-name", "description": "d" * 16_385, "body": "b"}, ["body", "description"]),
        ({"name": "ok-name", "description": "d", "body": ""}, ["body", "body"]),
        (
            {"name": "ok-name", "description": "d", "body": "b", "files": {"../x": "y"}},
            ["body", "files", "../x", "[key]"],
        ),
        (
            {"name": "ok-name", "description": "d", "body": "b", "files": {"a": "1", "a/b": "2"}},
            ["body", "files", "a"],
        ),
    ],
    ids=[
        "spaces",
        "leading-hyphen",
        "no-description",
        "long-description",
        "no-body",
        "dot-dot",
        "file-and-folder",
    ],
)
async def test_json_uploads_are_checked(main: Api, body: dict[str, Any], loc: list[str]) -> None:
    refused = await main.call("POST", "/skills", body)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"] == "INVALID_REQUEST"
    assert loc in [e["loc"] for e in refused.json()["details"]["errors"]]


async def test_a_long_description_is_cut_to_what_the_model_sees_with_a_warning(
    main: Api,
) -> None:
    """Anthropic's published claude-api skill has 1,068 characters of description:
    the format's 1,024 bound what the model sees, not what a skill may say."""
    long = ("Use this skill when building with the Claude API. " * 22).strip()
    assert len(long) > 1024
    name = unique("long")
    created = await main.upload(zipped({"SKILL.md": skill_md(name, long)}))
    assert created.status_code == 201, created.text
    (warning,) = created.json()["warnings"]
    assert f"{len(long)} characters" in warning
    seen = (await main.call("GET", f"/skills/{name}")).json()["description"]
    assert len(seen) <= 1024 and seen.endswith("…") and long.startswith(seen[:-1])
    # As JSON too.
    name = unique("long-json")
    sent = await main.call("POST", "/skills", {"name": name, "description": long, "body": "b"})
    assert sent.status_code == 201, sent.text
    assert len(sent.json()["description"]) <= 1024 and sent.json()["warnings"]


def test_the_size_cap_is_a_setting() -> None:
    """HOLDFAST_SKILL_MAX_BYTES reaches both readers (zip and JSON)."""
    fonts = {f"fonts/f{i}.ttf": os.urandom(900 * 1024) for i in range(6)}  # ~5.3 MiB
    archive = zipped({"SKILL.md": skill_md("canvas-like"), **fonts})
    with pytest.raises(SkillTooLarge):
        read_archive(archive)
    skill = read_archive(archive, max_total_bytes=8 * 1024 * 1024)
    assert len(skill.files) == 6
    with pytest.raises(SkillTooLarge):
        new_skill("canvas-like", "d", "b", fonts)
    assert new_skill("canvas-like", "d", "b", fonts, max_total_bytes=8 * 1024 * 1024).files


async def test_a_bad_skill_md_is_422_naming_it(main: Api) -> None:
    cases = {
        "no front matter": "Just instructions.",
        "unknown field": "---\nname: x-y\ndescription: d\ncolour: blue\n---\nBody.",
        "bad name": "---\nname: Not_Valid\ndescription: d\n---\nBody.",
        "no body": "---\nname: x-y\ndescription: d\n---\n",
    }
    for case, text in cases.items():
        refused = await main.upload(zipped({"SKILL.md": text}))
        assert refused.status_code == 422, (case, refused.text)
        assert refused.json()["details"]["entry"].startswith("SKILL.md"), case
    missing = await main.upload(zipped({"README.md": "no skill here"}))
    assert missing.status_code == 422 and "SKILL.md" in missing.json()["message"]
    not_zip = await main.upload(b"this is not a zip")
    assert not_zip.status_code == 422 and "zip" in not_zip.json()["message"]
    other_type = await main.upload(b"name: x", content_type="text/yaml")
    assert other_type.status_code == 415 and other_type.json()["error"] == "UNSUPPORTED_MEDIA_TYPE"
    unknown = await main.call("GET", "/skills/no-such-skill")
    assert unknown.status_code == 404 and unknown.json()["error"] == "SKILL_NOT_FOUND"


async def test_an_agent_may_name_its_tenants_skills_only(main: Api, other: Api) -> None:
    name = unique("own")
    assert (await main.upload(zipped({"SKILL.md": skill_md(name)}))).status_code == 201
    agent = await main.agent([name, "csv-summary"], tools=["read_file"])
    shown = (await main.call("GET", f"/agents/{agent}")).json()
    assert shown["skills"] == [name, "csv-summary"]
    assert "skill" in shown["tools"]  # skills are used through it

    refused = await other.call(
        "POST",
        "/agents",
        {"name": unique("thief"), "description": "d", "system_prompt": "p", "skills": [name]},
    )
    assert refused.status_code == 422
    assert refused.json()["details"]["errors"] == [
        {"loc": ["body", "skills", "0"], "msg": f"unknown skill {name!r}", "type": "unknown_skill"}
    ]


# -- in the loop ----------------------------------------------------------------------------


async def test_each_skill_is_disclosed_in_the_system_prompt(main: Api) -> None:
    name = unique("told")
    created = await main.call(
        "POST",
        "/skills",
        {"name": name, "description": "Explains the told thing.", "body": "The secret body."},
    )
    assert created.status_code == 201
    agent = await main.agent([name, "csv-summary"])
    echoed = json.loads((await main.turn(ECHO, agent=agent)).text)
    system = echoed["system"]
    assert system.startswith(f"You are {agent}.\n\n# Skills")
    assert f"- **{name}**: Explains the told thing." in system
    assert "- **csv-summary**: " + builtin_skills()["csv-summary"].description in system
    assert "`.skills/csv-summary/`" in system  # where its files are
    assert "The secret body." not in system  # the body is loaded by the tool only
    assert "skill" in echoed["tools"]
    # The same prompt on every call (prompt caches hold).
    again = json.loads((await main.turn(ECHO, agent=agent)).text)
    assert again["system"] == system

    # The default agent has built-in skills (prompt-only ones: nothing is mounted).
    default = json.loads((await main.turn(ECHO)).text)
    assert "- **code-review**" in default["system"] and "skill" in default["tools"]
    assert ".skills/" not in default["system"]


async def test_the_skill_tool_loads_the_body(main: Api) -> None:
    name = unique("loaded")
    body = "# Loaded\n\nStep one: do the thing.\n"
    assert (
        await main.call(
            "POST",
            "/skills",
            {"name": name, "description": "d", "body": body, "files": {"ref.md": "see"}},
        )
    ).status_code == 201
    agent = await main.agent([name])
    got = await main.turn(script({"name": "skill", "input": {"name": name}}), agent=agent)
    assert "hitl_request" not in got.types  # allowed by default
    result = by_type(got, "tool_result")[0]
    assert "error" not in result, result
    assert result["output"] == {
        "skill": name,
        "description": "d",
        "instructions": body,
        "files": ["ref.md"],
        "location": f".skills/{name}/",
    }

    # Only the agent's own skills: a built-in it lacks is unknown to it.
    got = await main.turn(
        script({"name": "skill", "input": {"name": "commit-message"}}), agent=agent
    )
    error = by_type(got, "tool_result")[0]["error"]
    assert error == f"unknown skill 'commit-message'; your skills are: {name}"


async def test_a_prompt_only_skill_answers_through_a_sub_call(main: Api) -> None:
    agent = await main.agent(["code-review"])
    got = await main.turn(
        script({"name": "skill", "input": {"name": "code-review", "input": "def f(): pass"}}),
        agent=agent,
    )
    result = by_type(got, "tool_result")[0]
    assert result["output"] == {
        "skill": "code-review",
        "answer": "Skill code-review says: def f(): pass",
    }
    # The sub-call is not streamed: between the call and its result, no output.
    start, end = got.types.index("tool_call"), got.types.index("tool_result")
    between = set(got.types[start + 1 : end])
    assert not between & {"content_block_start", "text_delta", "thinking_delta"}, between
    # Its tokens count in the turn's usage.
    assert got.events[-1]["phase"] == "completed"
    usage = by_type(got, "usage")[-1]
    assert usage["output_tokens"] >= len("Skill code-review says: def f(): pass".split())


async def test_a_script_skill_runs_in_the_sandbox_read_only(main: Api) -> None:
    own = unique("hello")
    assert (
        await main.call(
            "POST",
            "/skills",
            {
                "name": own,
                "description": "Says hello.",
                "body": "Run scripts/hello.py.",
                "files": {"scripts/hello.py": "import sys\nprint('hello', *sys.argv[1:])\n"},
            },
        )
    ).status_code == 201
    agent = await main.agent(
        ["csv-summary", own], permissions={"bash": "allow", "write_file": "allow"}
    )
    task = unique("script-skill")
    got = await main.turn(
        script(
            {
                "name": "write_file",
                "input": {
                    "path": "data.csv",
                    "content": "city,people\nOslo,700000\nBergen,290000\n",
                },
            },
            {
                "name": "bash",
                "input": {"command": "python3 .skills/csv-summary/scripts/summarize.py data.csv"},
            },
            {"name": "bash", "input": {"command": f"python3 .skills/{own}/scripts/hello.py world"}},
        ),
        agent=agent,
        task_id=task,
    )
    results = by_type(got, "tool_result")
    assert [r.get("error") for r in results] == [None, None, None], results
    summary = results[1]["output"]["stdout"]
    assert "data.csv: 2 rows, 2 columns" in summary
    assert "people: integer, 0 missing" in summary and "max 700000" in summary
    assert results[2]["output"]["stdout"] == "hello world\n"

    # Writes under .skills fail: the folders are mounted read-only.
    got = await main.turn(
        script(
            {"name": "bash", "input": {"command": "echo x > .skills/csv-summary/SKILL.md"}},
            {"name": "bash", "input": {"command": "touch .skills/planted"}},
            {"name": "write_file", "input": {"path": f".skills/{own}/x.py", "content": "x"}},
        ),
        agent=agent,
        task_id=task,
    )
    results = by_type(got, "tool_result")
    assert all("Read-only file system" in r["error"] for r in results), results

    # An agent without the skill does not see its folder, and the mount point
    # is gone from the task's workspace: its files are as its tools left them.
    plain = await main.agent([], permissions={"bash": "allow"})
    got = await main.turn(
        script({"name": "bash", "input": {"command": "ls -A; ls .skills/csv-summary"}}),
        agent=plain,
        task_id=task,
    )
    result = by_type(got, "tool_result")[0]
    assert result["output"]["stdout"] == "data.csv\n"
    assert "No such file or directory" in result["error"]

    # A .skills the task's tools made into a link is not followed: the call
    # is refused, saying why, and the link is left for the task to remove.
    got = await main.turn(
        script({"name": "bash", "input": {"command": "ln -s /etc .skills"}}),
        agent=plain,
        task_id=task,
    )
    assert "error" not in by_type(got, "tool_result")[0]
    got = await main.turn(
        script({"name": "bash", "input": {"command": "ls .skills/"}}), agent=agent, task_id=task
    )
    assert "'.skills' in the workspace is not a folder" in by_type(got, "tool_result")[0]["error"]
