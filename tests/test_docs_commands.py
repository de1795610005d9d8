"""Every operator command the README and docs/ spell out with its log location (inline, or a line
of a fenced block), as `twophase ...` or `python -m twophase ...`, is one the CLI accepts: argparse
would answer a wrong form with exit 2.  A mention of a command with an option only (`twophase
recover --takeover`) is no full command.  Each way of starting it the docs use is run for real
(`python -m twophase` once had no ``__main__`` and failed while its docs passed)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from twophase.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("status", "recover", "abort-lingering", "offsets")
INLINE = re.compile(rf"`((?:python -m )?twophase (?:{'|'.join(COMMANDS)}) [^`]+)`")
LINE = re.compile(rf"(?:python -m )?twophase (?:{'|'.join(COMMANDS)}) ")


def _commands(text: str) -> list[str]:
    found = INLINE.findall(text)
    fenced, block = False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                for cmd in "\n".join(block).replace("\\\n", " ").splitlines():
                    cmd = re.sub(r"\s+#\s.*$", "", cmd).strip()
                    if LINE.match(cmd):
                        found.append(cmd)
            fenced, block = not fenced, []
        elif fenced:
            block.append(line)
    return found


def _full(command: str) -> bool:
    """Names more than the command and its options: a log location, a placeholder for one, or an
    option's value."""
    return any(not a.startswith("-") for a in _argv(command)[1:])


def _argv(command: str) -> list[str]:
    """The CLI's arguments: the command without its program (``twophase`` or ``python -m twophase``)
    and without its ``[optional]`` parts."""
    words = shlex.split(re.sub(r"\[[^\]]*\]", "", command))
    return words[3:] if words[:2] == ["python", "-m"] else words[1:]


def _documented() -> list[tuple[str, str]]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [(p.name, c) for p in pages for c in _commands(p.read_text()) if _full(c)]


def test_the_docs_spell_out_operator_commands():
    assert len(_documented()) >= 5


@pytest.mark.parametrize("page,command", _documented())
def test_a_documented_operator_command_parses(page, command):
    argv = _argv(command)
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `{command}` is refused by the CLI (exit {e.code})")


MENTION = re.compile(rf"(python -m )?\btwophase ({'|'.join(COMMANDS)})\b")


def _mentions() -> set[tuple[str, str]]:
    """(program, command) of every mention of an operator command in the README and docs/, with
    or without a log location (`python -m twophase abort-lingering` in a sentence counts)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return {("python -m twophase" if m.group(1) else "twophase", m.group(2))
            for p in pages for m in MENTION.finditer(p.read_text())}


def test_the_docs_mention_both_ways_of_starting_the_cli():
    assert {program for program, _ in _mentions()} == {"twophase", "python -m twophase"}


@pytest.mark.parametrize("program,command", sorted(_mentions()))
def test_each_way_the_docs_start_a_command_runs(program, command):
    """Run for real, not parsed: the console script from the venv, the module by this Python."""
    start = ([sys.executable, "-m", "twophase"] if program.startswith("python")
             else [str(Path(sys.executable).with_name("twophase"))])
    p = subprocess.run([*start, command, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "usage:" in p.stdout, f"`{program} {command} --help`: {p.stderr[-500:]}"
