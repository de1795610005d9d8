"""The driver path's gap on the standalone cluster, from a latency run's results.json alone (issue 51).

Run from the repository root (no Spark, no services: it only reads the numbers ``python -m
benchmarks`` wrote, by default ``benchmarks/results/latency-driver-cluster/results.json``)::

    .venv/bin/python benchmarks/tools/driver_path_cluster_breakdown.py > benchmarks/results/latency-driver-cluster/breakdown.txt

or with another results.json as its argument (``.../latency-driver-cluster/rerun-100/results.json``
made ``rerun-100/breakdown.txt``).  Its figures: benchmarks/HISTORY.md, "Small batches prepared in
the driver", on the standalone cluster.

Per (target, rows per batch): Spark's own sink, the driver path's floor (an empty foreachBatch plus
the driver path's collect, ``df.limit(n + 1).toArrow()``), the empty foreachBatch (files only) and
each coordinated variant; medians over every kept batch of the run (ms).  For the driver path the
coordinator's own figures: ``collect`` (the toArrow, inside ``intent``), ``intent - collect`` (the
INTENT record and the ballot), ``prepare`` (the sink's write and pre-commit in the driver), ``log``
(the decision), ``commit``, ``total``; ``addBatch - total`` is what Spark's foreachBatch call costs
around the coordinator (Py4J callback, the DataFrame's plan); ``trigger - addBatch`` is Spark's own
work of the trigger outside the sink (offsets, the WAL and commit log in the checkpoint).
The decomposition: driver - Spark = (driver - floor) + (floor - Spark), the first being what the
driver path adds to its own floor, the second what the floor alone costs over Spark's sink.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "latency-driver-cluster"
FLOOR = "floor: empty foreachBatch + the driver path's collect (toArrow)"
EMPTY = "floor: empty foreachBatch"


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "results.json"
    res = json.loads(src.read_text())
    lat = res["sections"]["latency"]
    print(f"run: {res['started_at']} UTC, {res['duration_s']:.0f} s; load average (1 min) "
          f"{res['load_average']['start_1min']} at the start, {res['load_average']['end_1min']} at the end")
    for g in lat["groups"]:
        v = g["variants"]
        base = v[g["baseline"]]
        floor = v.get(FLOOR)
        print(f"\n== {g['target']}, {g['rows']:,} rows per batch ==")
        print(f"{'variant':58s} {'trigger':>8s} {'addBatch':>8s} {'outside':>8s} {'ratio':>6s}  rep medians")
        for name, x in v.items():
            tr, ab = x["trigger_ms_median"], x["add_batch_ms_median"]
            out = med([t - a for t, a in zip(x["trigger_ms"], x["add_batch_ms"])])
            print(f"{name[:58]:58s} {tr:8.0f} {ab:8.0f} {out:8.0f} {x['ratio']:6.2f}  "
                  f"{', '.join(f'{r:.0f}' for r in x['trigger_ms_rep_medians'])}")
        for name, x in v.items():
            if not x.get("coordinator"):
                continue
            c = x["coordinator_ms_median"]
            bs = x["coordinator_batches"]
            print(f"  {name}: paths {x.get('paths')}; coordinator medians: collect {c['collect_ms']:.0f}, "
                  f"intent - collect {med([b['intent_ms'] - b['collect_ms'] for b in bs]):.0f}, "
                  f"prepare {c['prepare_ms']:.0f}, log {c['log_ms']:.0f}, commit {c['commit_ms']:.0f}, "
                  f"total {c['total_ms']:.0f}, total - collect {med([b['total_ms'] - b['collect_ms'] for b in bs]):.0f}; "
                  f"addBatch - total {x['add_batch_ms_median'] - c['total_ms']:.0f}")
        if floor is None:
            continue
        for name, x in v.items():
            if not name.endswith("task_input=driver"):
                continue
            c = x["coordinator_ms_median"]
            bs = x["coordinator_batches"]
            d_tr, f_tr, s_tr = x["trigger_ms_median"], floor["trigger_ms_median"], base["trigger_ms_median"]
            print(f"  driver path vs Spark: {d_tr:.0f} - {s_tr:.0f} = {d_tr - s_tr:+.0f} ms "
                  f"= (driver - floor) {d_tr - f_tr:+.0f} + (floor - Spark) {f_tr - s_tr:+.0f}; "
                  f"driver's work beyond the collect (total - collect) {med([b['total_ms'] - b['collect_ms'] for b in bs]):.0f} ms; "
                  f"addBatch: driver {x['add_batch_ms_median']:.0f} vs floor {floor['add_batch_ms_median']:.0f} "
                  f"({x['add_batch_ms_median'] - floor['add_batch_ms_median']:+.0f}); "
                  f"collect inside the driver path {c['collect_ms']:.0f} vs the floor's whole addBatch "
                  f"{floor['add_batch_ms_median']:.0f}")
            rounds = [f"round {i + 1}: Spark {s:.0f}, floor {f:.0f}, driver {d:.0f} ({s / d:.2f}x)"
                      for i, (s, f, d) in enumerate(zip(base["trigger_ms_rep_medians"], floor["trigger_ms_rep_medians"],
                                                        x["trigger_ms_rep_medians"]))]
            print(f"  per round (median triggerExecution of each query): {'; '.join(rounds)}")
            if EMPTY in v:
                e = v[EMPTY]
                print(f"  empty foreachBatch: trigger {e['trigger_ms_median']:.0f}, addBatch {e['add_batch_ms_median']:.0f}"
                      f" (the collect adds {floor['trigger_ms_median'] - e['trigger_ms_median']:+.0f} ms of trigger)")


if __name__ == "__main__":
    sys.exit(main())
