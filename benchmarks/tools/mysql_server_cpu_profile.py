"""Where MariaDB's CPU goes when MySqlSink loads a batch, against the rows alone (issue 49).

Run from the repository root with MariaDB up (``python -m tests.services start mariadb``):

    .venv/bin/python benchmarks/tools/mysql_server_cpu_profile.py [ROWS] [REPS]

In this process, no Spark: ``ROWS`` (default 200,000) rows of the benchmark's shape (``id BIGINT``,
100 hex characters), split in two halves written at the same time by two threads (the 2-partition
point of ``benchmarks/mysql.py``: two XA branches into one table), in Arrow batches of 10,000.  Each
variant runs ``REPS`` (default 3) times, interleaved, into its own table truncated before every run
(untimed).  For each run: wall time, the server's CPU (``/proc/<mariadbd>/stat``: every thread,
those that ended included), the same for one second after the run (work the run left behind: purge,
page flushing), the CPU of the server threads that served this script's connections, by phase
(:class:`Threads`: other clients of the shared server do not count there), and ``SHOW GLOBAL
STATUS`` deltas.  Writes ``benchmarks/results/mysql/profile_server.txt``.  The server is shared: other
sessions' statements count in its whole CPU and its counters (medians of the runs).
Its figures: benchmarks/HISTORY.md, "MySQL / MariaDB (issue 49)" (the run of 2026-11-29:
``200000 3``).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "results" / "mysql" / "profile_server.txt"
sys.path.insert(0, str(REPO))

from tests.services import get  # noqa: E402
from twophase.context import TransactionContext  # noqa: E402
from twophase.sinks import mysql as m  # noqa: E402
from twophase.sinks.mysql import writer as mw  # noqa: E402 - pre_commit's module

TICK = os.sysconf("SC_CLK_TCK")
STATUS = ("Handler_write", "Innodb_rows_inserted", "Innodb_row_lock_waits", "Innodb_row_lock_time",
          "Innodb_buffer_pool_pages_flushed", "Innodb_os_log_written", "Innodb_data_written",
          "Innodb_buffer_pool_write_requests", "Innodb_buffer_pool_read_requests", "Questions",
          "Com_load", "Com_insert", "Com_xa_start", "Com_xa_recover", "Com_set_option", "Com_show_warnings",
          "Com_select", "Com_delete", "Com_truncate", "Bytes_received")


def rows_table(n: int) -> pa.Table:
    ids = list(range(n))
    pay = [(hashlib.sha256(str(i).encode()).hexdigest() * 2)[:100] for i in ids]
    return pa.table({"id": pa.array(ids, pa.int64()), "payload": pay})


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        x = f.read().rsplit(")", 1)[1].split()
    return (int(x[11]) + int(x[12])) / TICK


class Threads:
    """On-CPU seconds of the server threads that serve this process's connections, by phase.

    Each connection's server thread is found by ``information_schema.PROCESSLIST.TID`` (MariaDB >= 10.5,
    Linux) and read from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on CPU), so other clients of
    the shared server do not count.  A phase's time is the sum over threads of the CPU between the
    thread's previous mark and this one."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.last: dict[int, float] = {}
        self.by_phase: dict[str, float] = {}
        self.lock = threading.Lock()

    def oncpu(self, tid: int) -> float:
        with open(f"/proc/{self.pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9

    def attach(self, conn: Any) -> None:
        with conn.cursor() as cur:
            cur.execute("SELECT TID FROM information_schema.PROCESSLIST WHERE ID = CONNECTION_ID()")
            tid = int(cur.fetchone()[0])
        conn._prof_tid = tid
        with self.lock:
            self.last[tid] = self.oncpu(tid)

    def mark(self, conn: Any, phase: str) -> None:
        tid = conn._prof_tid
        now = self.oncpu(tid)
        with self.lock:
            self.by_phase[phase] = self.by_phase.get(phase, 0.0) + now - self.last[tid]
            self.last[tid] = now

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.by_phase = self.by_phase, {}
        return out


def main() -> None:
    import pyarrow.csv as pcsv

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    svc = get("mariadb")
    info = svc.start()
    pid = svc.pid()
    tag = hashlib.sha1(str(time.time()).encode()).hexdigest()[:8]
    markers = f"prof_svm_{tag}"
    admin = m.MySqlSink(info["host"], info["port"], info["database"], "x", user=info["user"],
                        password=info["password"])._connect()
    acur = admin.cursor()
    threads = Threads(pid)

    def connect(sink: m.MySqlSink, load: bool = False) -> Any:
        c = m.MySqlSink._connect(sink, load)
        threads.attach(c)
        return c

    real_close = mw._close_quietly

    def close_marked(conn: Any) -> None:  # the sink closes its branch's connection right after XA PREPARE
        if getattr(conn, "_prof_tid", None) is not None and conn.open:
            threads.mark(conn, "3 marker row, XA END, XA PREPARE (+ SET wait_timeout)")
        real_close(conn)
    mw._close_quietly = close_marked
    t = rows_table(n)
    halves = [t.slice(0, n // 2), t.slice(n // 2)]
    tables: list[str] = []

    def table(name: str) -> str:
        full = f"prof_sv_{name}_{tag}"
        acur.execute(f"CREATE TABLE `{full}` (id BIGINT, payload TEXT) ENGINE=InnoDB")
        tables.append(full)
        return full

    def sink_for(tbl: str) -> m.MySqlSink:
        s = m.MySqlSink(info["host"], info["port"], info["database"], tbl, user=info["user"],
                        password=info["password"], marker_table=markers, gid_prefix=f"p{tag}")
        s._connect = lambda load=False: connect(s, load)  # type: ignore[method-assign]
        s.open()
        return s

    def csv_bufs(part: pa.Table, opts: Any, convert: bool = True) -> list[Any]:
        bufs = []
        for b in part.to_batches(max_chunksize=10_000):
            o = pa.BufferOutputStream()
            pcsv.write_csv(m._csv_table(b) if convert else b, o, opts)
            bufs.append(o.getvalue())
        return bufs

    all_valid = pcsv.WriteOptions(include_header=False, quoting_style="all_valid", null_string="NULL",
                                  delimiter=",", eol="\n")  # the sink's before this profile
    needed = pcsv.WriteOptions(include_header=False, quoting_style="needed", null_string="NULL",
                               delimiter=",", eol="\n")

    def two(fn: Callable[[int], None], parts: int = 2) -> None:
        errs: list[BaseException] = []

        def run(i: int) -> None:
            try:
                fn(i)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
        ts = [threading.Thread(target=run, args=(i,)) for i in range(parts)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        if errs:
            raise errs[0]

    batch_no = iter(range(10**9))

    def sink_variant(tbl: str) -> Callable[[], None]:
        sink = sink_for(tbl)

        def go() -> None:
            b = next(batch_no)
            intent = sink.plan_batch("prof", b, 2)
            handles: list[Any] = [None, None]

            def part(i: int) -> None:
                txn = sink.begin_transaction(TransactionContext("prof", b, i, 0, intent))
                threads.mark(txn.conn, "1 begin (SET, CONNECTION_ID, columns, XA START)")
                for rb in halves[i].to_batches(max_chunksize=10_000):
                    sink.write(txn, rb)
                threads.mark(txn.conn, "2 LOAD DATA of every Arrow batch (+ SET max_error_count)")
                handles[i] = sink.pre_commit(txn)
            two(part)
            sink.verify_prepared(b, handles, prepare_started_at=time.time())
            for h in handles:
                assert sink.commit(h).done
            for c in list(sink._pool._idle) if hasattr(sink._pool, "_idle") else []:
                threads.mark(c, "4 driver (claims, XA RECOVER, XA COMMIT)")
        return go

    def load_variant(tbl: str, opts: Any, charset: str, enclosed: bool, xa: bool, parts: int = 2,
                     convert: bool = True) -> Callable[[], None]:
        pieces = [t] if parts == 1 else halves
        bufs = [csv_bufs(p, opts, convert) for p in pieces]
        enc = "OPTIONALLY ENCLOSED BY '\"' " if enclosed else ""
        sql = (f"LOAD DATA LOCAL INFILE %s INTO TABLE `{tbl}` CHARACTER SET {charset} FIELDS TERMINATED BY ',' "
               f"{enc}ESCAPED BY '' LINES TERMINATED BY '\\n' (`id`, `payload`)")

        def go() -> None:
            xids = [(f"pv{uuid.uuid4().hex[:12]}", str(i)) for i in range(parts)]

            def part(i: int) -> None:
                c = connect(m.MySqlSink(info["host"], info["port"], info["database"], tbl, user=info["user"],
                                        password=info["password"]), load=True)
                try:
                    with c.cursor() as cur:
                        cur.execute("XA START %s, %s" if xa else "BEGIN", xids[i] if xa else None)
                        threads.mark(c, "1 begin (XA START or BEGIN)")
                        for buf in bufs[i]:
                            name = f"p-{uuid.uuid4().hex}.csv"
                            c._twophase_infile = (name.encode(), buf)
                            cur.execute(sql, (name,))
                            assert cur.warning_count == 0
                        threads.mark(c, "2 LOAD DATA of every Arrow batch")
                        if xa:
                            cur.execute("XA END %s, %s", xids[i])
                            cur.execute("XA PREPARE %s, %s", xids[i])
                        else:
                            cur.execute("COMMIT")
                        threads.mark(c, "3 XA END, XA PREPARE (or COMMIT)")
                finally:
                    c.close()
            two(part, parts)
            for x in xids if xa else []:
                for _ in range(200):  # MariaDB: detached once the preparing session's disconnect is processed
                    try:
                        acur.execute("XA COMMIT %s, %s", x)
                        break
                    except Exception:  # noqa: BLE001
                        time.sleep(0.01)
                else:
                    raise RuntimeError(f"cannot commit {x}")
        return go

    def empty_variant(tbl: str) -> Callable[[], None]:
        sink = sink_for(tbl)
        one = t.slice(0, 1)

        def go() -> None:
            for _ in range(10):  # 10 batches of 2 branches of one row each: the per-branch statements
                b = next(batch_no)
                intent = sink.plan_batch("prof", b, 2)
                handles: list[Any] = [None, None]

                def part(i: int, b: int = b, intent: Any = intent, handles: list[Any] = handles) -> None:
                    txn = sink.begin_transaction(TransactionContext("prof", b, i, 0, intent))
                    threads.mark(txn.conn, "1 begin (SET, CONNECTION_ID, columns, XA START)")
                    sink.write(txn, one.to_batches()[0])
                    threads.mark(txn.conn, "2 LOAD DATA of every Arrow batch (+ SET max_error_count)")
                    handles[i] = sink.pre_commit(txn)
                two(part)
                sink.verify_prepared(b, handles, prepare_started_at=time.time())
                for h in handles:
                    assert sink.commit(h).done
                for c in list(sink._pool._idle) if hasattr(sink._pool, "_idle") else []:
                    threads.mark(c, "4 driver (claims, XA RECOVER, XA COMMIT)")
        return go

    variants: list[tuple[str, str, Callable[[], None]]] = []
    v = table("sink")
    variants.append(("MySqlSink, 2 branches (as the benchmark's P=2 point)", v, sink_variant(v)))
    v = table("xa")
    variants.append(("bare LOAD DATA, CSV quoting 'all_valid', the sink's statement, 2 XA branches, nothing else", v,
                     load_variant(v, all_valid, "binary", True, True)))
    v = table("tx")
    variants.append(("bare LOAD DATA, CSV quoting 'all_valid', the sink's statement, 2 plain transactions", v,
                     load_variant(v, all_valid, "binary", True, False)))
    v = table("one")
    variants.append(("bare LOAD DATA, CSV quoting 'all_valid', the sink's statement, 1 XA branch of all rows", v,
                     load_variant(v, all_valid, "binary", True, True, parts=1)))
    v = table("need")
    variants.append(("bare LOAD DATA, CSV quoting 'needed' (strings only), CHARACTER SET binary, 2 XA branches", v,
                     load_variant(v, needed, "binary", True, True)))
    v = table("u8")
    variants.append(("bare LOAD DATA, CSV quoting 'needed' (strings only), CHARACTER SET utf8mb4, 2 XA branches", v,
                     load_variant(v, needed, "utf8mb4", True, True)))
    v = table("empty")
    variants.append(("MySqlSink, 10 batches x 2 branches of 1 row (statements only; per batch: / 10)", v,
                     empty_variant(v)))

    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in variants}

    def status() -> dict[str, float]:
        acur.execute("SHOW GLOBAL STATUS")
        d = {k: v for k, v in acur.fetchall()}
        return {k: float(d.get(k, 0) or 0) for k in STATUS}

    for r in range(reps + 1):  # round 0: warm-up
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name, tbl, go in order:
            acur.execute(f"TRUNCATE TABLE `{tbl}`")
            time.sleep(1.0)  # let the truncate's and the previous run's background work pass
            threads.take()
            s0, c0 = status(), proc_cpu(pid)
            w0 = time.perf_counter()
            go()
            wall = time.perf_counter() - w0
            c1, s1 = proc_cpu(pid), status()
            phases = threads.take()
            time.sleep(1.0)
            tail = proc_cpu(pid) - c1
            if r:
                row = {"wall": wall, "cpu": c1 - c0, "tail": tail, "ours": sum(phases.values())}
                row.update({f"phase {k}": v for k, v in phases.items()})
                row.update({k: s1[k] - s0[k] for k in STATUS})
                results[name].append(row)
            print(f"{'warm' if not r else r} {name}: {wall:.3f}s server cpu {c1 - c0:.2f}s, our connections' "
                  f"threads {sum(phases.values()):.3f}s tail {tail:.2f}s", flush=True)
    acur.execute(f"SELECT count(*) FROM `{variants[0][1]}`")
    assert acur.fetchone()[0] == n
    load = os.getloadavg()
    out = [f"MariaDB {svc_version(acur)}: {n} rows x 100 B (id BIGINT, payload TEXT, no key), Arrow batches of "
           f"10,000, medians of {reps} interleaved runs; load average at the end {load[0]:.1f} {load[1]:.1f}",
           "server CPU: every mariadbd thread during the run (others' work on the shared server included; after: "
           "the next 1 s); our connections' threads: the server threads serving this script's connections only "
           "(PROCESSLIST.TID, /proc/<pid>/task/<tid>/schedstat), by phase, summed over the branches",
           ""]
    for name, rows in results.items():
        def med(k: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(x[k] for x in rows)
        out.append(f"{name}:")
        out.append(f"  wall {med('wall'):.3f} s, server CPU {med('cpu'):.3f} s (after the run {med('tail'):.3f} s); "
                   f"our connections' threads {med('ours'):.3f} s:")
        for k in sorted(k for k in rows[0] if k.startswith("phase ")):
            out.append(f"    {k[6:]}: {statistics.median(x.get(k, 0.0) for x in rows):.3f} s")
        out.append("  " + ", ".join(f"{k} {med(k):,.0f}" for k in STATUS if med(k)))
    for tbl in tables:
        acur.execute(f"DROP TABLE IF EXISTS `{tbl}`")
    acur.execute(f"DROP TABLE IF EXISTS `{markers}`, `{markers}_claims`")
    admin.close()
    OUT.write_text("\n".join(out) + "\n")
    print("\n".join(out))


def svc_version(cur: Any) -> str:
    cur.execute("SELECT VERSION()")
    return str(cur.fetchone()[0])


if __name__ == "__main__":
    main()
