"""Small helpers around PySpark: a sized local session, and a checkpoint left unstartable by a kill."""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
from typing import Any

from twophase._deps import require

log = logging.getLogger(__name__)

# Spark writes each metadata-log file (offsets/N, commits/N) to ".N.<uuid>.tmp" and renames
# it; the checksum file of that temp file is "..N.<uuid>.tmp.crc".
_SPARK_TEMP = re.compile(r"^\.\.?\d+\.[0-9a-fA-F-]{36}\.tmp(\.crc)?$")
_SPARK_BATCH = re.compile(r"^\d+$")


def local_session(master: str = "local[2]", app_name: str = "twophase", conf: dict[str, Any] | None = None,
                  *, connect: bool = False):
    """A Spark session sized for a small machine (2 cores), with Arrow enabled and the UI off.

    ``connect=True``: a Spark Connect session instead (``SparkSession.builder.remote(master)``),
    whose server pyspark starts in a JVM of this process's own (its ``foreachBatch`` functions run
    in a Python worker of that server); ``master`` is then ``local[...]``.  Needs ``pyspark[connect]``.
    """
    require("pyspark", "running Spark")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode stays on loopback
    from pyspark.sql import SparkSession

    if connect:
        require("grpc", "Spark Connect sessions", extra="connect")
        import warnings

        # pyspark starts the local server with every setting below, then warns that the client
        # cannot set the static ones again: they are in force, nothing is lost.
        warnings.filterwarnings("ignore", message=r"Failed to set .*CANNOT_MODIFY_CONFIG", category=UserWarning)
        builder = SparkSession.builder.remote(master).appName(app_name)
    else:
        builder = SparkSession.builder.master(master).appName(app_name)
    builder = (builder
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.driver.memory", os.environ.get("TWOPHASE_SPARK_DRIVER_MEMORY", "1g"))
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.host", "127.0.0.1"))
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    builder = builder.config("spark.log.level", os.environ.get("TWOPHASE_SPARK_LOG_LEVEL", "ERROR"))
    session = builder.getOrCreate()
    return bound_connect_retries(session) if connect else session


#: How long a Spark Connect client built by twophase retries an unreachable server before its call
#: fails (seconds); ``TWOPHASE_CONNECT_RETRY_SECONDS`` overrides it.  pyspark's own policy waits
#: about ten minutes (15 retries, backoff x4 up to 60 s) and up to an hour for a reattach.
CONNECT_RETRY_SECONDS = 10.0


def bound_connect_retries(spark: Any, seconds: float | None = None) -> Any:
    """Make a Spark Connect session give up on an unreachable server within about ``seconds``
    (default :data:`CONNECT_RETRY_SECONDS`, or ``TWOPHASE_CONNECT_RETRY_SECONDS``); returns ``spark``.

    pyspark retries ``UNAVAILABLE`` for about ten minutes, so a client whose server died (or
    restarted without its session) hangs in its current call, e.g. ``query.awaitTermination()``.
    Bounded, that call raises pyspark's ``SparkConnectGrpcException`` (``UNAVAILABLE``, ``failed to
    connect to all addresses``) within seconds; start the client again once the server is back.
    A brief network outage longer than ``seconds`` now fails the call too.  A classic session is
    returned unchanged.
    """
    client = getattr(spark, "client", None)
    if client is None or not hasattr(client, "set_retry_policies"):
        return spark
    from pyspark.sql.connect.client.retries import DefaultPolicy

    budget_ms = 1000.0 * (seconds if seconds is not None
                          else float(os.environ.get("TWOPHASE_CONNECT_RETRY_SECONDS", CONNECT_RETRY_SECONDS)))
    initial, multiplier, cap = 50.0, 2.0, 2000.0
    retries, wait, total = 0, initial, 0.0
    while total + wait <= budget_ms:  # backoffs 50, 100, ... 1600, then 2000 ms each
        total += wait
        retries += 1
        wait = min(cap, wait * multiplier)
    kwargs: dict[str, Any] = dict(max_retries=max(1, retries), initial_backoff=int(initial),
                                  backoff_multiplier=multiplier,
                                  max_backoff=int(cap), jitter=200, min_jitter_threshold=int(cap),
                                  max_server_retry_delay=int(budget_ms))  # (a delay the server asks for: bounded too)
    accepted = inspect.signature(DefaultPolicy).parameters  # max_server_retry_delay: pyspark 4.1+
    client.set_retry_policies([DefaultPolicy(**{k: v for k, v in kwargs.items() if k in accepted})])
    # Reattaching an execution (RetryException) is bounded apart, by default to one hour.
    if hasattr(client, "_max_retry_exception_elapsed_time"):
        client._max_retry_exception_elapsed_time = budget_ms / 1000.0
    return spark


def clear_interrupted_start(checkpoint_location: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Remove what a kill during a query's very first batch left in its checkpoint; return the paths removed.

    Spark (4.1 and later, ``spark.sql.streaming.verifyCheckpointDirectoryEmptyOnStart``) refuses
    to start a query at batch 0 unless ``offsets/`` and ``commits/`` are empty.  A driver killed
    while writing ``offsets/0`` leaves Spark's temp file (``.0.<uuid>.tmp``) behind, so every
    restart then fails with ``STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY`` and the query can never
    run again.  This removes exactly those temp files, and only from a directory that holds no
    batch file: no batch was planned, so nothing of Spark's state is lost.  Anything else in
    the directory is left alone (and Spark's check then still stops the query, as it should).

    It has to run before ``start()``: Spark checks the directories when the query starts, before
    any batch, so a query with the temp file never reaches a first batch where a coordinator
    could clean up.  :class:`~twophase.coordinator.Coordinator` calls it when it is created
    with ``checkpoint_location`` (run it while no driver runs the query).  Each removed file is
    logged at INFO with the reason; other files that will make Spark refuse the start are
    logged at WARNING, with what to do.  Works on every location the transaction log
    supports (local disk, HDFS over WebHDFS, S3); ``storage_options`` as for the log.
    """
    from twophase.log import open_store

    store = open_store(checkpoint_location, storage_options, exclusive=False)
    removed: list[str] = []
    for sub in ("offsets", "commits"):
        names = store.list(sub, hidden=True)
        if any(_SPARK_BATCH.match(n) for n in names):
            continue  # a planned batch: Spark restarts from it and never looks at temp files
        others = []
        for n in names:
            if _SPARK_TEMP.match(n):
                store.delete(f"{sub}/{n}")
                where = store.location(f"{sub}/{n}")
                removed.append(where)
                log.info("removed %s: Spark's temp file of a %s/ entry, left by a start of this query "
                         "that was interrupted before its first batch was planned; Spark refuses to "
                         "start a query at batch 0 while %s/ holds it, and no batch was planned, so "
                         "nothing of the query's state is lost", where, sub, sub)
            else:
                others.append(n)
        if others:
            log.warning("Spark will refuse to start this query at batch 0 "
                        "(STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY): %s holds %s, which twophase "
                        "leaves alone (not Spark's temp files). No batch was planned in %s, so move "
                        "them out of that directory and start the query again.",
                        store.location(sub), ", ".join(sorted(others)), checkpoint_location)
    return removed


def source_offsets(store: Any, batch_id: int) -> dict[str, Any] | None:
    """Spark's ``offsets/N`` of a streaming checkpoint (a log store on it), parsed for a commit
    decision (``twophase offsets`` reads it back): the file's location and one entry per source;
    None if the file is not there."""
    import json

    data = store.read(f"offsets/{batch_id}")
    if data is None:
        return None
    url = store.location(f"offsets/{batch_id}")
    lines = data.decode("utf-8").splitlines()
    # Line 0 is the version ("v1"), line 1 the batch metadata, then one line per source.
    parsed: list[Any] = []
    for line in lines[2:]:
        try:
            parsed.append(json.loads(line) if line != "-" else None)
        except ValueError:
            parsed.append(line)
    return {"offsets_file": url, "sources": parsed}


def is_connect(spark: Any) -> bool:
    """Is ``spark`` a Spark Connect session (``SparkSession.builder.remote(...)``, or the session a
    Connect server gives a ``foreachBatch`` function)?  Those have no SparkContext and no RDDs."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def default_parallelism(spark: Any) -> int:
    """Spark's ``defaultParallelism`` (the cores the application has).  Spark Connect offers no
    SparkContext: there it is measured, as the partitions of ``spark.range`` without a partition
    count (which Spark sizes by the default parallelism): one small job."""
    if not is_connect(spark):
        return max(1, int(spark.sparkContext.defaultParallelism))
    # A SQL string, not pyspark.sql.functions: those build classic Columns whenever this process
    # does not run in Connect mode (e.g. a Connect client next to a classic session).
    return max(1, int(spark.range(0, 1 << 16).selectExpr("spark_partition_id() AS p").distinct().count()))
