"""Review of the sink's session time zone (``SET SESSION time_zone = '+00:00'`` in ``_connect``).

Against the real MariaDB (127.0.0.1:13306).  A server in another zone is simulated as the commit's
own test does: a session whose ``time_zone`` is '+05:00' (the sink's connection class runs it before
the sink's own SET, or a plain session of the test's).  Plain tests: concerns that hold; the one
finding (naive timestamps into a TIMESTAMP column) is a semantics the sink now states and pins.
"""
# ruff: noqa: F811 - the tests take the imported fixture `env` by name

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from tests.test_mysql_load import env, q, server_in_plus5, spy_loads, write  # noqa: F401 - env is a fixture
from twophase.sinks import mysql as mysql_mod
from twophase.sinks.mysql import MySqlWriteError

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(60)]


def test_claims_made_by_a_session_in_another_zone_are_dropped_by_the_listing_time_as_before(env, monkeypatch):
    """Rolling upgrade: an executor without the SET (its session in the server's +05:00) claims a
    branch; the upgraded driver reads NOW(6) in UTC and drops claims made before it.  The claims'
    ``at`` is a TIMESTAMP (an instant), so the comparison holds across zones: the earlier claim is
    dropped, one made after the listing is kept."""
    server_in_plus5(monkeypatch)
    sink = env["make"](env["table"]("id BIGINT PRIMARY KEY"))
    claims = mysql_mod.quote_ident(sink.claims_table)
    db = env["db"]
    head = sink.query_prefix("q")
    q(db, "SET SESSION time_zone = '+05:00'")
    try:
        q(db, f"INSERT INTO {claims} (gtrid, bqual, state) VALUES (%s, 'b', 'decided')", (head + "old",))
        conn = sink._driver_conn()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT NOW(6)")
                listed_at = cur.fetchone()[0]
            q(db, "DO SLEEP(0.01)")
            q(db, f"INSERT INTO {claims} (gtrid, bqual, state) VALUES (%s, 'b', 'decided')", (head + "new",))
            n = sink._drop_claims(conn, head, set(), listed_at)
        finally:
            sink._release(conn)
    finally:
        q(db, "SET SESSION time_zone = DEFAULT")
    left = [g.decode() if isinstance(g, bytes) else g for (g,) in q(db, f"SELECT gtrid FROM {claims}")]
    assert (n, left) == (1, [head + "new"])


@pytest.mark.parametrize("mode", ["insert", "upsert"])
@pytest.mark.parametrize("when", [dt.datetime(1960, 1, 1, tzinfo=dt.UTC), dt.datetime(2040, 1, 1, tzinfo=dt.UTC)])
def test_an_instant_outside_the_timestamp_range_fails_the_write_naming_the_column(env, mode, when):
    """Before 1970 or after 2038 a TIMESTAMP column cannot hold an instant in any zone: the write fails
    (nothing stored), and the error names the column."""
    tbl = env["table"]("id BIGINT PRIMARY KEY, t TIMESTAMP(6) NULL")
    batch = pa.record_batch({"id": pa.array([1], pa.int64()), "t": pa.array([when], pa.timestamp("us", tz="UTC"))})
    sink = env["make"](tbl, mode=mode, **({"key_columns": ["id"]} if mode == "upsert" else {}))
    with pytest.raises(MySqlWriteError) as ei:
        write(sink, [batch])
    assert "`t`" in str(ei.value) or "'t'" in str(ei.value) or ei.value.column == "t", str(ei.value)
    assert q(env["db"], f"SELECT COUNT(*) FROM `{tbl}`") == ((0,),)


@pytest.mark.parametrize("mode", ["insert", "upsert"])
def test_a_naive_timestamp_into_a_timestamp_column_is_taken_as_utc_wall_time_whatever_the_servers_zone(
        env, monkeypatch, mode):
    """R7's finding, decided: a naive (tz-less) Arrow timestamp (Spark's TIMESTAMP_NTZ) has no instant;
    a TIMESTAMP column needs one, and the sink's sessions (time_zone '+00:00') take the wall time as
    UTC, on a server in any zone (docs/mysql.md).  Before the session zone was set, it was taken in
    the server's zone, and every tz-aware instant was stored shifted by the server's offset."""
    server_in_plus5(monkeypatch)
    loads = spy_loads(monkeypatch)
    tbl = env["table"]("id BIGINT PRIMARY KEY, t TIMESTAMP(6) NULL")
    wall = dt.datetime(2026, 11, 29, 9, 30, 0, 250000)
    batch = pa.record_batch({"id": pa.array([1], pa.int64()), "t": pa.array([wall], pa.timestamp("us"))})
    sink = env["make"](tbl, mode=mode, **({"key_columns": ["id"]} if mode == "upsert" else {}))
    write(sink, [batch])
    assert loads == ([True] if mode == "insert" else [])
    db = env["db"]
    q(db, "SET SESSION time_zone = '+05:00'")
    try:
        got = q(db, f"SELECT t, UNIX_TIMESTAMP(t) FROM `{tbl}`")
    finally:
        q(db, "SET SESSION time_zone = DEFAULT")
    # A reader in +05:00 sees 14:30:00.25 for the 09:30:00.25 sent: the instant 09:30:00.25 UTC.
    assert got[0][0] == wall + dt.timedelta(hours=5)
    assert float(got[0][1]) == wall.replace(tzinfo=dt.UTC).timestamp()
