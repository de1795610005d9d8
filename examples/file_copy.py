"""Directory of files -> line-by-line copy into output files, exactly once
(Apache Apex's fault-tolerant file input and output operators, "Fault-tolerant file
processing" / AbstractFileInputOperator + AbstractFileOutputOperator).

Apex's input operator remembers which files and which line offset it has
consumed, and its output operator writes to temporary part files that it
truncates back to the last committed length after a failure.  Here Spark's file
source picks up the files appearing in ``--input`` (one file per micro-batch, its
position kept in the checkpoint), every line becomes one JSON-lines record
``{"file": ..., "line": ...}`` in ``--output``, written by twophase's FileSink:
staged under ``<output>/_twophase/`` (fsynced) at pre-commit, renamed into place
at commit, part names fixed per batch and partition, so a batch replayed after a
kill mid-file neither loses nor repeats a line.

Commands::

    python -m examples.file_copy generate --input /tmp/fc-in --files 6 --lines 400
    python -m examples.file_copy run --input /tmp/fc-in --output /tmp/fc-out --checkpoint /tmp/fc-ck
    python -m examples.file_copy verify --input /tmp/fc-in --output /tmp/fc-out

``run`` copies every file present (``trigger(availableNow=True)``) and exits 0;
kill it at any moment, add files, run it again.  ``verify`` checks every input
line is in the output exactly once (lines start with a unique id).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from examples import _common


def generate(folder: str, files: int, lines: int, first_file: int = 0) -> list[str]:
    """Write ``files`` text files of ``lines`` lines each (atomically: temp name, then rename).

    Every line starts with a unique id ``f<file>-l<line>``; returns the ids.
    """
    os.makedirs(folder, exist_ok=True)
    ids = []
    for f in range(first_file, first_file + files):
        path = os.path.join(folder, f"input-{f:04d}.txt")
        tmp = os.path.join(folder, f".input-{f:04d}.txt.tmp")
        with open(tmp, "w") as fh:
            for n in range(lines):
                i = f"f{f:04d}-l{n:06d}"
                ids.append(i)
                fh.write(f"{i} the quick brown fox jumps over the lazy dog {n % 97}\n")
        os.rename(tmp, path)  # the file source must never see a half-written file
    return ids


def input_ids(folder: str) -> list[str]:
    ids = []
    for path in sorted(glob.glob(os.path.join(folder, "*.txt"))):
        with open(path) as fh:
            ids += [line.split(" ", 1)[0] for line in fh if line.strip()]
    return ids


def output_ids(folder: str) -> list[str]:
    """Ids of the lines in COMMITTED output files (staging under _twophase/ is not output)."""
    ids = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as fh:
            ids += [json.loads(line)["line"].split(" ", 1)[0] for line in fh if line.strip()]
    return ids


def run(args: argparse.Namespace) -> int:
    from pyspark.sql import functions as F

    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink

    spark = _common.session("file-copy")
    lines = (spark.readStream.option("maxFilesPerTrigger", args.files_per_batch).text(args.input)
             .select(F.input_file_name().alias("file"), F.col("value").alias("line")))
    sink = FileSink(args.output, format="jsonl", prefix="copy")
    coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name=args.name,
                              shared_storage=args.shared_storage)
    q = (lines.repartition(args.partitions).writeStream.foreachBatch(coordinator)
         .option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start())
    q.awaitTermination()
    spark.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.file_copy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write text files with uniquely numbered lines into --input")
    g.add_argument("--input", required=True)
    g.add_argument("--files", type=int, default=6)
    g.add_argument("--lines", type=int, default=400)
    g.add_argument("--first-file", type=int, default=0)
    r = sub.add_parser("run", help="copy every file in --input to --output, then exit")
    r.add_argument("--input", required=True)
    r.add_argument("--output", required=True)
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--name", default="file-copy")
    r.add_argument("--files-per-batch", type=int, default=1)
    r.add_argument("--partitions", type=int, default=2)
    r.add_argument("--shared-storage", action="store_true",
                   help="on a cluster: every host mounts --output at the same path (NFS, ...)")
    v = sub.add_parser("verify", help="every input line exactly once in the output")
    v.add_argument("--input", required=True)
    v.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    _common.setup_logging()
    if args.cmd == "generate":
        generate(args.input, args.files, args.lines, args.first_file)
        return 0
    if args.cmd == "run":
        return run(args)
    from twophase.chaos import verify as by_id

    v = by_id(input_ids(args.input), output_ids(args.output))
    print(json.dumps(v.to_dict()))
    return 0 if v.exactly_once else 1


if __name__ == "__main__":
    sys.exit(main())
