"""Issue 25: a late task attempt of a generation that a new generation replaced.

A pipeline restarted from a new checkpoint (``new_generation=True``) leaves its old generation
behind; a late actor of the old one (a zombie task, a stage retry that began after its batch's
cleanup) prepares its transaction afterwards, under the old generation's scoped name.  No batch of
the old generation ever runs again, and every sink's sweep of late leftovers is by query name, so
before the fix nothing ever found it: a PostgreSQL prepared transaction held its locks and a
``max_prepared_transactions`` slot for good, a staged file stayed forever.  Now the new
generation's recovery (``TwoPhaseProtocol.recover``, run before its first batch) runs, for each
replaced generation, the cleanup that generation's next batch would have run.

The protocol runs here without Spark (its ``BatchWork`` runs the one task in-process), on a real
transaction log, against the real target: local files, and the PostgreSQL server.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.inprocess import Driver, PgTable, ids, run_attempt
from twophase import TransactionContext
from twophase.sink import CommitOutcome

pytestmark = [pytest.mark.timeout(300)]


def replace_generation_with_a_late_attempt_in_between(make_sink, log_url: str) -> tuple[Any, Driver]:
    """Generation 1 commits batches 0 and 1 and stops; a late attempt of its batch 1 (next attempt
    number, same INTENT) pre-commits afterwards; generation 2 starts on the same log and target and
    runs its batch 0.  Returns the late attempt's handle and generation 2's driver."""
    old = Driver(make_sink(), log_url, "query-1")
    assert old.batch(0, ids(1, 2)).action == "committed"
    assert old.batch(1, ids(3)).action == "committed"
    intent1, old_name = old.intent(1), old.query_name
    old.close()
    late = run_attempt(make_sink(), TransactionContext(old_name, 1, 0, 1, intent1, "e1late0"), ids(99))
    new = Driver(make_sink(), log_url, "query-2", new_generation=True)
    assert new.tlog.generation == 2 and new.query_name != old_name
    assert new.batch(0, ids(10, 11)).action == "committed"
    return late, new


def test_a_late_staged_file_of_a_replaced_generation_is_swept_by_the_new_generations_recovery(tmp_path):
    from twophase.sinks.files import FileSink

    out = tmp_path / "out"

    def make_sink() -> FileSink:
        return FileSink(str(out), format="jsonl")

    late, new = replace_generation_with_a_late_attempt_in_between(make_sink, str(tmp_path / "log"))
    try:
        assert not os.path.exists(late["staging"]), \
            "the late attempt's staged file of the replaced generation is still there"
        visible = sorted(p for p in os.listdir(out) if not p.startswith("_"))
        rows = sorted(json.loads(line)["id"] for p in visible for line in open(out / p) if line.strip())
        assert rows == [1, 2, 3, 10, 11]  # the late attempt's row 99 never visible
        assert make_sink().commit(late).outcome is CommitOutcome.LOST  # swept: it can never be published
    finally:
        new.close()


@pytest.mark.postgres
def test_a_late_prepared_transaction_of_a_replaced_generation_is_rolled_back_by_the_new_generations_recovery(
        postgres_service, tmp_path):
    with PgTable(postgres_service["dsn"], "regen") as t:
        late, new = replace_generation_with_a_late_attempt_in_between(t.sink, str(tmp_path / "log"))
        try:
            assert late["gid"] not in t.prepared(), \
                "the late attempt of the replaced generation is still prepared (its locks and slot held for good)"
            assert t.ids() == [1, 2, 3, 10, 11]
            assert t.sink().commit(late).outcome is CommitOutcome.LOST  # rolled back: never visible
        finally:
            new.close()
