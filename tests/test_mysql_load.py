"""MySqlSink's insert mode loads each Arrow batch by LOAD DATA LOCAL INFILE from memory (issue 49).

Against the real MariaDB (127.0.0.1:13306): every column type stores what the INSERT path (upsert
mode, and the fallback) stores, NULLs as NULL; a value the server would turn into a warning fails
the write; NaN and infinities are refused by name on both paths; a server that refuses LOCAL loads
gets INSERTs and one log line.  Without a server: the connection sends its in-memory batch only to
a request for that batch's name and refuses any other file name.
"""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import uuid

import pyarrow as pa
import pytest

from twophase import TransactionContext
from twophase.sink import CommitOutcome
from twophase.sinks import mysql as mysql_mod
from twophase.sinks.mysql import MySqlSink, MySqlWriteError
from twophase.sinks.mysql import base as mysql_base
from twophase.sinks.mysql import rows as mysql_rows

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(120)]

BERLIN = dt.timezone(dt.timedelta(hours=1))

TYPES = ("id BIGINT PRIMARY KEY, s TEXT, b VARBINARY(64), de DECIMAL(20,4), d DATE, ts DATETIME(6), "
         "tsl TIMESTAMP(6) NULL, bo BOOLEAN, f DOUBLE, f4 DOUBLE, u BIGINT UNSIGNED, tm TIME(6), i8 TINYINT")


def q(db, query, params=None):
    with db.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall()


@pytest.fixture
def env(mariadb_service, mdb, monkeypatch):
    """Two tables of the same columns (one written by LOAD, one by INSERT), a sink factory, cleanup."""
    uid = uuid.uuid4().hex[:8]
    s = mariadb_service
    made = []

    def table(ddl=TYPES):
        name = f"ld_{uid}_{len(made)}"
        q(mdb, f"CREATE TABLE `{name}` ({ddl}) ENGINE=InnoDB")
        made.append(name)
        return name

    sinks = []

    def make(tbl, **kw):
        kw.setdefault("marker_table", f"ldm_{uid}")
        sink = MySqlSink(s["host"], s["port"], s["database"], tbl, user=s["user"], password=s["password"],
                         gid_prefix=f"ld{uid}", **kw)
        sink.open()
        sinks.append(sink)
        return sink

    # Each test starts from "the server allows LOCAL loads" (the fallback remembers a refusal per process).
    monkeypatch.setattr(mysql_rows, "_NO_LOCAL_INFILE", set())
    yield {"db": mdb, "table": table, "make": make, "uid": uid}
    for sink in sinks:
        sink.close()
    for _f, glen, blen, data in q(mdb, "XA RECOVER"):
        g, b = data[:glen].decode(), data[glen:glen + blen].decode()
        if g.startswith(f"ld{uid}:"):
            q(mdb, "XA ROLLBACK %s, %s", (g, b))
    q(mdb, "DROP TABLE IF EXISTS " + ", ".join(f"`{t}`" for t in [*made, f"ldm_{uid}", f"ldm_{uid}_claims"]))


def write(sink, batches, commit=True):
    """One branch of ``batches``; committed (or prepared only); an error aborts the branch."""
    intent = sink.plan_batch("q", 0, 1)
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
    try:
        for b in batches:
            sink.write(txn, b)
        h = sink.pre_commit(txn)
    except BaseException:
        sink.abort(txn)
        raise
    if commit:
        sink.verify_prepared(0, [h], prepare_started_at=0.0)
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    return h


def spy_loads(monkeypatch):
    """Count the batches that went in by LOAD DATA (so a test cannot pass on the INSERT path alone)."""
    loads = []
    real = MySqlSink._load

    def load(self, txn, csv, n):
        ok = real(self, txn, csv, n)
        loads.append(ok)
        return ok

    monkeypatch.setattr(MySqlSink, "_load", load)
    return loads


def server_in_plus5(monkeypatch):
    """The sink's new connections start in time_zone '+05:00', as on a server in that zone (set on
    each of them before the sink's own statements; nothing else on the server changes)."""
    real_class = mysql_mod._load_connection_class()

    class InPlus5(real_class):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            with self.cursor() as cur:
                cur.execute("SET SESSION time_zone = '+05:00'")

    monkeypatch.setattr(mysql_base, "_load_connection_class", lambda: InPlus5)


