"""``twophase demo``: an exactly-once pipeline on local files whose driver is killed again and again.

A deterministic source (JSON-lines files with unique record ids) is read by a
Spark streaming query, one file per micro-batch, and written through
``Coordinator(FileSink(...))``.  The driver dies at every named crash point
(one per batch) and is SIGKILLed at random moments; it is restarted each time
from its checkpoint.  At the end the committed output is counted by record id.
No external service is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from twophase import crash

#: ``Coordinator(task_input=...)``'s values (twophase.coordinator.task_input.TASK_INPUTS; not
#: imported here, so that building the CLI's parser imports no coordinator).
TASK_INPUTS = ("auto", "arrow", "rows")

DESCRIPTION = (
    "Run an exactly-once Spark pipeline (JSON files -> Spark -> FileSink on local disk), kill its "
    "driver at every named crash point and at random moments, restart it each time, and print a "
    "verification table: records in, records out, lost, duplicated. Needs pyspark and Java; no "
    "other service.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="where input, output, checkpoint and logs go "
                                     "(default: a new temporary directory, kept and printed)")
    p.add_argument("--files", type=int, default=12, help="input files = micro-batches (default 12)")
    p.add_argument("--records", type=int, default=500, help="records per input file (default 500)")
    p.add_argument("--kills", type=int, default=3, help="random SIGKILLs of the driver (default 3)")
    p.add_argument("--no-crash-points", action="store_true", help="only random SIGKILLs")
    p.add_argument("--points", default=None, metavar="P1,P2,...",
                   help="the crash points to fire, one batch each in this order (default: all of "
                        "them); names: " + ", ".join(crash.POINTS))
    p.add_argument("--seed", type=int, default=None, help="random seed for kill moments (default: random)")
    p.add_argument("--format", default="parquet", choices=["parquet", "jsonl", "csv"])
    p.add_argument("--task-input", default="auto", choices=TASK_INPUTS,
                   help="how the coordinator's tasks take their rows (Coordinator(task_input=...); "
                        "default auto: the rows path after a batch of at most 2,000 rows; the demo "
                        "never takes the driver path, so that worker faults hit tasks)")
    p.add_argument("--connect", action="store_true",
                   help="run the driver as a Spark Connect client (SparkSession.builder.remote('local[2]'): "
                        "the coordinator runs in the Connect server's foreachBatch worker); needs "
                        "pip install 'twophase[connect]'")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")


def write_input(folder: Path, files: int, records: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    ids = []
    for f in range(files):
        lines = []
        for r in range(records):
            rid = f"r{f:04d}-{r:06d}"
            ids.append(rid)
            lines.append(json.dumps({"id": rid, "file": f, "amount": (f * 7919 + r * 104729) % 10000}))
        tmp = folder / f".f{f:04d}.json.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(folder / f"f{f:04d}.json")  # the file source must never see a half-written file
    return ids


def read_output_ids(out: Path, fmt: str) -> list[str]:
    """Ids in committed part files (staging under _twophase is not output)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    ids: list[str] = []
    for path in sorted(out.glob("*")):
        if path.name.startswith(("_", ".")) or not path.is_file():
            continue
        if fmt == "parquet":
            ids.extend(pq.read_table(path, columns=["id"]).column("id").to_pylist())
        elif fmt == "csv":
            no_header = pacsv.ReadOptions(autogenerate_column_names=True)  # as Spark writes csv
            ids.extend(pacsv.read_csv(path, read_options=no_header).column(0).to_pylist())
        else:
            ids.extend(json.loads(line)["id"] for line in path.read_text().splitlines() if line)
    return ids


def staging_left(out: Path) -> int:
    st = out / "_twophase"
    return sum(1 for p in st.rglob("*") if p.is_file()) if st.exists() else 0


