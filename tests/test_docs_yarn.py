"""docs/clusters.md's YARN submission is the one the YARN kill test runs (issue 50): every option of
its ``spark-submit`` block is what ``tests.services.yarn.spark_submit_command`` builds (the venv's
path aside).  No YARN needed."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "clusters.md"


def _block() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("### YARN"):]
    body = re.search(r"```bash\n(.*?)```", section, re.S)
    assert body, "docs/clusters.md's YARN section has no bash block"
    return shlex.split(body.group(1).replace("\\\n", " "))


def _options(argv: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    flags, confs = {}, {}
    it = iter(argv[1:])
    for a in it:
        if a == "--conf":
            k, _, v = next(it).partition("=")
            confs[k] = v
        elif a.startswith("--"):
            flags[a] = next(it)
        else:
            break  # the application and its own arguments
    return flags, confs


def test_the_documented_yarn_submission_is_the_one_the_kill_test_runs():
    from tests.services.yarn import spark_submit_command

    doc_flags, doc_confs = _options(_block())
    built_flags, built_confs = _options(spark_submit_command("job.py"))
    assert doc_flags == {k: v for k, v in built_flags.items() if k in ("--master", "--deploy-mode", "--name")}
    assert len(doc_confs) >= 8
    for key, value in doc_confs.items():
        assert key in built_confs, f"docs/clusters.md sets {key}, which the test's submission does not"
        want = built_confs[key].replace(sys.executable, "/path/to/venv/bin/python")
        assert value == want, (key, value, want)
