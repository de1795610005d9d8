"""200,000-row batches: does the driver path cost the task path anything? (issue 51)

``Coordinator.write`` into ``FileSink`` on ``local[2]``, one cached 200,000-row DataFrame, three
variants interleaved for 6 rounds (the first dropped): ``task_input="arrow"``, ``"driver"`` (over
the bound: it collects, then falls back to the Arrow tasks) and ``"auto"`` with
``driver_batch_rows=10000`` after a large batch.  Prints JSON: per variant the median and every
kept time in ms, the ratio to ``arrow`` and the path each batch took, and the load average.

Run from the repository root (no services needed)::

    .venv/bin/python benchmarks/tools/driver_path_200k_throughput.py > benchmarks/results/latency-driver/throughput-200k.json

Its figures: benchmarks/HISTORY.md, "Small batches prepared in the driver" (200,000-row batches).
"""
import json
import os
import statistics
import tempfile
import time

from twophase.coordinator import Coordinator
from twophase.sinks.files import FileSink
from twophase.spark import local_session

spark = local_session("local[2]", "thr")
n = 200_000
df = spark.range(0, n, 1, 2).selectExpr("id", "substring(repeat(sha2(cast(id as string), 256), 2), 1, 100) as payload").cache()
df.count()
root = tempfile.mkdtemp(prefix="h4-thr-")
variants = {"arrow": dict(task_input="arrow"),
            "driver (over the bound: collect, then Arrow tasks)": dict(task_input="driver"),
            "auto, driver_batch_rows=10000 (after a large batch)": dict(task_input="auto", driver_batch_rows=10000)}
coords = {k: Coordinator(FileSink(os.path.join(root, str(i))), log_location=os.path.join(root, f"log{i}"), name=f"thr{i}", **kw)
          for i, (k, kw) in enumerate(variants.items())}
times = {k: [] for k in variants}
paths = {k: [] for k in variants}
bid = 0
names = list(variants)
for r in range(6):
    order = names[r % 3:] + names[:r % 3]
    for k in order:
        t0 = time.perf_counter()
        p = coords[k].write(df, batch_id=r)
        ms = (time.perf_counter() - t0) * 1000
        if r > 0:
            times[k].append(ms)
        paths[k].append((p["task_input"], round(p["collect_ms"])))
for c in coords.values():
    c.close()
base = statistics.median(times["arrow"])
out = {k: {"median_ms": round(statistics.median(v)), "ms": [round(x) for x in v], "vs_arrow": round(base / statistics.median(v), 3), "paths": paths[k]} for k, v in times.items()}
out["load_average"] = os.getloadavg()
print(json.dumps(out, indent=1))
