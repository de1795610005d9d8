"""twophase.testing on MySqlSink against the real MariaDB server: rows read back with SELECT."""

from __future__ import annotations

import uuid

import pytest

from twophase.testing import run_sink_conformance

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(300)]


def test_mysql_sink_conformance(mariadb_service, monkeypatch):
    import pymysql

    from twophase.sinks.mysql import MySqlSink

    s = mariadb_service
    # The password by reference, so that recovery can rebuild the sink from to_config() as an operator would.
    monkeypatch.setenv("TWOPHASE_CONFORMANCE_MYSQLPASSWORD", s["password"])
    uid = uuid.uuid4().hex[:8]
    table, markers, gid_prefix = f"conf_{uid}", f"conf_markers_{uid}", f"tc{uid}"
    admin = pymysql.connect(host=s["host"], port=s["port"], user=s["user"], password=s["password"],
                            database=s["database"], autocommit=True)

    def make_sink() -> MySqlSink:
        return MySqlSink(s["host"], s["port"], s["database"], table, user=s["user"],
                         password={"env": "TWOPHASE_CONFORMANCE_MYSQLPASSWORD"}, gid_prefix=gid_prefix,
                         marker_table=markers, lock_wait_timeout=10)

    def read_committed() -> list[int]:
        with admin.cursor() as cur:
            cur.execute(f"SELECT id FROM `{table}`")
            return [r[0] for r in cur.fetchall()]

    def pending() -> list[tuple[str, str]]:
        with admin.cursor() as cur:
            cur.execute("XA RECOVER")
            out = []
            for _f, glen, blen, data in cur.fetchall():
                g, b = data[:glen].decode(), data[glen:glen + blen].decode()
                if g.startswith(gid_prefix + ":"):
                    out.append((g, b))
            return out

    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE TABLE `{table}` (id BIGINT NOT NULL, payload TEXT) ENGINE=InnoDB")
        # Fewer examples than the harness default (25): under a minute on a loaded 2-core box.
        run_sink_conformance(make_sink, read_committed, pending=pending, max_examples=12, ownership_examples=12)
    finally:
        with admin.cursor() as cur:
            for g, b in pending():
                cur.execute("XA ROLLBACK %s, %s", (g, b))
            cur.execute(f"DROP TABLE IF EXISTS `{table}`, `{markers}`")
        admin.close()
