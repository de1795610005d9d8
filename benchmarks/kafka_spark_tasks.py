"""``python -m benchmarks.kafka_spark_tasks``: where KafkaSink's batch time goes inside Spark, this
checkout against an earlier commit.

Each run is a fresh driver on ``local[2]`` writing ``--batches`` batches of ``--rows`` rows (key
and a 100-byte value, cached, two partitions) with ``Coordinator(KafkaSink)`` to the project's
broker (``python -m tests.services start kafka``).  The sink is a subclass that times, inside each
task, ``begin_transaction`` (the transactional-id claim), ``write`` and ``pre_commit``; the driver
records the coordinator's phases and when each batch's job started and ended.  Runs alternate
between this checkout and ``--base`` (a ``git worktree``, laid out and checked as
``python -m benchmarks.ab`` does), ``--rounds`` each; the first two batches of a run are dropped.
Reported per commit, pooled over its runs: the median of each task phase, of the time from the
job's start to its first ``begin_transaction`` ("lead") and from its last ``pre_commit`` to the
job's end ("tail"), and of the coordinator's ``intent_ms``, ``prepare_ms`` and ``total_ms``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (the child): benchmarks/kafka.py must not shadow kafka-python
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

REPO = Path(__file__).resolve().parents[1]

#: The timing subclass, written to a folder of its own on the workers' PYTHONPATH (benchmarks/
#: itself cannot be there: its kafka.py would shadow kafka-python).
_TIMED = textwrap.dedent('''
    import json, os, time
    from twophase.sinks.kafka import KafkaSink

    _REQUESTS = []  # (request, ms) of the task running now (a Python worker runs one at a time)

    class _TimedClient:
        """The executors' transaction client, each claim request timed (commits without it: none)."""
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            f = getattr(self._inner, name)
            if name not in ("describe_transactions", "init_producer_id", "describe_producers"):
                return f

            def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return f(*a, **kw)
                finally:
                    _REQUESTS.append((name, (time.perf_counter() - t0) * 1e3))
            return timed

    class TimedKafkaSink(KafkaSink):
        def _task_client(self):
            return _TimedClient(super()._task_client())

        def begin_transaction(self, ctx):
            _REQUESTS.clear()
            t0 = time.perf_counter()
            txn = super().begin_transaction(ctx)
            txn._timed = {"batch": ctx.batch_id, "begin_ms": (time.perf_counter() - t0) * 1e3,
                          "write_ms": 0.0, "t_begin": time.time(), "begin_requests": list(_REQUESTS)}
            _REQUESTS.clear()
            return txn

        def write(self, txn, batch):
            t0 = time.perf_counter()
            super().write(txn, batch)
            txn._timed["write_ms"] += (time.perf_counter() - t0) * 1e3

        def pre_commit(self, txn):
            t0 = time.perf_counter()
            handle = super().pre_commit(txn)
            rec = dict(txn._timed, pre_commit_ms=(time.perf_counter() - t0) * 1e3, t_end=time.time(),
                       pre_commit_requests=list(_REQUESTS))
            with open(os.environ["TWOPHASE_TIMED_OUT"], "a") as f:
                f.write(json.dumps(rec) + "\\n")
            return handle
