"""Issue 17: twophase reaches executors in a packed virtualenv shipped as ``spark.archives``.

docs/clusters.md, "On a cluster" (the README's until issue 47), gives the commands: a venv with
twophase's wheel (pyarrow, fsspec) and venv-pack, packed to ``env.tar.gz``, then ``spark-submit
--archives env.tar.gz#env --conf spark.pyspark.python=./env/bin/python`` with the driver on its
own Python.  The cluster tests
below read those commands from that page and run them on the test cluster (adding only the
cluster's sizing confs and a smaller input on a tmp path every worker sees): the executors run
``./env/bin/python`` unpacked from the archive, which has no other way to twophase, and every
input line is in the output exactly once.  Without ``--archives`` the same job stops at the
coordinator's executor probe, before anything is logged, with an error naming the archive.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cluster, packing

REPO = cluster.REPO
SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
#: What the test cluster adds to the documented spark-submit (as the --py-files test does).
SIZING = ["--conf", "spark.executor.cores=1", "--conf", "spark.executor.memory=512m",
          "--conf", "spark.cores.max=2", "--conf", "spark.driver.host=127.0.0.1"]
ARCHIVE_ARGS = ["--archives", "env.tar.gz#env"]


def readme_archive_commands() -> list[str]:
    """The packed-environment commands of docs/clusters.md ("On a cluster", the bash block that has
    ``--archives``)."""
    return packing.doc_commands("## On a cluster", "--archives")


def _split(commands: list[str]) -> tuple[list[str], list[str]]:
    """(the commands that build env.tar.gz, the spark-submit command's words)."""
    *build, submit = commands
    words = shlex.split(submit)
    assert words[:2] == ["PYTHONPATH=$PWD", "spark-submit"], words
    return build, words[2:]


@pytest.fixture(scope="session")
def packed_env(tmp_path_factory) -> Path:
    """A directory with ``env.tar.gz`` built by the documented commands (once per session): the
    wheel of this checkout, then a venv without pip holding it, its dependencies and venv-pack
    (pip's own cache makes this a few seconds), packed."""
    work = tmp_path_factory.mktemp("packed-env")
    build, _ = _split(readme_archive_commands())
    return packing.pack(work, build).parent


def _submit(words: list[str], data: Path, archive_dir: Path | None) -> subprocess.CompletedProcess:
    """Run the documented spark-submit (its words after ``spark-submit``) from the repository, the
    archive taken from ``archive_dir``, ``/shared/`` paths in ``data``, the sizing confs added."""
    args = []
    for w in words:
        if w == "env.tar.gz#env":
            assert archive_dir is not None
            w = f"{archive_dir / 'env.tar.gz'}#env"
        args.append(w.replace("/shared/", f"{data}/"))
    master = args.index("--master")
    cmd = ["spark-submit", *args[:master + 2], *SIZING, *args[master + 2:]]
    env = dict(packing.tool_env(), PYTHONPATH=str(REPO), SPARK_LOCAL_IP="127.0.0.1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _generate(data: Path) -> list[str]:
    ex = [sys.executable, "-m", "examples.file_copy"]
    subprocess.run([*ex, "generate", "--input", str(data / "fc-in"), "--files", "3",
                    "--lines", "200"], cwd=REPO, check=True, timeout=120, capture_output=True)
    return ex


def _our_app(started_ms: float) -> dict:
    from tests.services.spark_cluster import master_status

    apps = [a for a in master_status()["completedapps"]
            if a["name"] == "file-copy" and a["starttime"] >= started_ms]
    assert len(apps) == 1, master_status()["completedapps"][:3]
    return apps[0]


@pytest.mark.services
@pytest.mark.cluster
def test_the_readme_packed_environment_runs_on_the_cluster(spark_cluster_service, packed_env,
                                                           tmp_path):
    from tests.services.spark_cluster import SERVICE, WORKERS

    _, words = _split(readme_archive_commands())
    assert words[words.index("--archives") + 1] == "env.tar.gz#env"
    assert "spark.pyspark.python=./env/bin/python" in words
    data = tmp_path / "shared"
    ex = _generate(data)
    started_ms = time.time() * 1000
    r = _submit(words, data, packed_env)
    assert r.returncode == 0, r.stderr[-4000:]
    app = _our_app(started_ms)
    assert app["state"] == "FINISHED", app
    try:
        # Each executor unpacked the archive as ./env in its working directory and ran its Python:
        # that interpreter finds twophase there and sees no other site-packages (the workers' own
        # Python, and this venv's editable twophase, are not on its path).
        exec_dirs = [d for w in WORKERS for d in sorted((SERVICE.work_dir(w) / app["id"]).iterdir())]
        assert len(exec_dirs) >= 2, exec_dirs
        assert {d.parent.parent.parent.name for d in exec_dirs} == {w.name for w in WORKERS}
        probe = ("import json, sys, twophase, pyarrow; "
                 "print(json.dumps([twophase.__file__, pyarrow.__file__, sys.path]))")
        for d in exec_dirs:
            env_dir = d / "env"
            out = subprocess.run([str(env_dir / "bin" / "python"), "-I", "-c", probe], cwd=d,
                                 capture_output=True, text=True, timeout=60, check=True).stdout
            init, pa, path = json.loads(out)
            assert init == str(env_dir / SITE / "twophase" / "__init__.py"), init
            assert pa.startswith(str(env_dir) + "/"), pa
            assert [p for p in path if "site-packages" in p] == [
                str(env_dir / SITE)], path
            no_pyspark = subprocess.run([str(env_dir / "bin" / "python"), "-I", "-c", "import pyspark"],
                                        cwd=d, capture_output=True, timeout=60)
            assert no_pyspark.returncode != 0  # the executors' PYTHONPATH brings Spark's own
    finally:
        for w in WORKERS:  # ~170 MB unpacked per executor
            shutil.rmtree(SERVICE.work_dir(w) / app["id"], ignore_errors=True)
    v = subprocess.run([*ex, "verify", "--input", str(data / "fc-in"), "--output",
                        str(data / "fc-out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, (v.stdout, v.stderr)
    result = json.loads(v.stdout)
    assert result["records_in"] == result["records_out"] == 600 and result["exactly_once"], result


@pytest.mark.services
@pytest.mark.cluster
def test_the_readme_job_without_the_archive_is_refused(spark_cluster_service, tmp_path):
    """The documented spark-submit without ``--archives``: ``./env/bin/python`` does not exist on
    the executors, and the coordinator's probe says so before the first batch logs anything."""
    _, words = _split(readme_archive_commands())
    i = words.index("--archives")
    assert words[i:i + 2] == ARCHIVE_ARGS
    words = words[:i] + words[i + 2:]
    data = tmp_path / "shared"
    _generate(data)
    started_ms = time.time() * 1000
    r = _submit(words, data, None)
    assert r.returncode != 0
    assert _our_app(started_ms)["state"] == "FINISHED"  # it ran on the cluster, then stopped
    err = next((line for line in r.stderr.splitlines()
                if line.startswith("twophase.errors.ConfigurationError")), None)
    assert err is not None, r.stderr[-4000:]
    assert "could not run Python on the executors" in err, err
    assert 'Cannot run program "./env/bin/python"' in err, err
    assert "spark.pyspark.python=./env/bin/python" in err and "spark.archives is not set" in err, err
    assert "--archives env.tar.gz#env" in err and "Nothing was written" in err, err
    assert not list((data / "fc-out").glob("*.jsonl"))
    assert not (data / "fc-ck" / "twophase").exists()


# --------------------------------------------------------------------------- the probe's words

def test_the_probe_names_the_archive_for_a_relative_executor_python():
    from twophase.coordinator.coordinator import _executor_python_hint, _job_failure

    py4j = ("An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 "
            "failed 4 times, most recent failure: Lost task 0.3 (TID 3) (127.0.0.1 executor 0): "
            'java.io.IOException: Cannot run program "./env/bin/python": error=2, No such file or '
            "directory\n\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)\n")
    assert _job_failure(Exception(py4j)) == (
        'Cannot run program "./env/bin/python": error=2, No such file or directory')
    other = "An error occurred while calling x.\n: org.apache.spark.SparkException: Job aborted\n"
    assert _job_failure(Exception(other)) == "org.apache.spark.SparkException: Job aborted"
    assert _job_failure(Exception("")) == "Exception"

    hint = _executor_python_hint("./env/bin/python", None)
    assert "spark.pyspark.python=./env/bin/python" in hint and "spark.archives is not set" in hint
    assert "--archives env.tar.gz#env" in hint
    assert "spark.archives is '/x/e.tgz#e'" in _executor_python_hint("./env/bin/python", "/x/e.tgz#e")
    absolute = _executor_python_hint("/opt/py/bin/python", None)
    assert "/opt/py/bin/python: install it on every host" in absolute
