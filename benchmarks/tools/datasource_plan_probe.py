"""Where a Python data source's streamWriter() calls fall in Spark's durationMs (issue 28 probe).

A no-op streaming data source whose streamWriter() sleeps ``plansleep`` seconds (0, 0.25, 0.5;
two rounds, 10,000-row ``rate-micro-batch`` batches in 2 partitions, ``local[2]``): Spark calls
it for the plan and again for the commit step, so the sleep shows up twice per micro-batch, in
the phase that runs it (``addBatch``, not ``queryPlanning``).  Prints the medians of
``triggerExecution``, ``queryPlanning`` and ``addBatch`` per sleep and round.  Run from the
repository root (no services; the script puts its own folder on the workers' PYTHONPATH, so
that they import ``SleepySource`` by reference)::

    .venv/bin/python benchmarks/tools/datasource_plan_probe.py > benchmarks/results/datasource/probe_where_plan_runs.txt

Its figures: docs/datasource.md, "What it costs".
"""
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage


@dataclass
class Msg(WriterCommitMessage):
    n: int


class _W(DataSourceStreamArrowWriter):
    def write(self, iterator):
        return Msg(sum(b.num_rows for b in iterator))

    def commit(self, messages, batchId):  # noqa: N803
        pass


class SleepySource(DataSource):
    @classmethod
    def name(cls):
        return "probe-sleepy"

    def streamWriter(self, schema, overwrite):  # noqa: N802
        time.sleep(float(self.options.get("plansleep", "0")))
        return _W()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__))
    from twophase.spark import local_session

    spark = local_session("local[2]", "probe")
    from datasource_plan_probe import SleepySource  # type: ignore[import-not-found,no-redef]  # by reference in workers

    spark.dataSource.register(SleepySource)
    for rep in range(2):
        for sleep in ("0", "0.25", "0.5"):
            sdf = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 10000)
                   .option("numPartitions", 2).load())
            q = (sdf.writeStream.format("probe-sleepy").option("plansleep", sleep)
                 .option("checkpointLocation", tempfile.mkdtemp()).start())
            while len([p for p in q.recentProgress if "addBatch" in p["durationMs"]]) < 8:
                time.sleep(0.2)
            q.stop()
            ps = [p["durationMs"] for p in q.recentProgress if "addBatch" in p["durationMs"]][2:8]
            med = {k: statistics.median(d.get(k, 0) for d in ps)
                   for k in ("triggerExecution", "queryPlanning", "addBatch")}
            print(f"round {rep + 1}: streamWriter() sleeps {float(sleep) * 1000:.0f} ms: medians over 6 batches {med}",
                  flush=True)
    spark.stop()