def run_driver(workdir: Path, fmt: str, connect: bool = False, task_input: str = "auto") -> int:
    """The driver process: run the streaming query until all available input is committed."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("py4j", "py4j.clientserver", "py4j.java_gateway"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink
    from twophase.spark import local_session

    spark = local_session("local[2]", app_name="twophase-demo", connect=connect)
    cp = str(workdir / "checkpoint")
    # driver_batch_rows=0: "auto" keeps to the task paths, so that before_begin and after_pre_commit
    # fire in the executors' Python workers (a worker dies, Spark retries the task), not in the driver.
    coordinator = Coordinator(FileSink(str(workdir / "output"), format=fmt), checkpoint_location=cp,
                              name="demo", task_input=task_input, driver_batch_rows=0)
    src = (spark.readStream.schema("id STRING, file INT, amount INT").option("maxFilesPerTrigger", 1)
           .json(str(workdir / "input")))
    q = (src.repartition(2).writeStream.foreachBatch(coordinator).option("checkpointLocation", cp)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    spark.stop()
    return 0


def main_from_args(args) -> int:
    from twophase import chaos

    chosen = list(crash.POINTS)
    if args.points:
        chosen = [p.strip() for p in args.points.split(",") if p.strip()]
        unknown = [p for p in chosen if p not in crash.POINTS]
        if unknown:
            print(f"twophase demo: unknown crash point(s) {', '.join(unknown)}; known: "
                  f"{', '.join(crash.POINTS)}", file=sys.stderr)
            return 2
    if args.no_crash_points:
        chosen = []
    if args.files < len(chosen) + 1:
        print(f"twophase demo: --files must be at least {len(chosen) + 1} so that every crash "
              "point hits its own batch", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="twophase-demo-")).resolve()
    if workdir.exists() and any(workdir.iterdir()):
        if not (workdir / "input").exists():
            print(f"twophase demo: {workdir} is not empty and is not a demo directory", file=sys.stderr)
            return 2
        for sub in ("input", "output", "checkpoint"):
            shutil.rmtree(workdir / sub, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    say(f"twophase demo in {workdir}")
    expected = write_input(workdir / "input", args.files, args.records)
    say(f"input: {args.files} files x {args.records} records = {len(expected)} records with unique ids")
    # Crash point i at batch i: each restart gets a little further, every point is hit once.
    points = [f"{p}:{i}" for i, p in enumerate(chosen)]
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    say(f"faults: {len(points)} crash points, {args.kills} random SIGKILLs (seed {seed}); "
        f"driver log: {workdir / 'driver.log'}")
    cmd = [sys.executable, "-m", "twophase.demo", "driver", "--workdir", str(workdir), "--format", args.format,
           "--task-input", getattr(args, "task_input", "auto")]
    if getattr(args, "connect", False):
        from twophase._deps import require

        require("grpc", "twophase demo --connect", extra="connect")
        cmd.append("--connect")
        say("driver: a Spark Connect client; its server (and the coordinator, in the server's "
            "foreachBatch worker) die with it")
    t0 = time.monotonic()
    log_dir = workdir / "checkpoint" / "twophase"

    def log_records() -> int:
        """Files in the transaction log: grows with every INTENT/PREPARED/COMMITTED (batches flowing)."""
        return sum(len(files) for _, _, files in os.walk(log_dir))

    # A random SIGKILL lands 0.2-3 s after the driver's log next moves: while a batch is in flight.
    runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=args.kills, kill_window=(0.2, 3.0),
                                 seed=seed, log_path=str(workdir / "driver.log"), progress=say,
                                 progress_probe=log_records)
    verdict = chaos.verify(expected, read_output_ids(workdir / "output", args.format))
    left = staging_left(workdir / "output")
    result = dict(verdict.to_dict(), staging_files_left=left, runs=[r.to_dict() for r in runs],
                  seconds=round(time.monotonic() - t0, 1), workdir=str(workdir), seed=seed)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        fired = sum(1 for r in runs if r.outcome == "crash point fired")
        killed = sum(1 for r in runs if r.outcome == "killed")
        missed = sum(1 for r in runs if r.outcome == "finished before the fault")
        failed = sum(1 for r in runs if r.outcome == "failed")
        print()
        print("  twophase demo: verification by record id")
        print("  ----------------------------------------")
        rows = [("driver runs", len(runs)), ("crash points fired", fired),
                ("SIGKILLs mid-work", killed), ("faults that came late", missed),
                ("other failures", failed),
                ("records in", verdict.records_in), ("records out", verdict.records_out),
                ("lost", verdict.lost), ("duplicated", verdict.duplicated),
                ("unexpected", verdict.unexpected), ("staging files left", left)]
        for k, v in rows:
            print(f"  {k:<24}{v:>14}")
        print(f"  {'result':<24}{'EXACTLY ONCE' if verdict.exactly_once and not left else 'FAILED':>14}")
        if verdict.lost_sample or verdict.duplicated_sample:
            print(f"  lost e.g. {verdict.lost_sample}  duplicated e.g. {verdict.duplicated_sample}")
        print(f"  ({result['seconds']}s; inspect the log with: twophase status {workdir / 'checkpoint' / 'twophase'})")
    return 0 if verdict.exactly_once and not left else 1


def _driver_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m twophase.demo driver")
    p.add_argument("--workdir", required=True)
    p.add_argument("--format", default="parquet")
    p.add_argument("--connect", action="store_true")
    p.add_argument("--task-input", default="auto", choices=TASK_INPUTS)
    a = p.parse_args(argv)
    return run_driver(Path(a.workdir), a.format, a.connect, a.task_input)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "driver":
        sys.exit(_driver_main(sys.argv[2:]))
    parser = argparse.ArgumentParser(prog="python -m twophase.demo", description=DESCRIPTION)
    add_arguments(parser)
    sys.exit(main_from_args(parser.parse_args()))