''')


def child(out: Path, rows: int, batches: int, bootstrap: str) -> None:
    """One run: a driver of its own, the timed sink, ``batches`` batches; records to ``out``."""
    from _twophase_timed_kafka import TimedKafkaSink  # type: ignore[import-not-found]
    from confluent_kafka.admin import AdminClient, NewTopic

    import twophase
    from twophase.coordinator import Coordinator
    from twophase.spark import local_session

    spark = local_session("local[2]")
    df = spark.range(rows).selectExpr("CAST(id AS STRING) AS key", "repeat('x', 100) AS value").cache()
    df.count()
    topic = f"bench-tasks-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    sink = TimedKafkaSink(bootstrap, topic=topic, transactional_id_prefix=f"bench-tasks-{uuid.uuid4().hex[:6]}")
    logdir = tempfile.mkdtemp(prefix="twophase-tasks-log-")
    atexit.register(shutil.rmtree, logdir, ignore_errors=True)
    coord = Coordinator(sink, log_location=logdir, name="tasks")
    jobs = []
    for b in range(batches):
        t0 = time.time()
        prog = coord.write(df, batch_id=b)
        jobs.append({"batch": b, "t_job0": t0, "t_job1": time.time(),
                     **{k: prog.get(k) for k in ("intent_ms", "prepare_ms", "commit_ms", "log_ms", "total_ms")}})
    out.write_text(json.dumps({"twophase": twophase.__file__, "jobs": jobs}))
    getattr(coord, "close", lambda: None)()
    spark.stop()


def summarize(tasks: list[dict], jobs: list[dict], skip: int = 2) -> dict[str, Any]:
    """Medians of one commit's runs (their records pooled), batches below ``skip`` left out."""
    tasks = [t for t in tasks if t["batch"] >= skip]
    jobs = [j for j in jobs if j["batch"] >= skip]
    by_batch: dict[tuple[int, int], list[dict]] = {}
    for t in tasks:
        by_batch.setdefault((t["run"], t["batch"]), []).append(t)
    lead, tail = [], []
    for j in jobs:
        ts = by_batch.get((j["run"], j["batch"]))
        if ts:
            lead.append((min(t["t_begin"] for t in ts) - j["t_job0"]) * 1e3)
            tail.append((j["t_job1"] - max(t["t_end"] for t in ts)) * 1e3)

    def med(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 1) if xs else None

    requests: dict[str, list[float]] = {}
    for t in tasks:
        for phase in ("begin", "pre_commit"):
            for name, ms in t.get(f"{phase}_requests") or []:
                requests.setdefault(f"{phase}: {name}", []).append(ms)
    per_request = {k: {"per_task": round(len(v) / len(tasks), 2), "median_ms": med(v)}
                   for k, v in sorted(requests.items())}
    return {"tasks": len(tasks), "batches": len(jobs), "requests": per_request,
            "begin_ms": med([t["begin_ms"] for t in tasks]), "write_ms": med([t["write_ms"] for t in tasks]),
            "pre_commit_ms": med([t["pre_commit_ms"] for t in tasks]),
            "task_ms": med([(t["t_end"] - t["t_begin"]) * 1e3 for t in tasks]),
            "lead_ms": med(lead), "tail_ms": med(tail),
            **{k: med([j[k] for j in jobs]) for k in ("intent_ms", "prepare_ms", "commit_ms", "total_ms")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kafka_spark_tasks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against (anything git rev-parse takes)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per commit, in turns (default 2)")
    ap.add_argument("--rows", type=int, default=200_000, help="rows per batch (default 200000)")
    ap.add_argument("--batches", type=int, default=14, help="batches per run, the first two dropped (default 14)")
    ap.add_argument("--bootstrap", default=None, help="bootstrap servers (default: the test broker's)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the runs' records and summary.json/.md")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.bootstrap is None:
        from tests.services.kafka import BOOTSTRAP
        opts.bootstrap = BOOTSTRAP
    if opts.child is not None:
        child(opts.child, opts.rows, opts.batches, opts.bootstrap)
        return 0
    if opts.rounds < 1 or opts.batches < 3:
        ap.error("--rounds must be at least 1 and --batches at least 3")
    from benchmarks.ab import _check_imports, _worktree

    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, tuple[list[dict], list[dict]]] = {"new": ([], []), "base": ([], [])}
    with tempfile.TemporaryDirectory(prefix="twophase-tasks-") as tmp:
        timed = Path(tmp) / "timed"
        timed.mkdir()
        (timed / "_twophase_timed_kafka.py").write_text(_TIMED)
        wt = _worktree(opts.base, Path(tmp) / "base")
        try:
            _check_imports(wt, str(wt))
            run = 0
            for r in range(1, opts.rounds + 1):
                for side, pythonpath in (("new", str(timed)), ("base", f"{wt}{os.pathsep}{timed}")):
                    run += 1
                    print(f"[tasks] round {r}/{opts.rounds}: {side}", file=sys.stderr, flush=True)
                    tfile, jfile = out / f"{side}-{r}-tasks.jsonl", out / f"{side}-{r}-jobs.json"
                    tfile.unlink(missing_ok=True)
                    env = dict(os.environ, PYTHONPATH=pythonpath, TWOPHASE_TIMED_OUT=str(tfile),
                               PYSPARK_PYTHON=os.environ.get("PYSPARK_PYTHON", sys.executable))
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--base", opts.base, "--out", str(out),
                           "--rows", str(opts.rows), "--batches", str(opts.batches), "--bootstrap", opts.bootstrap,
                           "--child", str(jfile)]
                    code = subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL).returncode
                    if code != 0:
                        print(f"[tasks] {side} run {r} exited {code}", file=sys.stderr)
                        return code
                    got = json.loads(jfile.read_text())
                    want = wt if side == "base" else REPO
                    if not Path(got["twophase"]).resolve().is_relative_to(want.resolve()):
                        raise SystemExit(f"[tasks] the {side} run imported twophase from {got['twophase']}")
                    records[side][0].extend(dict(json.loads(line), run=run) for line in tfile.read_text().splitlines())
                    records[side][1].extend(dict(j, run=run) for j in got["jobs"])
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], capture_output=True)
    summary = {side: summarize(*records[side]) for side in records}
    (out / "summary.json").write_text(json.dumps({"base": opts.base, "rows": opts.rows, "batches": opts.batches,
                                                  "rounds": opts.rounds, **summary}, indent=1))
    keys = ["begin_ms", "write_ms", "pre_commit_ms", "task_ms", "lead_ms", "tail_ms", "intent_ms", "prepare_ms",
            "commit_ms", "total_ms"]
    lines = [f"# KafkaSink inside Spark tasks: this checkout against {opts.base}", "",
             f"`python -m benchmarks.kafka_spark_tasks --base {opts.base} --rounds {opts.rounds} --rows {opts.rows} "
             f"--batches {opts.batches}`; medians in ms, runs pooled per commit "
             f"({summary['new']['tasks']} and {summary['base']['tasks']} tasks).", "",
             "| phase | new | base | new - base |", "|---|---:|---:|---:|"]
    for k in keys:
        a, b = summary["new"][k], summary["base"][k]
        diff = f"{a - b:+.1f}" if a is not None and b is not None else "n/a"
        lines.append(f"| {k} | {a} | {b} | {diff} |")
    lines += ["", "The transaction client's requests inside a task (a commit whose sink has no such client "
              "shows none): how many per task, the median of each.", "",
              "| request | new: per task | new: median ms | base: per task | base: median ms |",
              "|---|---:|---:|---:|---:|"]
    for k in sorted(set(summary["new"]["requests"]) | set(summary["base"]["requests"])):
        a, b = summary["new"]["requests"].get(k, {}), summary["base"]["requests"].get(k, {})
        lines.append(f"| {k} | {a.get('per_task', 0)} | {a.get('median_ms', 'n/a')} | {b.get('per_task', 0)} | "
                     f"{b.get('median_ms', 'n/a')} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
