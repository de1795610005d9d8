"""The coordinator's look at its Spark environment, on the driver before a batch is planned: Spark's
settings (the master, speculation), the streaming query (async progress tracking, a continuous
trigger) and its checkpoint (adopted, or compared with ``checkpoint_location``; over Spark Connect,
where the query's id is read), the probe of what the executors can import, and the clean-up of a
first start that was interrupted.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit

from twophase.coordinator.base import _CoordinatorBase, _find_query, _job_failure, log
from twophase.errors import ConfigurationError
from twophase.log import open_store
from twophase.spark import is_connect


def _executor_python_hint(python: str | None, archives: str | None) -> str:
    """What to check when the executors could not start their Python ``python``."""
    if python and not os.path.isabs(python) and os.sep in python:
        shipped = f"spark.archives is {archives!r}" if archives else "spark.archives is not set"
        return (f"The executors' Python, spark.pyspark.python={python}, is a path in each executor's "
                f"working directory, where Spark unpacks spark.archives ({shipped}): ship the packed "
                "environment it names with the job (--archives env.tar.gz#env, a virtualenv packed by "
                "venv-pack or conda-pack).")
    return (f"The executors' Python is {python or 'python3'}: install it on every host, or ship a packed "
            "environment (--archives env.tar.gz#env with spark.pyspark.python=./env/bin/python).")


def _local_or_url(location: str) -> str:
    """Hadoop's qualified ``file:/x`` as a plain local path; other URLs unchanged."""
    if location.startswith("file:"):
        path = location[len("file:"):]
        return "/" + path.lstrip("/") if path.startswith("/") else path
    return location


def _location_key(location: str) -> tuple[str, str, str]:
    """(scheme, authority, path) to compare two spellings of one checkpoint location."""
    loc = _local_or_url(location)
    if "://" not in loc:
        return ("file", "", os.path.realpath(os.path.abspath(loc)))
    u = urlsplit(loc)
    scheme = "s3" if u.scheme in ("s3", "s3a", "s3n") else u.scheme
    return (scheme, u.netloc, u.path.rstrip("/") or "/")


def _same_location(given: str, resolved: str) -> bool:
    """Does ``given`` (as a user wrote it) name Spark's qualified ``resolved`` checkpoint root?

    A path without scheme or authority (``/chk``, ``hdfs:///chk``) is resolved by Spark against
    the default filesystem (HDFS on most clusters): then only the paths are compared.
    """
    g, r = _location_key(given), _location_key(resolved)
    if g == r:
        return True
    loc = _local_or_url(given)
    if "://" not in loc or not urlsplit(loc).netloc:
        return g[2] == r[2] or urlsplit(loc).path.rstrip("/") == r[2]
    return False


