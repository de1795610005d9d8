"""Small helpers around PySpark: a sized local session, and where a batch comes from."""

from __future__ import annotations

import os
import sys
from typing import Any

from twophase._deps import require


def local_session(master: str = "local[2]", app_name: str = "twophase", conf: dict[str, Any] | None = None):
    """A Spark session sized for a small machine (2 cores), with Arrow enabled and the UI off."""
    require("pyspark", "running Spark")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode stays on loopback
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName(app_name)
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
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("TWOPHASE_SPARK_LOG_LEVEL", "ERROR"))
    return spark
