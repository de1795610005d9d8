"""Beyond Flink: a decided batch of which nothing exists any more and nothing was ever visible runs
again instead of stopping the pipeline for good (or being dropped).

Flink's choice for a transaction that can no longer be committed after the decision is to fail
or to ignore it.  When the sink *proves* that every transaction of the decision is gone and
none of it was ever visible (PostgreSQL: the prepared transaction does not exist and its
marker row, written in the same transaction as the rows, is absent), nothing of the batch is
visible: the coordinator records the decision as void and runs the batch again, from the rows
Spark replays.  Where part of the batch is visible, it stays data loss.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from twophase.coordinator import Coordinator
from twophase.errors import DataLossError
from twophase.log import TransactionLog
from twophase.sinks.postgres import PostgresSink

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.timeout(600)]


class _DriverDied(BaseException):
    """The driver dies between the decision and (the rest of) its commit."""


#: Commits let through before the driver "dies", by sink name (a hook, never pickled).
_LET_THROUGH: dict[str, int] = {}


class _DiesInCommit(PostgresSink):
    def commit(self, handle):
        key = self.gid_prefix
        if _LET_THROUGH.get(key, 0) <= 0:
            raise _DriverDied()
        _LET_THROUGH[key] -= 1
        return super().commit(handle)


def _table(db) -> str:
    name = f"vanish_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{name}" (id bigint PRIMARY KEY)')
    return name


def _ids(db, table: str) -> Counter:
    with db.cursor() as cur:
        cur.execute(f'SELECT id FROM "{table}"')
        return Counter(r[0] for r in cur.fetchall())


def _roll_back_prepared(db, prefix: str) -> int:
    """What an operator's cleanup (or a restore) does to the batch's prepared transactions."""
    with db.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE left(gid, length(%s)) = %s", (prefix, prefix))
        gids = [r[0] for r in cur.fetchall()]
    old = db.autocommit
    db.autocommit = True
    try:
        with db.cursor() as cur:
            for g in gids:
                cur.execute("ROLLBACK PREPARED %s", (g,))
    finally:
        db.autocommit = old
    return len(gids)


def _decided_then_died(dsn: str, table: str, prefix: str, log_url: str, df, let_through: int) -> None:
    _LET_THROUGH[prefix] = let_through
    a = Coordinator(_DiesInCommit(dsn, table, gid_prefix=prefix), log_location=log_url, name="vanish",
                    parallelism=2, commit_parallelism=1, commit_retries=0)
    with pytest.raises(_DriverDied):
        a.write(df, batch_id=0)
    a.close()


def test_a_decided_batch_whose_transactions_were_all_rolled_back_runs_again_instead_of_stopping(
        postgres_service, spark, db, tmp_path):
    """Decided, then every prepared transaction rolled back before the commit: before, every restart
    raised DataLossError ("marker row is absent: it was rolled back") and the pipeline could not go
    on; now the decision is void and the batch lands once."""
    table, log_url, prefix = _table(db), str(tmp_path / "log"), f"v{uuid.uuid4().hex[:6]}"
    df = spark.range(0, 60, numPartitions=2)
    _decided_then_died(postgres_service["dsn"], table, prefix, log_url, df, let_through=0)
    assert _roll_back_prepared(db, prefix + ":") == 2
    assert _ids(db, table) == Counter()

    b = Coordinator(PostgresSink(postgres_service["dsn"], table, gid_prefix=prefix), log_location=log_url,
                    name="vanish", parallelism=2)
    progress = b.write(df, batch_id=0)
    b.close()
    assert progress["action"] == "committed" and progress["rows"] == 60
    assert _ids(db, table) == Counter(range(60))
    log = TransactionLog(log_url, readonly=True)
    log.generation = 1
    view = log.view(0)
    assert [(bl.ballot, bl.void is not None, bl.committed) for bl in view.ballots] == [(0, True, False),
                                                                                       (1, False, True)]
    assert view.committed is not None
    # A replay after that skips it: decided once, visible once.
    again = Coordinator(PostgresSink(postgres_service["dsn"], table, gid_prefix=prefix), log_location=log_url,
                        name="vanish", parallelism=2)
    assert again.write(df, batch_id=0)["action"] == "skipped"
    again.close()
    assert _ids(db, table) == Counter(range(60))


def test_a_decided_batch_partly_visible_and_partly_rolled_back_stays_data_loss(postgres_service, spark, db,
                                                                                tmp_path):
    """One transaction committed (visible), the other rolled back: running the batch again would
    duplicate the visible part, so it is data loss, named as such."""
    table, log_url, prefix = _table(db), str(tmp_path / "log"), f"v{uuid.uuid4().hex[:6]}"
    df = spark.range(0, 60, numPartitions=2)
    _decided_then_died(postgres_service["dsn"], table, prefix, log_url, df, let_through=1)
    assert _roll_back_prepared(db, prefix + ":") == 1
    visible = _ids(db, table)
    assert 0 < sum(visible.values()) < 60

    b = Coordinator(PostgresSink(postgres_service["dsn"], table, gid_prefix=prefix), log_location=log_url,
                    name="vanish", parallelism=2)
    with pytest.raises(DataLossError, match="DATA LOSS: batch 0 was decided") as info:
        b.write(df, batch_id=0)
    assert "marker row is absent" in str(info.value)
    b.close()
    assert _ids(db, table) == visible  # nothing written twice
