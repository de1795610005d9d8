"""Every operator command the README and docs/ spell out with its log location (inline, or a line
of a fenced block) is one the CLI accepts: argparse would answer a wrong form with exit 2.  A
mention of a command with an option only (`twophase recover --takeover`) is no full command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from twophase.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("status", "recover", "abort-lingering", "offsets")
INLINE = re.compile(rf"`(twophase (?:{'|'.join(COMMANDS)}) [^`]+)`")
LINE = re.compile(rf"twophase (?:{'|'.join(COMMANDS)}) ")


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
    return any(not a.startswith("-") for a in shlex.split(re.sub(r"\[[^\]]*\]", "", command))[2:])


def _documented() -> list[tuple[str, str]]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [(p.name, c) for p in pages for c in _commands(p.read_text()) if _full(c)]


def test_the_docs_spell_out_operator_commands():
    assert len(_documented()) >= 5


@pytest.mark.parametrize("page,command", _documented())
def test_a_documented_operator_command_parses(page, command):
    argv = shlex.split(re.sub(r"\[[^\]]*\]", "", command))[1:]  # [optional] parts dropped
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `{command}` is refused by the CLI (exit {e.code})")
