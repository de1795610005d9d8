"""Where MySqlSink's time goes on one partition of the benchmark's rows (issue 49).

Run from the repository root with MariaDB up (``python -m tests.services start mariadb``):

    .venv/bin/python benchmarks/results/mysql/profile_sink.py [ROWS]

In this process, no Spark: ``ROWS`` (default 100,000: one of the two partitions of the 200,000-row
benchmark) rows of the benchmark's shape (``id BIGINT``, 100 hex characters of sha256), in Arrow
batches of 10,000, through the sink's executor path (``begin_transaction``, ``write``,
``pre_commit``) and the driver's ``commit``.  Writes next to this file:

- ``profile-mysql-inprocess.txt``: pyinstrument's tree of that path;
- ``profile_sink.txt``: the path's wall time split by stage, with this process's CPU, taken apart
  by repeating each stage alone on the same rows: Arrow -> Python values (``to_pylist`` and the
  sink's ``_py_value``), PyMySQL building the INSERT text (``cursor.mogrify`` of each row, what
  ``executemany`` does), and the server executing the finished statements (sent pre-built).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import pyarrow as pa
import pymysql

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from benchmarks.profile import _inprocess, _profiled  # noqa: E402
from tests.services import get  # noqa: E402
from twophase.sinks.mysql import MySqlSink, _py_value  # noqa: E402


def rows_table(n: int) -> pa.Table:
    ids = list(range(n))
    pay = [(hashlib.sha256(str(i).encode()).hexdigest() * 2)[:100] for i in ids]
    return pa.table({"id": pa.array(ids, pa.int64()), "payload": pay})


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    info = get("mariadb").start()
    conn = pymysql.connect(host=info["host"], port=info["port"], user=info["user"], password=info["password"],
                           database=info["database"], autocommit=True, charset="utf8mb4")
    cur = conn.cursor()
    tag = hashlib.sha1(str(time.time()).encode()).hexdigest()[:8]
    table, markers = f"prof_my_{tag}", f"prof_markers_{tag}"
    cur.execute(f"CREATE TABLE `{table}` (id BIGINT, payload TEXT) ENGINE=InnoDB")
    t = rows_table(n)
    out: list[str] = [f"MySqlSink, {n} rows x 100 B in Arrow batches of 10,000, one XA branch, in process"]
    try:
        sink = MySqlSink(info["host"], info["port"], info["database"], table, user=info["user"],
                         password=info["password"], marker_table=markers, gid_prefix=f"p{tag}")
        _inprocess(sink, t, "warm")  # connections, the marker table, imports
        cur.execute(f"TRUNCATE TABLE `{table}`")
        c0, w0 = time.process_time(), time.perf_counter()
        _inprocess(sink, t, "plain")
        whole, whole_cpu = time.perf_counter() - w0, time.process_time() - c0
        cur.execute(f"TRUNCATE TABLE `{table}`")
        prof = _profiled(lambda: _inprocess(sink, t, "prof"), HERE / "profile-mysql-inprocess.txt")
        sink.close()
        out.append(f"whole executor path + commit: {whole:.3f} s wall, {whole_cpu:.3f} s CPU of this process "
                   f"({whole / n * 1e6:.1f} us a row); under pyinstrument {prof['seconds']:.3f} s")

        # The stages alone, on the same rows.
        batches = t.to_batches(max_chunksize=10_000)
        c0, w0 = time.process_time(), time.perf_counter()
        pyrows = []
        for b in batches:
            cols = [[_py_value(v) for v in b.column(i).to_pylist()] for i in range(b.num_columns)]
            pyrows.append(list(zip(*cols)))
        a_s, a_cpu = time.perf_counter() - w0, time.process_time() - c0
        sql = f"INSERT INTO `{table}` (`id`, `payload`) VALUES (%s, %s)"
        c0, w0 = time.process_time(), time.perf_counter()
        stmts = []
        for rows in pyrows:
            for i in range(0, len(rows), 1000):
                chunk = rows[i:i + 1000]
                stmts.append(f"INSERT INTO `{table}` (`id`, `payload`) VALUES "
                             + ",".join(cur.mogrify("(%s, %s)", r) for r in chunk))
        b_s, b_cpu = time.perf_counter() - w0, time.process_time() - c0
        cur.execute(f"TRUNCATE TABLE `{table}`")
        cur.execute("BEGIN")
        c0, w0 = time.process_time(), time.perf_counter()
        for s in stmts:
            cur.execute(s)
        c_s, c_cpu = time.perf_counter() - w0, time.process_time() - c0
        cur.execute("COMMIT")
        cur.execute(f"SELECT count(*) FROM `{table}`")
        assert cur.fetchone()[0] == n
        out += [f"Arrow -> Python values (to_pylist, _py_value, zip): {a_s:.3f} s wall, {a_cpu:.3f} s CPU "
                f"({a_s / n * 1e6:.1f} us a row)",
                f"PyMySQL builds the INSERT text (mogrify per row, {len(stmts)} statements of 1,000 rows): "
                f"{b_s:.3f} s wall, {b_cpu:.3f} s CPU ({b_s / n * 1e6:.1f} us a row)",
                f"server runs the pre-built statements (send, parse, insert; one transaction): {c_s:.3f} s wall, "
                f"{c_cpu:.3f} s CPU here ({c_s / n * 1e6:.1f} us a row)",
                f"sum of the three: {a_s + b_s + c_s:.3f} s (the whole path: {whole:.3f} s)",
                f"sql: {sql}"]
    finally:
        cur.execute(f"DROP TABLE IF EXISTS `{table}`")
        cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() "
                    "AND table_name LIKE %s", (markers.replace("_", "\\_") + "%",))
        for (m,) in cur.fetchall():  # the marker table and what the sink made beside it (``_claims``)
            cur.execute(f"DROP TABLE IF EXISTS `{m}`")
        conn.close()
    (HERE / "profile_sink.txt").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