def typed_batch(ids) -> pa.RecordBatch:
    n = len(ids)
    nasty = ['a"b,c\nd\\e\r\t\'x', "ü😀 \u2028", "", "NULL", "\\N", '"', ",", "\n"]
    blobs = [b'\x00"\n\xff,\\', b"", b"NULL", b"\\N", b"\r\n", b"\xc3", b'""', b"x"]
    berlin = [dt.datetime(2024, 3, 31, 1, 30, 0, 123456, tzinfo=BERLIN), dt.datetime(1999, 12, 31, 23, 59, 59)]
    cols = {
        "id": pa.array(ids, pa.int64()),
        "s": pa.array([nasty[i % len(nasty)] if i % 5 else None for i in range(n)], pa.string()),
        "b": pa.array([blobs[i % len(blobs)] if i % 6 else None for i in range(n)], pa.binary()),
        "de": pa.array([decimal.Decimal(f"{i * 37 - 500}.{i % 10000:04d}") if i % 4 else None for i in range(n)],
                       pa.decimal128(20, 4)),
        "d": pa.array([dt.date(1970 + i % 100, 1 + i % 12, 1 + i % 28) if i % 3 else None for i in range(n)],
                      pa.date32()),
        "ts": pa.array([berlin[i % 2].replace(tzinfo=BERLIN) if i % 7 else None for i in range(n)],
                       pa.timestamp("us", tz="Europe/Berlin")),
        "tsl": pa.array([dt.datetime(2020, 1, 1, 12, 0, i % 60, i) if i % 8 else None for i in range(n)],
                        pa.timestamp("us")),
        "bo": pa.array([bool(i % 2) if i % 9 else None for i in range(n)], pa.bool_()),
        "f": pa.array([(i - 50) / 3 * 10 ** (i % 40 - 20) if i % 10 else None for i in range(n)], pa.float64()),
        "f4": pa.array([0.1 * i if i % 11 else None for i in range(n)], pa.float32()),
        "u": pa.array([2 ** 64 - 1 - i if i % 12 else None for i in range(n)], pa.uint64()),
        "tm": pa.array([dt.time(i % 24, i % 60, i % 60, i) if i % 13 else None for i in range(n)], pa.time64("us")),
        "i8": pa.array([(i % 256) - 128 if i % 14 else None for i in range(n)], pa.int8()),
    }
    return pa.record_batch(cols)


def test_every_type_loads_as_the_insert_path_stores_it_nulls_as_null(env, monkeypatch):
    """LOAD DATA (insert mode) and multi-row INSERT (the path of upsert mode and the fallback) store
    the same values for every column type; NULL is NULL, never '' or 0."""
    loaded, inserted = env["table"](), env["table"]()
    loads = spy_loads(monkeypatch)
    data = [typed_batch(list(range(0, 60))), typed_batch(list(range(60, 130)))]
    write(env["make"](loaded), data)
    assert loads == [True, True]
    write(env["make"](inserted, mode="upsert", key_columns=["id"]), data)
    assert loads == [True, True]  # upsert mode never loads
    cols = "id, s, b, de, d, ts, tsl, bo, f, f4, u, tm, i8"
    got = q(env["db"], f"SELECT {cols} FROM `{loaded}` ORDER BY id")
    want = q(env["db"], f"SELECT {cols} FROM `{inserted}` ORDER BY id")
    assert len(got) == 130
    assert got == want
    # Spot checks against the Arrow values, so both paths cannot be wrong the same way.
    by_id = {r[0]: r for r in got}
    assert by_id[8][1] == 'a"b,c\nd\\e\r\t\'x' and by_id[1][1] == "ü😀 \u2028"
    assert by_id[2][1] == "" and by_id[3][1] == "NULL" and by_id[4][1] == "\\N"
    assert by_id[0][1:] == (None,) * 12  # row 0: NULL in every nullable column
    assert by_id[8][2] == b'\x00"\n\xff,\\' and by_id[1][2] == b"" and by_id[2][2] == b"NULL"
    assert by_id[2][5] == dt.datetime(2024, 3, 31, 0, 30, 0, 123456)  # the instant in UTC
    assert by_id[1][5] == dt.datetime(1999, 12, 31, 22, 59, 59)
    assert by_id[1][7] == 1 and by_id[2][7] == 0
    assert by_id[1][10] == 2 ** 64 - 2
    assert by_id[1][3] == decimal.Decimal("-463.0001")
    names = cols.split(", ")[1:]
    nulls = q(env["db"], "SELECT " + ", ".join(f"SUM({c} IS NULL)" for c in names) + f" FROM `{loaded}`")[0]
    assert [int(x) for x in nulls] == [sum(b.column(c).null_count for b in data) for c in names]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("mode", ["insert", "upsert"])