class _Environment(_CoordinatorBase):
    """The Spark environment's checks of :class:`~twophase.coordinator.Coordinator` (driver)."""

    @staticmethod
    def _clear_interrupted_start(checkpoint_location: str, storage_options: dict[str, Any] | None) -> None:
        """A driver killed while Spark wrote ``offsets/0`` must not leave a query Spark refuses to start.

        Here, not at the first batch: Spark checks the checkpoint in ``start()``'s query thread
        before any batch runs, so a query it refuses never calls the coordinator.
        """
        from twophase.spark import clear_interrupted_start

        try:
            clear_interrupted_start(checkpoint_location, storage_options)
        except Exception as e:  # noqa: BLE001 - Spark's own start-up check then reports the state
            log.warning("could not check %s for temp files of an interrupted first start: %s. If the "
                        "query then fails with STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY and no batch "
                        "was ever planned, remove the .0.<uuid>.tmp files (and their .crc) from its "
                        "offsets/ and commits/, or call twophase.spark.clear_interrupted_start(%r), "
                        "and start again; a new checkpoint location would start a different query.",
                        checkpoint_location, e, checkpoint_location)

    @staticmethod
    def _conf(spark, key: str, default: str) -> str:
        """A Spark setting, static ones included, in a classic or a Spark Connect session."""
        if is_connect(spark):
            value = spark.conf.get(key, None)
        else:
            value = spark.sparkContext.getConf().get(key, None)
        return default if value is None else str(value)

    def _connect_query_id(self) -> str:
        """Spark Connect gives ``foreachBatch`` no local properties, so no ``sql.streaming.queryId``:
        read the query's id where Spark keeps it for restarts, the checkpoint's ``metadata`` file
        (written when the query starts, before its first batch)."""
        if self.checkpoint_location is None:
            raise ConfigurationError(
                "over Spark Connect the coordinator cannot ask Spark which streaming query calls it (a "
                "Connect session has no SparkContext or local properties): pass "
                "Coordinator(checkpoint_location=...) with the query's own .option('checkpointLocation', "
                "...); the coordinator reads the query's id (and each batch's source offsets) from there. "
                "Nothing was written.")
        store = open_store(self.checkpoint_location, self.storage_options, exclusive=False)
        raw = store.read("metadata")
        try:
            query_id = json.loads(raw.decode("utf-8"))["id"] if raw is not None else None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            query_id = None
        if not query_id:
            raise ConfigurationError(
                f"{store.location('metadata')} does not hold a streaming query id: is "
                f"checkpoint_location={self.checkpoint_location!r} the query's .option('checkpointLocation', "
                "...)? Over Spark Connect the coordinator learns the query's id from there. Nothing was "
                "written.")
        return str(query_id)

    def _check_spark(self, spark, query_id: str, streaming: bool) -> None:
        connect = is_connect(spark)
        master = self._conf(spark, "spark.master", "local")
        if not master.startswith("local"):
            paths = self.sink.local_paths()
            if paths and not self.shared_storage:
                raise ConfigurationError(
                    f"{type(self.sink).__name__} writes to local paths ({', '.join(paths)}) but the master is "
                    f"{master}: each executor would write to its own host's disk and the driver could not "
                    "commit what it cannot see. Use shared storage (hdfs://, s3://) or, if that path is a "
                    "mount every host shares (NFS), pass Coordinator(..., shared_storage=True).")
            if not self._probed:
                self._probe_executors(spark)
                self._probed = True
        if self._conf(spark, "spark.speculation", "false").lower() == "true" and not self.sink.supports_speculation:
            raise ConfigurationError(
                f"spark.speculation=true would let two attempts of one task pre-commit, and "
                f"{type(self.sink).__name__} cannot isolate attempts. Set spark.speculation=false.")
        if not streaming:
            return
        if connect:
            if not self._connect_said:
                log.warning("%s: over Spark Connect the coordinator cannot inspect the streaming query (no JVM "
                            "access): it does not check that asyncProgressTrackingEnabled is off or that "
                            "checkpoint_location is the query's own (both must hold), waits for no task of "
                            "a failed batch (the replay aborts their leftovers first), and recomputes a "
                            "replayed decided batch with the noop writer in case the query is stateful",
                            self.name)
                self._connect_said = True
            return
        jq = None
        try:
            q = _find_query(spark, query_id)
            jq = q._jsq.streamingQuery() if q is not None else None
        except Exception:  # pragma: no cover - Spark Connect or internals changed
            log.debug("could not inspect the streaming query %s", query_id, exc_info=True)
        if jq is not None:
            self._check_checkpoint(jq)
            cls = jq.getClass().getSimpleName()
            if "AsyncProgress" in cls:
                raise ConfigurationError(
                    "async progress tracking (asyncProgressTrackingEnabled) lets Spark run batch N+1 "
                    "before batch N's commit is recorded, which breaks the replay contract. Turn it off.")
            if "RealTime" in cls or "Continuous" in cls:
                raise ConfigurationError(f"{cls} does not run foreachBatch micro-batches; use a "
                                         "micro-batch trigger")

    def _check_checkpoint(self, jq) -> None:
        """The query's own checkpoint: adopt it when none was given (so offsets are recorded),
        refuse a ``checkpoint_location`` that names another one (offsets would silently be missing)."""
        try:
            root = str(jq.resolvedCheckpointRoot())
        except Exception:  # noqa: BLE001 - internals changed: keep what the user gave
            log.debug("could not read the query's checkpoint location", exc_info=True)
            return
        if self.checkpoint_location is None:
            self.checkpoint_location = _local_or_url(root)
            log.info("%s: the query's checkpoint is %s: source offsets are recorded from there",
                     self.name, self.checkpoint_location)
        elif not _same_location(self.checkpoint_location, root):
            raise ConfigurationError(
                f"Coordinator(checkpoint_location={self.checkpoint_location!r}) is not the query's checkpoint "
                f"({root}): the source offsets of each batch would not be recorded. Give the coordinator the "
                "same location as .option('checkpointLocation', ...), or give it only log_location=... (it "
                "then finds the query's checkpoint itself).")

    def _probe_executors(self, spark) -> None:
        """Before the first batch on a cluster: can the executors import what the sink needs?

        A missing package would otherwise fail every task of the first batch with an
        ImportError buried in a Python worker's traceback, after the INTENT was logged.
        """
        import twophase

        modules = ["twophase", *self.sink.executor_modules()]
        n = self._default_parallelism(spark)

        def probe(batches):
            import importlib
            import socket

            import pyarrow as pa

            for _ in batches:
                pass
            out: dict[str, list[str]] = {"host": [], "module": [], "version": [], "error": []}
            for m in modules:
                try:
                    mod = importlib.import_module(m)
                    row = (socket.gethostname(), m, str(getattr(mod, "__version__", "")), "")
                except Exception as e:  # noqa: BLE001 - reported to the driver
                    row = (socket.gethostname(), m, "", f"{type(e).__name__}: {e}")
                for k, v in zip(out, row, strict=True):
                    out[k].append(v)
            yield pa.RecordBatch.from_pydict(out)

        try:
            # mapInArrow rather than an RDD job: the same probe runs over Spark Connect.
            found = [tuple(r) for r in spark.range(0, n, 1, n).mapInArrow(
                probe, "host STRING, module STRING, version STRING, error STRING").collect()]
        except Exception as e:  # noqa: BLE001 - the job itself failed (e.g. no Python on the executors)
            python = self._conf(spark, "spark.pyspark.python", "") or (
                None if is_connect(spark) else getattr(spark.sparkContext, "pythonExec", None))
            archives = self._conf(spark, "spark.archives", "") or None
            raise ConfigurationError(
                f"could not run Python on the executors to check they can import {', '.join(modules)}: "
                f"{_job_failure(e)}. {_executor_python_hint(python, archives)} "
                "Nothing was written.") from e
        missing = sorted({(m, host, err) for host, m, _, err in found if err})
        if missing:
            what = "; ".join(f"{m} on {host} ({err[:160]})" for m, host, err in missing[:5])
            raise ConfigurationError(
                f"the executors cannot import what {type(self.sink).__name__} needs: {what}. Ship them with "
                "the job: spark-submit --py-files twophase.zip (or spark.submit.pyFiles / "
                "SparkContext.addPyFile) for twophase itself (its wheel copied to a .zip name: Spark "
                "puts no .whl on the executors' path), and a packed environment "
                "(--archives env.tar.gz#env with spark.pyspark.python=./env/bin/python, see venv-pack) or "
                "an install on every host for packages with native code (pyarrow, confluent_kafka, "
                "psycopg2). Nothing was written.")
        versions = {v for _, m, v, _ in found if m == "twophase" and v}
        if versions and versions != {twophase.__version__}:
            raise ConfigurationError(
                f"the executors run twophase {', '.join(sorted(versions))} and the driver "
                f"{twophase.__version__}: handles and logs are only promised between equal versions. "
                "Ship the driver's version (spark-submit --py-files) or upgrade the executors.")
