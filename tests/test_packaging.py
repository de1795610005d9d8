"""The wheel as a user installs it: each extra alone in a fresh venv enables its module, and
without the extra the module says which ``pip install 'twophase[...]'`` it needs.

Builds the wheel once, then one venv per extra plus one without extras.  The venvs are made
without pip (``python -m venv --without-pip``) and filled by this interpreter's pip
(``pip --python``), with pip's cache: a few seconds per venv once the cache is warm; the
``spark`` extra (pyspark, ~400 MB) dominates.  Timings are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parent.parent

#: extra -> code that must run once the extra alone is installed.
WITH_EXTRA = {
    "kafka": "import confluent_kafka, kafka, twophase.sinks.kafka",
    "postgres": "import psycopg2, twophase.sinks.postgres",
    "s3": "import twophase.storage.s3",
    "hdfs": "import twophase.storage.hdfs",
    "testing": "import twophase.testing; twophase.testing.run_sink_conformance",
    # pyspark[sql] is what mapInArrow needs (pandas, pyarrow): run one batch through it.
    "spark": textwrap.dedent("""
        import sys, tempfile
        from twophase.coordinator import Coordinator
        from twophase.sinks.files import FileSink
        from twophase.spark import local_session
        spark = local_session("local[1]")
        d = tempfile.mkdtemp()
        progress = Coordinator(FileSink(d + "/out", format="jsonl"), log_location=d + "/log",
                               name="packaging").write(spark.range(3), batch_id=0)
        assert progress["rows"] == 3, progress
        # The data sources by name, never registered: Spark found the wheel's pyspark_* modules.
        (spark.range(5).selectExpr("CAST(id AS STRING) AS id").write.format("twophase-files")
         .mode("append").option("twophase.logLocation", d + "/dslog").option("twophase.batchId", "0")
         .save(d + "/ds"))
        import pyarrow.dataset as pads
        assert sorted(pads.dataset(d + "/ds", format="parquet").to_table().column("id").to_pylist()) == list("01234")
        spark.stop()
    """),
}

#: extra -> code that must fail, without the extra, with that extra's install hint.
WITHOUT_EXTRA = {
    "kafka": "from twophase.sinks.kafka import KafkaSink; KafkaSink('localhost:9', 't', 'tp').open()",
    "postgres": "from twophase.sinks.postgres import PostgresSink; "
                "PostgresSink('postgresql://u@localhost:1/db', 't').open()",
    "s3": "import twophase.storage.s3",
    "hdfs": "import twophase.storage.hdfs",
    "testing": "import twophase.testing",
    "spark": "from twophase.spark import local_session; local_session()",
}


def _say(msg: str) -> None:
    print(f"[packaging] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def _venv(where: Path, wheel: Path, extra: str | None) -> Path:
    """A fresh venv with ``wheel[extra]`` installed; returns its python."""
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)], cwd=where.parent)
    py = where / "bin" / "python"
    spec = f"twophase[{extra}] @ {wheel.as_uri()}" if extra else f"twophase @ {wheel.as_uri()}"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
          "--disable-pip-version-check", spec], cwd=where.parent, timeout=900)
    _say(f"venv with {extra or 'no extra'}: {time.monotonic() - t0:.1f}s")
    return py


def _env(py: Path) -> dict[str, str]:
    """The environment of a user of that venv: none of this venv's variables leak in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    from tests.cluster import wheel_build_lock

    out = tmp_path_factory.mktemp("wheel")
    t0 = time.monotonic()
    # setuptools builds in the checkout (build/): one build of it at a time (tests/cluster.py).
    with wheel_build_lock():
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
              str(REPO), "-w", str(out)], cwd=out)
    (whl,) = out.glob("twophase-*.whl")
    _say(f"wheel {whl.name}: {time.monotonic() - t0:.1f}s")
    return whl


def test_each_extra_alone_enables_its_module_and_its_absence_names_the_extra(wheel, tmp_path):
    t0 = time.monotonic()
    extras = list(WITH_EXTRA)
    # Two at a time: pip mostly waits on unpacking and the disk; the machine has 2 cores.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {x: pool.submit(_venv, tmp_path / (x or "bare"), wheel, x) for x in [None, *extras]}
        venvs = {x: f.result() for x, f in futures.items()}

    # Without extras: the base package imports, and each optional module names its extra.
    bare = venvs[None]
    _run([str(bare), "-c", "import twophase, twophase.sinks.files, twophase.coordinator"], cwd=tmp_path,
         env=_env(bare))
    for extra, code in WITHOUT_EXTRA.items():
        p = subprocess.run([str(bare), "-c", code], cwd=tmp_path, env=_env(bare), capture_output=True,
                           text=True, timeout=120)
        hint = f"pip install 'twophase[{extra}]'"
        assert p.returncode != 0 and "MissingDependencyError" in p.stderr and hint in p.stderr, \
            (extra, p.stderr[-2000:])

    # Each extra alone: its module works.
    for extra, code in WITH_EXTRA.items():
        t1 = time.monotonic()
        _run([str(venvs[extra]), "-c", code], cwd=tmp_path, env=_env(venvs[extra]), timeout=300)
        _say(f"{extra}: its module works ({time.monotonic() - t1:.1f}s)")
    _say(f"all extras: {time.monotonic() - t0:.1f}s")