def test_nan_and_infinities_are_refused_by_name_on_both_paths(env, mode, value):
    tbl = env["table"]("id BIGINT PRIMARY KEY, f DOUBLE")
    sink = env["make"](tbl, mode=mode, key_columns=["id"] if mode == "upsert" else None)
    with pytest.raises(MySqlWriteError, match="column 'f' holds NaN or an infinity") as e:
        write(sink, [pa.record_batch({"id": pa.array([1, 2], pa.int64()), "f": pa.array([1.0, value])})])
    assert e.value.column == "f"
    assert q(env["db"], f"SELECT COUNT(*) FROM `{tbl}`")[0][0] == 0


@pytest.mark.parametrize("case", ["bad integer", "null in not null", "duplicate key", "too long"])
def test_a_value_the_server_only_warns_about_fails_the_load(env, monkeypatch, case):
    """With LOCAL, MariaDB turns a bad value, a NULL in a NOT NULL column and a duplicate key into a
    warning even in strict mode (storing 0, the default, or skipping the row): each fails the write."""
    tbl = env["table"]("id BIGINT PRIMARY KEY, n INT NOT NULL, v VARCHAR(3)")
    loads = spy_loads(monkeypatch)
    ids, n, v = [1, 2], pa.array([5, 6], pa.int32()), pa.array(["a", "b"])
    if case == "bad integer":
        n = pa.array(["5", "x"])
    elif case == "null in not null":
        n = pa.array([5, None], pa.int32())
    elif case == "duplicate key":
        ids = [1, 1]
    else:
        v = pa.array(["a", "abcd"])
    with pytest.raises(MySqlWriteError, match=r"LOAD DATA into table .* gave 1 warning\(s\): .*\[warning \d+\]"):
        write(env["make"](tbl), [pa.record_batch({"id": pa.array(ids, pa.int64()), "n": n, "v": v})])
    assert q(env["db"], f"SELECT COUNT(*) FROM `{tbl}`")[0][0] == 0
    assert loads == []  # it raised inside the load


@pytest.mark.parametrize("case", ["bad integer", "null in not null", "too long"])
def test_a_server_without_strict_mode_fails_the_insert_path_on_a_warning_as_the_load_path(env, monkeypatch, case):
    """Issue 49: the INSERT path (upsert mode; insert mode's fallback) on a server without strict mode
    (``sql_mode=''``, MySQL's default before 5.7 and some managed servers'), which stores a bad value
    with a warning: a string cut to the column's length, a NULL made 0, a bad number made 0.  Before,
    the write went through and the branch committed the changed values; now it fails, naming the
    warning, and nothing is stored.  The sink's own sessions run without strict mode here (its
    connections set ``sql_mode=''``), the rest of the server is untouched."""
    real_connect = MySqlSink._connect

    def lax_connect(self, load=False):
        conn = real_connect(self, load)
        with conn.cursor() as cur:
            cur.execute("SET SESSION sql_mode = ''")
        return conn

    monkeypatch.setattr(MySqlSink, "_connect", lax_connect)
    tbl = env["table"]("id BIGINT PRIMARY KEY, n INT NOT NULL, v VARCHAR(3)")
    n, v = pa.array([5, 6], pa.int32()), pa.array(["a", "b"])
    if case == "bad integer":
        n = pa.array(["5", "x"])
    elif case == "null in not null":
        n = pa.array([5, None], pa.int32())
    else:
        v = pa.array(["a", "abcd"])
    batch = pa.record_batch({"id": pa.array([1, 2], pa.int64()), "n": n, "v": v})
    with pytest.raises(MySqlWriteError, match=r"INSERT into table .* gave 1 warning\(s\): .*\[warning \d+\]"):
        write(env["make"](tbl, mode="upsert", key_columns=["id"]), [batch])
    assert q(env["db"], f"SELECT COUNT(*) FROM `{tbl}`")[0][0] == 0
    # The same session mode, good values: written (the check is on warnings, not on the mode).
    good = pa.record_batch({"id": pa.array([1, 2], pa.int64()), "n": pa.array([5, 6], pa.int32()),
                            "v": pa.array(["a", "b"])})
    write(env["make"](tbl, mode="upsert", key_columns=["id"]), [good])
    assert q(env["db"], f"SELECT id, n, v FROM `{tbl}` ORDER BY id") == ((1, 5, "a"), (2, 6, "b"))


