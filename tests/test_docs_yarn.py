"""docs/clusters.md's YARN submissions are the ones the YARN kill tests run (issue 50): every
option of each ``spark-submit`` block of its YARN section (cluster mode, client mode, cluster mode
with the packed venv) is what ``tests.services.yarn.spark_submit_command`` (for the packed venv
``tests.test_yarn.packed_submit_command``) builds for the same mode, attempts, staging dir and
environment (the venv's path aside); the packing commands there are the ones the HDFS AM kill
test runs.  No YARN needed."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "clusters.md"
#: Variables spark_submit_command sets for every job (the rest of a block's executorEnv is the job's).
BUILT_IN_ENV = ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")


def _blocks() -> list[list[str]]:
    text = DOC.read_text()
    section = text[text.index("### YARN"):]
    section = section[:section.index("\n## ")]
    bodies = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [shlex.split(b.replace("\\\n", " ")) for b in bodies if "spark-submit" in b]


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


def test_the_documented_yarn_submissions_are_the_ones_the_kill_tests_run():
    from tests.services.yarn import spark_submit_command
    from tests.test_yarn import packed_submit_command

    blocks = _blocks()
    assert [(_options(b)[0].get("--deploy-mode"), _options(b)[0].get("--archives")) for b in blocks] == [
        ("cluster", None), ("client", None), ("cluster", "env.tar.gz#env")]
    for block in blocks:
        doc_flags, doc_confs = _options(block)
        env = {k.removeprefix("spark.executorEnv."): v for k, v in doc_confs.items()
               if k.startswith("spark.executorEnv.") and k.removeprefix("spark.executorEnv.") not in BUILT_IN_ENV}
        opts = dict(deploy_mode=doc_flags["--deploy-mode"], max_app_attempts=int(doc_confs["spark.yarn.maxAppAttempts"]),
                    staging_dir=doc_confs.get("spark.yarn.stagingDir"), env=env)
        if "--archives" in doc_flags:
            built = packed_submit_command("env.tar.gz#env", "job.py", **opts)
        else:
            built = spark_submit_command("job.py", **opts)
        built_flags, built_confs = _options(built)
        assert doc_flags == {k: v for k, v in built_flags.items()
                             if k in ("--master", "--deploy-mode", "--name", "--archives")}
        assert len(doc_confs) >= 7
        for key, value in doc_confs.items():
            assert key in built_confs, f"docs/clusters.md sets {key}, which the test's submission does not"
            want = built_confs[key].replace(sys.executable, "/path/to/venv/bin/python")
            assert value == want, (key, value, want)
        # What the tests pass the job's driver in cluster mode reaches it as appMasterEnv, documented too.
        for k in env:
            if doc_flags["--deploy-mode"] == "cluster":
                assert f"spark.yarn.appMasterEnv.{k}" in doc_confs, k
            else:
                assert f"spark.yarn.appMasterEnv.{k}" not in built_confs, k
    # The packed submission's Pythons are the archive's, for the AM's driver and the executors.
    packed = _options(blocks[2])[1]
    assert {k: v for k, v in packed.items() if "PYTHON" in k.upper()} == {
        "spark.pyspark.python": "./env/bin/python", "spark.yarn.appMasterEnv.PYSPARK_PYTHON": "./env/bin/python",
        "spark.executorEnv.PYSPARK_PYTHON": "./env/bin/python"}


def test_the_documented_yarn_packing_is_what_the_hdfs_kill_test_packs():
    """The YARN section's packing block: the wheel, a venv with twophase, pandas (the AM's driver)
    and the HDFS client, packed to the env.tar.gz the packed submission ships (the HDFS AM kill
    test runs exactly these commands: tests.test_yarn.yarn_pack_commands)."""
    from tests.packing import WHEEL_COMMAND
    from tests.test_yarn import yarn_pack_commands

    assert yarn_pack_commands() == [
        WHEEL_COMMAND, "python -m venv --without-pip env",
        "pip --python env/bin/python install --no-compile dist/twophase-*.whl venv-pack pandas hdfs",
        "env/bin/venv-pack -p env -o env.tar.gz --compress-level 1"]


def test_the_readmes_yarn_line_is_the_documented_cluster_mode_submission():
    """The README shows the cluster-mode line of docs/clusters.md (which the test above checks against
    what the kill tests submit), character for character."""
    readme = (DOC.parent.parent / "README.md").read_text()
    section = readme[readme.index("## On YARN"):]
    shown = re.findall(r"```bash\n(.*?)```", section[:section.index("\n## ", 3)], re.S)
    cluster = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S) if "--deploy-mode cluster" in b]
    assert shown and cluster and shown[0] == cluster[0]
