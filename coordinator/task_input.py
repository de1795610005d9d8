"""How a Spark task hands its rows to the sink: the same Arrow record batches by one of two paths.

- ``"arrow"``: ``DataFrame.mapInArrow``. Rows leave the JVM columnar, in record batches of
  ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows. The fast path for large batches.
- ``"rows"``: the RDD API (``df.rdd.mapPartitionsWithIndex``). Rows arrive pickled and are
  turned into record batches in the task, against the schema the Arrow path would have
  given (PySpark's own local-data-to-Arrow conversion, then a cast). The job costs less
  than a ``mapInArrow`` job: 40-70 ms less per 100-row micro-batch on ``local[2]``
  (docs/benchmarks.md), while converting rows costs about 7 ms per 2,000 rows.

A sink cannot tell the paths apart: the same schema (field names, types, nullability,
the session's time zone on timestamps) and the same values in the same order
(tests/test_task_input.py compares both paths over every type this module accepts). A
schema with any other type keeps the Arrow path: maps (a map reaches Python as a dict
built from a Java hash map, so its entries would come in another order), intervals,
variants, user-defined types, structs with repeated field names; so does
``spark.sql.execution.arrow.useLargeVarTypes``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

TASK_INPUTS = ("auto", "arrow", "rows")
#: ``Coordinator(task_input=...)``'s values: the task paths above, and ``"driver"``, where no task
#: runs: a small batch is collected to the driver as Arrow record batches and written there, in one
#: transaction (see ``Coordinator``, docs/usage.md "Small batches: the driver path").
INPUTS = TASK_INPUTS + ("driver",)

# Marks a conversion failure in the task's error, so that the driver can tell it from a lost
# executor and stop choosing the rows path for this coordinator (see Coordinator._prepare).
CONVERSION_FAILED = "twophase: task_input='rows' could not convert"


def _converter():
    """PySpark's conversion of Python rows to an Arrow table (``convert(rows, schema,
    use_large_var_types)``), or None on a PySpark without it."""
    try:
        from pyspark.sql.conversion import LocalDataToArrowConversion
    except ImportError:
        try:
            from pyspark.sql.connect.conversion import LocalDataToArrowConversion  # type: ignore[no-redef]
        except ImportError:
            return None
    return LocalDataToArrowConversion


def _same_types(dt: Any) -> bool:
    """Can the rows path give exactly what the Arrow path gives for a column of type ``dt``?"""
    from pyspark.sql import types as T

    if isinstance(dt, (T.BooleanType, T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType,
                       T.DoubleType, T.DecimalType, T.StringType, T.BinaryType, T.DateType,
                       T.TimestampType, T.TimestampNTZType)):
        return True
    if isinstance(dt, T.ArrayType):
        return _same_types(dt.elementType)
    if isinstance(dt, T.StructType):
        names = [f.name for f in dt.fields]
        return len(set(names)) == len(names) and all(_same_types(f.dataType) for f in dt.fields)
    return False


def arrow_settings(spark: Any) -> tuple[str, bool]:
    """The session settings Spark's Arrow path reads per query: (time zone, useLargeVarTypes)."""
    conf = spark.conf
    return (str(conf.get("spark.sql.session.timeZone")),
            str(conf.get("spark.sql.execution.arrow.useLargeVarTypes", "false")).lower() == "true")


def rows_schema(schema: Any, session_time_zone: str, large_var_types: bool) -> Any | None:
    """The Arrow schema the Arrow path hands a sink for a DataFrame of ``schema``, when the rows
    path can hand the same; None when it cannot (the batch then takes the Arrow path)."""
    if large_var_types or not schema.fields or not _same_types(schema) or _converter() is None:
        return None
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        return to_arrow_schema(schema, timezone=session_time_zone, prefers_large_types=False)
    except TypeError:  # a PySpark whose to_arrow_schema takes no time zone: keep the Arrow path
        return None


def record_batches(rows: Iterable[Any], schema: Any, target: Any, max_records: int) -> Iterator[Any]:
    """A task's rows (``pyspark.sql.Row``) as record batches of ``target`` (:func:`rows_schema`),
    at most ``max_records`` rows each, converted as they are read."""
    conversion = _converter()
    assert conversion is not None, "rows_schema() chose the rows path"
    chunk: list[Any] = []

    def refused(e: Exception) -> ValueError:
        # Named for the driver (CONVERSION_FAILED); the values are left out of the message.
        return ValueError(f"{CONVERSION_FAILED} a row to Arrow ({type(e).__name__}); "
                          "Coordinator(task_input='arrow') takes the columnar path")

    def convert() -> list[Any]:
        try:
            table = conversion.convert(chunk, schema, False).cast(target)
        except Exception as e:  # noqa: BLE001 - see refused()
            raise refused(e) from None
        return table.to_batches()

    rows = iter(rows)
    while True:
        try:
            # PySpark builds each Row as it is read (a timestamp near year 1 or 9999 can overflow
            # in the worker's time zone there): a failure here is the rows path's, too.
            row = next(rows)
        except StopIteration:
            break
        except (OverflowError, ValueError, TypeError) as e:
            raise refused(e) from None
        chunk.append(row)
        if len(chunk) >= max_records:
            yield from convert()
            chunk = []
    if chunk:
        yield from convert()