@pytest.mark.parametrize("mode", ["insert", "upsert"])
def test_a_server_in_another_time_zone_stores_each_instant_in_a_timestamp_column(env, monkeypatch, mode):
    """A TIMESTAMP column holds instants; the sink sends them as UTC wall time, which the server reads
    in the session's time zone: the server's own unless set.  Before, a server in +05:00 stored
    every instant 5 hours early (insert mode's LOAD and upsert mode's INSERT alike).  The sink's
    sessions start as a server in +05:00 would start them (the test sets it on each new connection
    of the sink's, nothing else on the server changes); the instants read back as epoch seconds."""
    server_in_plus5(monkeypatch)
    loads = spy_loads(monkeypatch)
    tbl = env["table"]("id BIGINT PRIMARY KEY, t TIMESTAMP(6) NULL, w DATETIME(6) NULL")
    instants = [dt.datetime(2026, 11, 29, 9, 30, 0, 250000, tzinfo=dt.UTC),
                dt.datetime(2024, 3, 31, 1, 30, tzinfo=BERLIN)]
    batch = pa.record_batch({"id": pa.array([1, 2], pa.int64()),
                             "t": pa.array(instants, pa.timestamp("us", tz="UTC")),
                             "w": pa.array(instants, pa.timestamp("us", tz="UTC"))})
    sink = env["make"](tbl, mode=mode, **({"key_columns": ["id"]} if mode == "upsert" else {}))
    write(sink, [batch])
    assert loads == ([True] if mode == "insert" else [])
    got = q(env["db"], f"SELECT id, UNIX_TIMESTAMP(t), w FROM `{tbl}` ORDER BY id")
    assert [(i, float(e)) for i, e, _ in got] == [(n + 1, x.timestamp()) for n, x in enumerate(instants)]
    # A DATETIME has no zone: it holds the instant's UTC wall time (docs/mysql.md).
    assert [w for _, _, w in got] == [x.astimezone(dt.UTC).replace(tzinfo=None) for x in instants]


def test_a_server_that_refuses_local_loads_gets_inserts_and_one_log_line(env, monkeypatch, caplog):
    """The real server's refusal (here: the connection does not offer LOCAL, answered as with
    local_infile=OFF): the batch goes in by INSERT inside the same branch; logged once."""
    tbl = env["table"]("id BIGINT PRIMARY KEY, v VARCHAR(10)")
    sink = env["make"](tbl)
    real = MySqlSink._connect
    monkeypatch.setattr(MySqlSink, "_connect", lambda self, load=False: real(self, load=False))
    loads = spy_loads(monkeypatch)
    caplog.set_level(logging.INFO, logger="twophase.sinks.mysql")
    for first in (1, 3):
        write(sink, [pa.record_batch({"id": pa.array([first, first + 1], pa.int64()), "v": ["a", None]})])
    assert loads == [False]  # the second branch does not ask again
    assert q(env["db"], f"SELECT id, v FROM `{tbl}` ORDER BY id") == ((1, "a"), (2, None), (3, "a"), (4, None))
    lines = [r for r in caplog.records if "refuses LOAD DATA LOCAL" in r.getMessage()]
    assert len(lines) == 1
    assert "[error 4166]" in lines[0].getMessage() or "[error 1148]" in lines[0].getMessage()


