"""Faster start-up for the Spark drivers the tests launch: a class-data-sharing archive of the
classes a driver loads, made once per Spark and Java pair, and the client (C1) compiler only.

The kill tests start a fresh driver JVM for every fault (a few hundred per run of the suite), and
on a 2-core machine each spent about 8 s in start-up; with the archive and C1 about 3.5 s.  The
options go to ``SPARK_SUBMIT_OPTS``, which spark-submit adds to the driver's JVM only (not to
its own launcher, executors on a cluster, or the servers).  A driver whose class path differs
from the archive's (``spark.driver.extraClassPath``) starts as before: the JVM skips an archive
that does not match, silently.  Nothing here changes what a test checks; it is a test harness
setting, off with ``TWOPHASE_FAST_JVM=0``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path.home() / ".cache" / "twophase" / "cds"

#: What a warm-up driver does, so that the classes of a typical test driver are in the archive:
#: a Python task (mapInArrow), Parquet and JSON written and read, a streaming query's batch.
_WARM_UP = r"""
import sys, tempfile
from twophase.spark import local_session
spark = local_session("local[2]", app_name="twophase-cds-warm-up")
d = tempfile.mkdtemp()
def f(batches):
    yield from batches
df = spark.range(0, 1000, 1, 2).mapInArrow(f, "id LONG").selectExpr("id", "CAST(id AS STRING) AS s")
df.collect()
df.write.parquet(d + "/p"); df.write.json(d + "/j")
spark.read.parquet(d + "/p").count(); spark.read.json(d + "/j").count()
q = (spark.readStream.schema("id LONG, s STRING").json(d + "/j").writeStream
     .foreachBatch(lambda b, i: b.count()).option("checkpointLocation", d + "/ck")
     .trigger(availableNow=True).start())
q.awaitTermination(120)
spark.stop()
"""


def _key() -> str:
    import pyspark

    java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60).stderr
    return hashlib.sha256(f"{pyspark.__version__}\n{java}\n{sys.executable}".encode()).hexdigest()[:16]


def archive() -> Path | None:
    """The archive for this Spark and Java, made now if missing (about 20 s, once); None if the
    JVM cannot make one (the drivers then start as before)."""
    path = CACHE / f"spark-driver-{_key()}.jsa"
    if path.exists():
        with contextlib.suppress(OSError):
            os.utime(path)  # in use: the last to be evicted
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=CACHE, suffix=".jsa.tmp")
    os.close(fd)
    os.unlink(tmp)  # the JVM creates it at exit
    env = dict(os.environ, SPARK_SUBMIT_OPTS=f"-XX:ArchiveClassesAtExit={tmp} -Xlog:cds*=off",
               PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).resolve().parent.parent),
                                                      os.environ.get("PYTHONPATH")) if p))
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", _WARM_UP], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        r = None
    if r is None or r.returncode != 0 or not os.path.exists(tmp):
        sys.stderr.write(f"[fastjvm] no class-data archive made ({'timeout' if r is None else r.returncode}); "
                         "drivers start without one\n" + (r.stderr[-2000:] if r is not None else ""))
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    shutil.move(tmp, path)
    _evict(keep=path)
    sys.stderr.write(f"[fastjvm] class-data archive for the drivers made in {time.monotonic() - t0:.0f}s: {path}\n")
    return path


#: Archives kept: the key names the venv's Python, so each fresh clone (each CI run) makes one
#: of about 190 MB; unbounded, 15 of them (2.7 GB) had piled up on the machine that runs CI.
_KEEP = 3


def _evict(keep: Path) -> None:
    """Delete all but the ``_KEEP`` most recently used archives (``keep`` among them).  A JVM
    already running on a deleted archive keeps its mapping; one started on it later runs
    without sharing (the JVM skips an archive it cannot open)."""
    def used(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0  # gone already (another session's eviction)

    others = sorted((p for p in CACHE.glob("spark-driver-*.jsa") if p != keep), key=used, reverse=True)
    for old in others[_KEEP - 1:]:
        with contextlib.suppress(OSError):
            old.unlink()


@contextlib.contextmanager
def long_lived():
    """For a JVM that runs the whole test session (the shared ``spark`` fixture's): the archive
    only, not C1 alone, whose code is slower once a JVM has run long enough for C2 to pay."""
    before = os.environ.get("SPARK_SUBMIT_OPTS")
    if before is not None:
        os.environ["SPARK_SUBMIT_OPTS"] = " ".join(o for o in before.split() if o != "-XX:TieredStopAtLevel=1")
    try:
        yield
    finally:
        if before is not None:
            os.environ["SPARK_SUBMIT_OPTS"] = before


def apply() -> None:
    """Add the options to ``SPARK_SUBMIT_OPTS`` of this process (its drivers and subprocesses)."""
    if os.environ.get("TWOPHASE_FAST_JVM", "1") == "0" or "TieredStopAtLevel" in os.environ.get("SPARK_SUBMIT_OPTS", ""):
        return  # off, or applied already (a parent process's)
    path = archive()
    opts = ["-XX:TieredStopAtLevel=1"]
    if path is not None:
        opts += [f"-XX:SharedArchiveFile={path}", "-Xlog:cds*=off"]
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(filter(None, (os.environ.get("SPARK_SUBMIT_OPTS"), *opts)))
