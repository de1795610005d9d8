"""twophase.testing on PostgresSink against the real PostgreSQL server: rows read back with SELECT."""

from __future__ import annotations

import uuid

import pytest

from twophase.testing import run_sink_conformance

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


def test_postgres_sink_conformance(postgres_service, monkeypatch):
    import psycopg2

    from twophase.sinks.postgres import PostgresSink

    svc = postgres_service
    # The password by reference, so that recovery can rebuild the sink from to_config() as an operator would.
    monkeypatch.setenv("TWOPHASE_CONFORMANCE_PGPASSWORD", svc["password"])
    dsn = f"host={svc['host']} port={svc['port']} dbname={svc['dbname']} user={svc['user']}"
    uid = uuid.uuid4().hex[:8]
    table, gid_prefix = f"conf_{uid}", f"tc{uid}"
    admin = psycopg2.connect(svc["dsn"])
    admin.autocommit = True

    def make_sink() -> PostgresSink:
        return PostgresSink(dsn, table, password={"env": "TWOPHASE_CONFORMANCE_PGPASSWORD"}, gid_prefix=gid_prefix, marker_table=f"conf_markers_{uid}",
                            lock_timeout="10s")

    def read_committed() -> list[int]:
        with admin.cursor() as cur:
            cur.execute(f'SELECT id FROM "{table}"')
            return [r[0] for r in cur.fetchall()]

    def pending() -> list[str]:
        with admin.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                        "AND left(gid, length(%s)) = %s", (gid_prefix + ":", gid_prefix + ":"))
            return [r[0] for r in cur.fetchall()]

    try:
        with admin.cursor() as cur:
            cur.execute(f'CREATE TABLE "{table}" (id bigint NOT NULL, payload text)')
        run_sink_conformance(make_sink, read_committed, pending=pending)  # the harness' defaults
    finally:
        with admin.cursor() as cur:
            for (gid,) in [(g,) for g in pending()]:
                cur.execute("ROLLBACK PREPARED %s", (gid,))
            cur.execute(f'DROP TABLE IF EXISTS "{table}", "conf_markers_{uid}", "conf_markers_{uid}_claims"')
        admin.close()
