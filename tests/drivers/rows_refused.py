"""Driver for the rows path's fallback, run in its own process: its Python workers inherit the
time zone the test gives this process (``TZ``), west of UTC.

``python -m tests.drivers.rows_refused OUT LOG``: batch 0 (10 rows) takes the Arrow path; batch 1
(10 rows, one timestamp at 0001-01-01 00:00 UTC, which PySpark cannot build as a local datetime
west of UTC) takes the rows path under ``task_input="auto"``, whose tasks fail; the batch must run
again on the Arrow path and commit. Prints one JSON line with the outcome.
"""

from __future__ import annotations

import json
import sys

from twophase.coordinator import Coordinator
from twophase.sinks.files import FileSink
from twophase.spark import local_session


def main(out: str, log: str) -> None:
    spark = local_session("local[2]", app_name="rows-refused", conf={"spark.sql.session.timeZone": "UTC"})
    c = Coordinator(FileSink(out), log_location=log, name="refused", driver_batch_rows=0)  # the rows path's tasks
    paths, error = [], None
    try:
        for batch_id, lo in enumerate((0, 10)):
            df = spark.range(lo, lo + 10, numPartitions=2).selectExpr(
                "id", "case when id = 15 then timestamp'0001-01-01 00:00:00' "
                "else timestamp'2024-01-01 00:00:00' end as ts")
            p = c.write(df, batch_id=batch_id)
            paths.append(p["task_input"])
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {str(e)[:2000]}"
    finally:
        c.close()
    print(json.dumps({"paths": paths, "error": error}))


if __name__ == "__main__":
    main(*sys.argv[1:])
