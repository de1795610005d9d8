"""Packed virtualenvs for ``--archives env.tar.gz#env``, built by the commands docs/clusters.md shows.

The standalone cluster test (tests/test_cluster_archives.py, "## On a cluster") and the YARN kill
test (tests/test_yarn.py, "### YARN") each read their bash block from docs/clusters.md and run it
here: the wheel of this checkout (``pip wheel --no-deps . -w dist``, as :func:`tests.cluster.build_wheel`
builds it), then the block's commands that make ``env.tar.gz``, in a shell whose ``python``/``pip``
are this venv's and with no PYSPARK_* variable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests import cluster

DOC = cluster.REPO / "docs" / "clusters.md"
WHEEL_COMMAND = "pip wheel --no-deps . -w dist"  #: what cluster.build_wheel runs


def doc_commands(heading: str, needle: str) -> list[str]:
    """The commands of the one bash block under ``heading`` (a line of docs/clusters.md, up to the
    next heading of any level) that contains ``needle``: one string per command, continuation
    lines joined, comments dropped."""
    section = DOC.read_text().split(f"\n{heading}\n", 1)[1]
    section = re.split(r"\n#+ ", section, maxsplit=1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if needle in b]
    assert len(blocks) == 1, f"docs/clusters.md {heading!r} has {len(blocks)} bash blocks with {needle!r}"
    commands = []
    for cmd in blocks[0].replace("\\\n", " ").splitlines():
        cmd = re.sub(r"\s+#\s.*$", "", cmd)  # a comment (env.tar.gz#env is not one)
        if cmd.strip():
            commands.append(" ".join(cmd.split()))
    return commands


def tool_env() -> dict[str, str]:
    """This venv's ``python``/``pip``/``spark-submit`` first on the PATH (the documented shell);
    no PYSPARK_* variable, so only the command's confs choose the Pythons."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYSPARK_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


_WHEELS: list[Path] = []  #: the wheel of this checkout, once built in this test process


def _wheel(dist: Path) -> None:
    """Put the wheel of this checkout in ``dist``: built by the first packing of the test process,
    copied by the next (the standalone and the YARN packing share it)."""
    if _WHEELS and _WHEELS[0].exists():
        dist.mkdir(parents=True, exist_ok=True)
        shutil.copy2(_WHEELS[0], dist)
    else:
        _WHEELS[:] = [cluster.build_wheel(dist)]


def pack(work: Path, build: list[str]) -> Path:
    """Run ``build`` (the documented commands, the wheel's first) in ``work``; returns
    ``work/env.tar.gz``.  Prints each command's duration (pip's own cache makes the installs quick
    after the first)."""
    assert build[0] == WHEEL_COMMAND, build
    t0 = time.monotonic()
    _wheel(work / "dist")
    print(f"{WHEEL_COMMAND}: {time.monotonic() - t0:.1f}s")
    for cmd in build[1:]:
        t0 = time.monotonic()
        r = subprocess.run(["bash", "-c", cmd], cwd=work, env=tool_env(), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
        print(f"{cmd}: {time.monotonic() - t0:.1f}s")
    archive = work / "env.tar.gz"
    assert archive.stat().st_size > 0
    return archive
