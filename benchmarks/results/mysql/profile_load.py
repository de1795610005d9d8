"""Where MySqlSink's time goes since it loads by LOAD DATA LOCAL INFILE (issue 49).

Run from the repository root with MariaDB up (``python -m tests.services start mariadb``):

    .venv/bin/python benchmarks/results/mysql/profile_load.py [ROWS]

In this process, no Spark: ``ROWS`` (default 100,000: one of the two partitions of the 200,000-row
benchmark) rows of the benchmark's shape (``id BIGINT``, 100 hex characters of sha256), in Arrow
batches of 10,000.  Writes ``profile_load.txt`` next to this file: the sink's whole executor path
(``begin_transaction``, ``write``, ``pre_commit``) and the driver's ``commit``, then each stage
alone on the same rows, with this process's CPU: the CSV (``sinks.mysql._csv_table`` and
``pyarrow.csv.write_csv`` into memory), the server loading those buffers (one transaction, the
sink's connection class and statement), and an empty branch (begin, marker row, prepare, commit).
"""

from __future__ import annotations

import hashlib
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from benchmarks.profile import _inprocess  # noqa: E402
from tests.services import get  # noqa: E402
from twophase.sinks import mysql as m  # noqa: E402


def rows_table(n: int) -> pa.Table:
    ids = list(range(n))
    pay = [(hashlib.sha256(str(i).encode()).hexdigest() * 2)[:100] for i in ids]
    return pa.table({"id": pa.array(ids, pa.int64()), "payload": pay})


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    import pyarrow.csv as pcsv

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    info = get("mariadb").start()
    tag = hashlib.sha1(str(time.time()).encode()).hexdigest()[:8]
    table, markers = f"prof_ld_{tag}", f"prof_ldm_{tag}"
    sink = m.MySqlSink(info["host"], info["port"], info["database"], table, user=info["user"],
                       password=info["password"], marker_table=markers, gid_prefix=f"p{tag}")
    conn = sink._connect(load=True)
    cur = conn.cursor()
    cur.execute(f"CREATE TABLE `{table}` (id BIGINT, payload TEXT) ENGINE=InnoDB")
    t = rows_table(n)
    out = [f"MySqlSink (LOAD DATA LOCAL INFILE), {n} rows x 100 B in Arrow batches of 10,000, one XA branch, "
           "in process; median of 3 for each line"]
    try:
        _inprocess(sink, t, "warm")
        whole = []
        for i in range(3):
            cur.execute(f"TRUNCATE TABLE `{table}`")
            whole.append(timed(lambda i=i: _inprocess(sink, t, f"plain{i}"))[1:])
        empty = []
        for i in range(3):
            empty.append(timed(lambda i=i: _inprocess(sink, t.slice(0, 0), f"empty{i}"))[1:])
        batches = t.to_batches(max_chunksize=10_000)

        def make_csv():
            bufs = []
            for b in batches:
                o = pa.BufferOutputStream()
                pcsv.write_csv(m._csv_table(b), o, m._csv_options())
                bufs.append(o.getvalue())
            return bufs

        csvs = [timed(make_csv) for _ in range(3)]
        bufs = csvs[0][0]
        sql = (f"LOAD DATA LOCAL INFILE %s INTO TABLE `{table}` CHARACTER SET binary FIELDS TERMINATED BY ',' "
               "OPTIONALLY ENCLOSED BY '\"' ESCAPED BY '' LINES TERMINATED BY '\\n' (`id`, `payload`)")

        def load():
            cur.execute("BEGIN")
            for b in bufs:
                name = f"p-{uuid.uuid4().hex}.csv"
                conn._twophase_infile = (name.encode(), b)
                cur.execute(sql, (name,))
                assert cur.warning_count == 0
            cur.execute("COMMIT")

        loads = []
        for _ in range(3):
            cur.execute(f"TRUNCATE TABLE `{table}`")
            loads.append(timed(load)[1:])
        cur.execute(f"SELECT count(*) FROM `{table}`")
        assert cur.fetchone()[0] == n

        def med(xs, k):
            return sorted(x[k] for x in xs)[1]

        size = sum(b.size for b in bufs)
        out += [f"whole executor path + commit: {med(whole, 0):.3f} s wall, {med(whole, 1):.3f} s CPU of this process "
                f"({med(whole, 0) / n * 1e6:.1f} us a row)",
                f"empty branch (begin, marker row, XA END/PREPARE, XA COMMIT; no rows): {med(empty, 0):.3f} s wall, "
                f"{med(empty, 1):.3f} s CPU",
                f"CSV by pyarrow.csv into memory ({size / 1e6:.1f} MB): {med(csvs, 1):.3f} s wall, "
                f"{med(csvs, 2):.3f} s CPU ({med(csvs, 1) / n * 1e6:.2f} us a row)",
                f"server loads the buffers (LOAD DATA LOCAL, one transaction): {med(loads, 0):.3f} s wall, "
                f"{med(loads, 1):.3f} s CPU here ({med(loads, 0) / n * 1e6:.1f} us a row)"]
    finally:
        cur.execute(f"DROP TABLE IF EXISTS `{table}`, `{markers}`, `{sink.claims_table}`")
        conn.close()
        sink.close()
    (HERE / "profile_load.txt").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
