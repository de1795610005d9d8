"""Issue 45, scenario 4: a decided batch whose every transaction vanished, in the data source form
and under ``twophase recover``.

The coordinator records such a decision void and runs the batch again (tests/test_vanished_batches.py).
The data source form's plan step called ``open_ballot`` directly, where nothing voided it: a decided
PostgreSQL batch whose prepared transactions a DBA rolled back stopped the query at every restart,
with a message saying the coordinator would run it again; ``twophase recover`` had no way out either.

On a real PostgreSQL server, the plan and commit steps of ``twophase.datasource`` run in-process
(Spark runs the same functions in its planner worker).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from tests.inprocess import OneTask, PgTable, ids
from twophase.datasource import TaskMessage, _plan, _Settings, _Steps
from twophase.log import TransactionLog
from twophase.recovery import recover

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


def _decided_then_rolled_back_by_a_dba(t: PgTable, settings: _Settings) -> None:
    """Plan batch 2, its task pre-commits, the commit step decides and dies; a DBA then rolls the
    prepared transaction back."""
    sink = t.sink()
    plan = _plan(sink, settings)
    assert plan.action == "write"
    results = OneTask(sink, ids(1, 2)).prepare(plan.query_name, 2, plan.intent, plan.run)
    protocol = _Steps(sink, settings, plan)._protocol(plan)
    assert protocol.tlog.mine(protocol.tlog.decide(2, plan.number, {"handles": [r["handle"] for r in results],
                                                                    "rows": 2}))
    assert len(t.prepared()) == 1
    for gid in t.prepared():
        t.execute("ROLLBACK PREPARED %s", (gid,))


def _write(t: PgTable, settings: _Settings, rows) -> str:
    """One run of the batch write: plan, its task, the commit step."""
    sink = t.sink()
    plan = _plan(sink, settings)
    if plan.action != "write":
        return plan.action
    [r] = OneTask(sink, rows).prepare(plan.query_name, 2, plan.intent, plan.run)
    _Steps(sink, settings, plan)._commit([TaskMessage(asdict(plan), 0, 0, r["rows"], json.dumps(r["handle"]))], 2)
    return "committed"


def test_a_vanished_decided_batch_in_the_data_source_form_runs_again_instead_of_stopping_every_restart(
        postgres_service, tmp_path):
    settings = _Settings({"twophase.loglocation": str(tmp_path / "log"), "twophase.batchid": "2"}, "jdbc",
                         streaming=False)
    with PgTable(postgres_service["dsn"], "vands") as t:
        _decided_then_rolled_back_by_a_dba(t, settings)
        assert _write(t, settings, ids(1, 2)) == "committed"   # was: BatchVanishedError, at every run
        assert _write(t, settings, ids(1, 2)) == "skipped"
        assert t.ids() == [1, 2]
        assert t.prepared() == []
        ballots = TransactionLog(str(tmp_path / "log"), readonly=True)
        ballots.generation = 1
        view = ballots.view(2)
        assert [(b.ballot, b.void is not None, b.committed) for b in view.ballots] == [(0, True, False),
                                                                                        (1, False, True)]


def test_twophase_recover_records_a_vanished_decision_void_and_the_next_run_writes_the_batch(
        postgres_service, tmp_path):
    settings = _Settings({"twophase.loglocation": str(tmp_path / "log"), "twophase.batchid": "2"}, "jdbc",
                         streaming=False)
    with PgTable(postgres_service["dsn"], "vancli") as t:
        _decided_then_rolled_back_by_a_dba(t, settings)
        report = recover(str(tmp_path / "log"), t.sink(), takeover=True)   # was: BatchVanishedError
        assert report.voided == [2] and report.lost == [] and report.committed_batches == []
        assert t.ids() == []
        assert _write(t, settings, ids(1, 2)) == "committed"
        assert t.ids() == [1, 2] and t.prepared() == []
