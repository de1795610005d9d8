"""Issue 48: the committer keeps "nothing of this batch is committed yet" provable until its first
commit succeeds.  It commits a decided batch's first transaction alone, then the others; a first
transaction found gone and never visible (aborted by the target: a timeout, another actor's claim
landing between the decision's check and the commit) then makes the whole batch void: the others
are aborted and the batch runs again, instead of being half visible (data loss).

A unit test on a sink of its own (the committer's order, without a server); the real broker's twin
is tests/test_kafka_timeout.py's zombie case."""

from __future__ import annotations

import pytest

from twophase.errors import BatchVanishedError, CommitError, DataLossError
from twophase.recovery import Committer
from twophase.sink import CommitResult, TwoPhaseCommitSink


class StateSink(TwoPhaseCommitSink):
    """Transactions by name: "staged" -> "committed" | "aborted"; the rows of committed ones are visible."""

    kind = "state"

    def __init__(self, states: dict[str, str]):
        self.states = dict(states)
        self.calls: list[tuple[str, str]] = []
        self.unreachable: set[str] = set()

    def commit(self, handle):
        k = handle["txn"]
        self.calls.append(("commit", k))
        if self.states[k] == "pending":  # its fate not readable (yet)
            return CommitResult.retry_later(f"{k}: not known yet")
        if self.states[k] == "aborted":
            return CommitResult.lost(f"{k} was aborted", never_visible=True)
        if self.states[k] == "committed":
            return CommitResult.already_committed()
        self.states[k] = "committed"
        return CommitResult.committed()

    def recover_and_abort(self, handle):
        k = handle["txn"]
        self.calls.append(("abort", k))
        if k in self.unreachable:
            raise ConnectionError(f"{k}: the target did not answer")
        if self.states[k] == "staged":
            self.states[k] = "aborted"

    def begin_transaction(self, ctx):  # pragma: no cover - driver side only here
        raise NotImplementedError

    def write(self, txn, batch):  # pragma: no cover
        raise NotImplementedError

    def pre_commit(self, txn):  # pragma: no cover
        raise NotImplementedError

    def abort(self, txn):  # pragma: no cover
        raise NotImplementedError


HANDLES = [{"txn": "a"}, {"txn": "b"}, {"txn": "c"}]


@pytest.mark.parametrize("recovering", [False, True])
def test_a_first_transaction_taken_before_any_commit_makes_the_batch_void_not_half_visible(recovering):
    sink = StateSink({"a": "aborted", "b": "staged", "c": "staged"})
    with pytest.raises(BatchVanishedError, match="every one of its 3 transactions is gone"):
        Committer(sink, retries=0).commit(7, HANDLES, recovering=recovering)
    assert sink.states == {"a": "aborted", "b": "aborted", "c": "aborted"}  # nothing visible
    assert sink.calls[0] == ("commit", "a")  # the first one alone, before anything else


def test_once_a_commit_succeeded_a_transaction_taken_later_is_still_data_loss():
    """Running the batch again would duplicate the committed part: the loss is reported."""
    sink = StateSink({"a": "staged", "b": "aborted", "c": "staged"})
    with pytest.raises(DataLossError, match="transaction .*b") as raised:
        Committer(sink, retries=0).commit(7, HANDLES, recovering=False)
    # Not "vanished" (a subclass of DataLossError whose message also names the handle): that one
    # voids the batch and runs it again, which would write a and c twice.
    assert not isinstance(raised.value, BatchVanishedError), raised.value
    assert sink.states == {"a": "committed", "b": "aborted", "c": "committed"}
    assert ("abort", "c") not in sink.calls


def test_a_transaction_another_committer_already_committed_is_not_aborted_and_the_batch_is_data_loss():
    sink = StateSink({"a": "aborted", "b": "committed", "c": "staged"})
    with pytest.raises(DataLossError, match="can no longer be committed"):
        Committer(sink, retries=0).commit(7, HANDLES, recovering=False)
    assert sink.states["b"] == "committed" and sink.states["c"] == "aborted"


def test_an_abort_of_the_others_that_fails_commits_nothing_and_keeps_the_decision():
    """The review's finding: an abort that did not land, followed by the commit of that same
    transaction, made the batch half visible.  Now nothing is committed; the next try aborts again."""
    sink = StateSink({"a": "aborted", "b": "staged", "c": "staged"})
    sink.unreachable = {"b"}
    with pytest.raises(CommitError, match="aborting 1 of its other transactions failed"):
        Committer(sink, retries=0).commit(7, HANDLES, recovering=True)
    assert sink.states == {"a": "aborted", "b": "staged", "c": "aborted"}
    assert [c for c in sink.calls if c[0] == "commit"] == [("commit", "a")]
    sink.unreachable = set()  # the next try
    with pytest.raises(BatchVanishedError):
        Committer(sink, retries=0).commit(7, HANDLES, recovering=True)
    assert set(sink.states.values()) == {"aborted"}


def test_a_first_commit_whose_fate_is_not_readable_does_not_hold_the_others_back():
    """The review's finding: holding the others back while the first one's fate was unreadable
    deadlocked on Kafka (an open transaction of the batch held the partition's last stable offset
    back, which kept the first one's fate unreadable) until the broker aborted them: data loss."""
    sink = StateSink({"a": "pending", "b": "staged", "c": "staged"})
    with pytest.raises(CommitError, match="committing .*a"):
        Committer(sink, retries=1, backoff=0.01).commit(7, HANDLES, recovering=False)
    assert sink.states == {"a": "pending", "b": "committed", "c": "committed"}
