"""The documented operator commands, run as written against a real log (issue 46).

The "Operator tools" block of docs/operations.md (README.md's until issue 47) is read, its
placeholders (``CHECKPOINT``, ``CFG``) filled in and each command run through a shell with the
installed ``twophase`` command, in the order an operator meets them after a crash: a decided batch
and an undecided one are pending.  What each
command's comment promises is checked: ``status`` lists the states, ``offsets`` refuses while the
decided batch is pending (its end would have a new query write it again), ``abort-lingering``
refuses too (it would abort a decided batch's transactions), ``recover`` commits it and aborts the
leftover, then ``offsets`` prints the committed end and ``abort-lingering`` finds nothing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from tests.test_cli import pending_log

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documented_operator_commands() -> dict[str, str]:
    """``{"status": "twophase status CHECKPOINT/twophase [--json] [--sink-config CFG]", ...}``."""
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        text = f.read()
    section = text.split("\n## Operator tools\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "docs/operations.md's Operator tools section has no bash block"
    out = {}
    for line in block.group(1).splitlines():
        cmd = line.split("#", 1)[0].strip()
        if cmd:
            out[cmd.split()[1]] = cmd
    return out


def _variants(cmd: str) -> list[str]:
    """The command without its optional ``[...]`` parts, then with each of them."""
    optional = re.findall(r"\s*\[([^\]]+)\]", cmd)
    bare = re.sub(r"\s*\[[^\]]+\]", "", cmd)
    return [bare] + [f"{bare} {o}" for o in optional]


def test_the_readmes_operator_commands_as_written(tmp_path):
    commands = documented_operator_commands()
    assert set(commands) == {"status", "recover", "abort-lingering", "offsets"}, commands
    checkpoint = tmp_path / "ck"
    out, sink = pending_log(tmp_path, log_dir=checkpoint / "twophase")
    cfg = json.dumps(sink.to_config())
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))

    def run(cmd: str) -> subprocess.CompletedProcess:
        line = cmd.replace("CHECKPOINT", shlex.quote(str(checkpoint))).replace("CFG", shlex.quote(cfg))
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=120)

    def visible() -> list[str]:
        return sorted(p.name for p in out.iterdir() if not p.name.startswith("_"))

    # status, in every form the page gives: read-only, the decided batch shown as such.
    for cmd in _variants(commands["status"]):
        r = run(cmd)
        assert r.returncode == 0, (cmd, r.stderr)
        if "--json" in cmd:
            states = {b["batch_id"]: b["state"] for b in json.loads(r.stdout)["batches"]}
            assert states == {0: "committed", 1: "prepared", 2: "intent"}
        else:
            assert "decided, NOT yet fully committed" in r.stdout, r.stdout
    # offsets and abort-lingering refuse while batch 1 is decided; nothing changes.
    r = run(commands["offsets"])
    assert r.returncode == 1 and r.stdout == "" and "twophase recover" in r.stderr, (r.stdout, r.stderr)
    r = run(commands["abort-lingering"])
    assert r.returncode == 2 and "twophase recover" in r.stderr, r.stderr
    assert visible() == ["part-00000000-00000-app.parquet"]
    # recover commits batch 1 and aborts batch 2's leftover.
    r = run(commands["recover"])
    assert r.returncode == 0, r.stderr
    assert "committed batches: [1]" in r.stdout and "batch 2: 1" in r.stdout, r.stdout
    assert visible() == ["part-00000000-00000-app.parquet", "part-00000001-00000-app.parquet",
                         "part-00000001-00001-app.parquet"]
    # Now offsets prints where the committed results end (batch 1), in startingOffsets form.
    r = run(commands["offsets"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"events": {"0": 20}}
    r = run(commands["abort-lingering"])
    assert r.returncode == 0 and "aborted lingering transactions: none" in r.stdout, (r.stdout, r.stderr)
    assert not [p for p in (out / "_twophase").rglob("*") if p.is_file()]
