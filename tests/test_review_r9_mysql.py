"""Review r9 of MySqlSink's upsert check (issue 61): ``open()`` refuses a table with another unique index,
but (a) a unique index on a *prefix* of the key column passes as an index "on exactly the key" (or as a
harmless superset), and ON DUPLICATE KEY UPDATE fires on it: a new key sharing the prefix overwrites
another key's row; (b) the check runs at ``open()`` only (the coordinator's streaming form opens once),
so a unique index a DBA adds while the query runs silently overwrites rows of other keys.
On the real MariaDB server, in process."""

from __future__ import annotations

import pyarrow as pa
import pytest

from tests.inprocess import run_attempt
from tests.test_mysql_dba_tables import _email_table, emails
from tests.test_mysql_overlaps import MyTable
from twophase import TransactionContext
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.sink import CommitOutcome

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(300)]


def test_r9_upsert_with_a_unique_prefix_index_on_the_key_column_loses_no_row(mariadb_service):
    with MyTable(mariadb_service, "r9pfx") as t:
        t.q(f"DROP TABLE `{t.name}`")
        t.q(f"CREATE TABLE `{t.name}` (k VARCHAR(20) NOT NULL PRIMARY KEY, v VARCHAR(100), "
            "UNIQUE KEY k3 (k(3))) ENGINE=InnoDB")
        t.q(f"INSERT INTO `{t.name}` VALUES ('abcX', 'old')")
        sink = t.sink(mode="upsert", key_columns=["k"])
        try:
            sink.open()
        except ConfigurationError as e:
            # refused at open(), naming the prefix index as another unique index: nothing lost (the fix)
            assert "another unique index, `k3` on (`k`(3))" in str(e), e
            assert t.q(f"SELECT k, v FROM `{t.name}` ORDER BY k") == [("abcX", "old")]
            return
        h = run_attempt(sink, TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1)),
                        pa.record_batch({"k": ["abcY"], "v": ["new"]}))
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        # HEAD: [('abcX', 'new')]: abcY never written, abcX overwritten, no error.
        assert t.q(f"SELECT k, v FROM `{t.name}` ORDER BY k") == [("abcX", "old"), ("abcY", "new")]


def test_r9_a_unique_index_added_after_open_does_not_silently_overwrite_another_keys_row(mariadb_service):
    with MyTable(mariadb_service, "r9late") as t:
        _email_table(t)
        t.q(f"ALTER TABLE `{t.name}` DROP INDEX email_u")
        sink = t.sink(mode="upsert", key_columns=["id"])
        sink.open()                                                # accepted: no other unique index yet
        t.q(f"ALTER TABLE `{t.name}` ADD UNIQUE KEY email_u (email)")   # a DBA, while the query runs
        try:
            h = run_attempt(sink, TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1)),
                            emails([(2, "a@x", "new")]))
            res = sink.commit(h)
        except TwoPhaseError as e:
            # refused by the task before XA START, naming the index and the remedy: nothing lost (the fix)
            assert "another unique index, `email_u` on (`email`)" in str(e) and "drop it" in str(e), e
            assert t.prepared() == []
            res = None
        rows = t.q(f"SELECT id, email, v FROM `{t.name}` ORDER BY id")
        # HEAD: committed, [(1, 'a@x', 'new')]: id 2 never written, id 1 overwritten, no error.
        assert rows == [(1, "a@x", "old")] or (2, "a@x", "new") in rows, (res, rows)