# ------------------------------------------------------------------ the file-name fence, no server
class _FakeConn:
    """What ``_Result._read_load_local_packet`` uses of a connection."""

    def __init__(self, armed, local_infile=True):
        self._local_infile = local_infile
        self._twophase_infile = armed
        self.sent: list[bytes] = []

    def write_packet(self, data):
        self.sent.append(bytes(data))

    def _read_packet(self):
        from pymysql.connections import MysqlPacket

        return MysqlPacket(b"\x00\x00\x00\x02\x00\x00\x00", "utf8")  # OK, 0 rows, 0 warnings


def _request(conn, name: bytes):
    from pymysql.connections import MysqlPacket

    cls = mysql_mod._load_connection_class()
    result = cls._result_class(conn)
    result._read_load_local_packet(MysqlPacket(b"\xfb" + name, "utf8"))
    return result


@pytest.mark.parametrize("armed,name,local_infile", [
    ((b"twophase-1.csv", b"1,2\n"), b"/etc/passwd", True),  # another name while a batch is armed
    (None, b"/etc/passwd", True),  # a request while no statement of ours loads
    ((b"twophase-1.csv", b"1,2\n"), b"twophase-1.csv", False),  # a connection that offered no LOCAL loads
])
def test_a_server_request_for_another_file_is_refused_and_nothing_sent(armed, name, local_infile):
    import pymysql

    conn = _FakeConn(armed, local_infile)
    with pytest.raises(pymysql.err.OperationalError, match="refused the server's LOAD DATA LOCAL request for "
                                                           + repr(name)):
        _request(conn, name)
    assert conn.sent == [b""]  # the end of data only: the server loads nothing


def test_the_armed_buffer_is_sent_to_a_request_for_its_name():
    conn = _FakeConn((b"twophase-1.csv", b"x" * (mysql_mod._LOAD_CHUNK + 5)))
    result = _request(conn, b"twophase-1.csv")
    assert conn.sent == [b"x" * mysql_mod._LOAD_CHUNK, b"x" * 5, b""]
    assert result.warning_count == 0


def test_a_load_that_stores_fewer_rows_than_the_batch_fails(env, monkeypatch):
    """A row the server skips without a warning (here: the CSV made one short) fails the write."""
    tbl = env["table"]("id BIGINT PRIMARY KEY, v VARCHAR(10)")
    real = mysql_mod._csv_table
    monkeypatch.setattr(mysql_rows, "_csv_table", lambda b: real(b).slice(0, b.num_rows - 1))
    with pytest.raises(MySqlWriteError, match="stored 2 of 3 rows"):
        write(env["make"](tbl), [pa.record_batch({"id": pa.array([1, 2, 3], pa.int64()), "v": ["a", "b", "c"]})])
    assert q(env["db"], f"SELECT COUNT(*) FROM `{tbl}`")[0][0] == 0


def test_identifiers_with_backticks_quotes_and_percent_are_quoted_in_the_load(env, monkeypatch):
    name = f"ld_{env['uid']}_q`%'\""
    env["db"].cursor().execute(f"CREATE TABLE `{name.replace('`', '``')}` (id BIGINT PRIMARY KEY, "
                               "`v`` %s '\"` VARCHAR(10)) ENGINE=InnoDB")
    try:
        loads = spy_loads(monkeypatch)
        write(env["make"](name), [pa.record_batch({"id": pa.array([1], pa.int64()), "v` %s '\"": ["x"]})])
        assert loads == [True]
        assert q(env["db"], f"SELECT id, `v`` %s '\"` FROM `{name.replace('`', '``')}`") == ((1, "x"),)
    finally:
        env["db"].cursor().execute(f"DROP TABLE IF EXISTS `{name.replace('`', '``')}`")


def test_identifiers_with_percent_are_quoted_in_upsert_mode_too(env):
    """Upsert mode writes by INSERT ... ON DUPLICATE KEY UPDATE with %s placeholders: a '%' in a quoted
    table or column name must reach the server as it is (it was read as a placeholder: a format error)."""
    name = f"ld_{env['uid']}_u%s`%'"
    quoted = f"`{name.replace('`', '``')}`"
    env["db"].cursor().execute(f"CREATE TABLE {quoted} (id BIGINT PRIMARY KEY, `v%d %s` VARCHAR(10)) ENGINE=InnoDB")
    try:
        sink = env["make"](name, mode="upsert", key_columns=["id"])
        write(sink, [pa.record_batch({"id": pa.array([1, 2], pa.int64()), "v%d %s": ["x", "y"]})])
        write(env["make"](name, mode="upsert", key_columns=["id"]),
              [pa.record_batch({"id": pa.array([2], pa.int64()), "v%d %s": ["z"]})])
        assert q(env["db"], f"SELECT id, `v%d %s` FROM {quoted} ORDER BY id") == ((1, "x"), (2, "z"))
    finally:
        env["db"].cursor().execute(f"DROP TABLE IF EXISTS {quoted}")


def test_the_load_csv_quotes_every_text_value_and_leaves_numbers_dates_and_nulls_bare():
    """Without a server: the CSV LOAD DATA reads quotes each valid value of a text or binary column, whatever
    it holds (the string "NULL" and the empty string too: bare, LOAD DATA would read NULL or ''), and writes
    numbers, dates, times and NULL bare (quoting them stores the same, in more bytes for the server to read)."""
    import pyarrow.csv as pcsv

    batch = pa.record_batch({
        "id": pa.array([7, None], pa.int64()), "s": pa.array(["NULL", ""], pa.string()),
        "b": pa.array([b"NULL", None], pa.binary()), "de": pa.array([decimal.Decimal("1.50"), None], pa.decimal128(5, 2)),
        "f": pa.array([0.5, None], pa.float64()), "d": pa.array([dt.date(2024, 1, 2), None], pa.date32()),
        "ts": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5, 6), None], pa.timestamp("us")),
        "bo": pa.array([True, None], pa.bool_())})
    out = pa.BufferOutputStream()
    pcsv.write_csv(mysql_mod._csv_table(batch), out, mysql_mod._csv_options())
    assert out.getvalue().to_pybytes() == (b'7,"NULL","NULL",1.50,0.5,2024-01-02,2024-01-02 03:04:05.000006,1\n'
                                           b'NULL,"",NULL,NULL,NULL,NULL,NULL,NULL\n')


class _Listed:
    """A cursor that has run a statement with ``listed`` warnings and notes (SHOW WARNINGS' rows)."""

    def __init__(self, listed):
        self.listed, self.warning_count, self.ran = listed, len(listed), []

    def execute(self, sql):
        self.ran.append(sql)

    def fetchall(self):
        return self.listed


def test_mysql8s_deprecation_warning_on_every_upsert_is_not_taken_for_a_bad_value():
    """MySQL 8.0.20+ warns 1287 ("'VALUES function' is deprecated") on every INSERT ... ON DUPLICATE KEY
    UPDATE ... VALUES(c): a warning about the statement, which must not fail every upsert batch (MySQL 8
    is not installable here: a cursor that lists what MySQL 8 lists; the real-server twins are the
    warning tests above, on MariaDB).  A value's warning beside it still fails the write."""
    sink = MySqlSink("127.0.0.1", 3306, "db", "t", user="u", password="p", mode="upsert", key_columns=["id"])
    deprecated = ("Warning", 1287, "'VALUES function' is deprecated and will be removed in a future release.")
    sink._refuse_warnings(_Listed([deprecated, ("Note", 1265, "Data truncated for column 'd' at row 1")]),
                          "label", "INSERT")
    with pytest.raises(MySqlWriteError, match=r"Data truncated for column 's' at row 2 \[warning 1265\]"):
        sink._refuse_warnings(_Listed([deprecated, ("Warning", 1265, "Data truncated for column 's' at row 2")]),
                              "label", "INSERT")
