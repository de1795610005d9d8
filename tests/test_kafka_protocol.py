"""The driver-side Kafka protocol of KafkaSink: client versions, EndTxn's version, and what recovery
reports for a transaction an earlier call already committed (real broker and unit twins)."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from tests.test_kafka_sink import _child_transaction, _topic, read_committed
from twophase.errors import MissingDependencyError
from twophase.sink import CommitOutcome
from twophase.sinks import _kafka_protocol as kp
from twophase.sinks.kafka import KafkaSink


# ---------------------------------------------------------------------------- unit
def test_kafka_python_outside_the_tested_line_is_refused_with_the_fix(monkeypatch):
    for ok in ("3.0.12", "3.0.13", "3.0.99.dev0"):
        kp.check_kafka_python_version(ok)
    for bad in ("2.1.0", "2.3.3", "3.0.11", "3.1.0", "4.0"):
        with pytest.raises(MissingDependencyError, match=r"pip install 'kafka-python>=3\.0\.12,<3\.1'"):
            kp.check_kafka_python_version(bad)
    import kafka

    kp.check_kafka_python_version(kafka.__version__)  # what is installed is in the range
    # The sink says so before it connects, rather than "cannot connect".
    monkeypatch.setattr(kafka, "__version__", "2.3.3")
    with pytest.raises(MissingDependencyError, match="found kafka-python 2.3.3"):
        KafkaSink("127.0.0.1:1", "t", "app")._txn_client()


def test_end_txn_is_never_sent_above_v4():
    """EndTxn v5 is transactions v2 (KIP-890): a v5 retry of a v4 commit answers
    INVALID_TXN_STATE, which the sink would report as data loss."""
    from kafka.protocol.broker_version_data import BrokerVersionData
    from kafka.protocol.producer.transaction import EndTxnRequest

    kafka_4 = BrokerVersionData(api_versions={EndTxnRequest.API_KEY: (0, 5)})
    uncapped = EndTxnRequest(transactional_id="t", producer_id=1, producer_epoch=0, committed=True)
    assert kafka_4.api_version(uncapped) == 5          # what kafka-python would send by itself
    request = kp.end_txn_request("t", 1, 0, True)
    assert kp.END_TXN_MAX_VERSION == 4 and kafka_4.api_version(request) == 4
    assert kafka_4.api_version(kp.end_txn_request("t", 1, 0, False)) == 4


class _NoDescribeClient:
    """A broker that cannot answer DescribeTransactions and commits with NONE."""

    closed = False

    def describe_transactions(self, tids):
        raise kp.UnsupportedRequest("DescribeTransactions: not supported")

    def end_txn(self, *a, **k):
        return kp.NONE


def test_recovery_says_when_the_broker_cannot_tell_an_earlier_commit():
    # Twin of test_recovery_reports_an_earlier_commit_as_already_committed (real broker).
    sink = KafkaSink("b:9092", "t", "app")
    sink._client = _NoDescribeClient()
    res = sink.recover_and_commit({"transactional_id": "app-0", "producer_id": 1, "producer_epoch": 0})
    assert res.outcome is CommitOutcome.COMMITTED
    assert res.reason == "committed (or already committed: the broker cannot tell)"


# ----------------------------------------------------------------------- broker
@pytest.mark.kafka
def test_end_txn_negotiates_v4_with_the_real_broker(kafka_service):
    from kafka.protocol.producer.transaction import EndTxnRequest

    sink = KafkaSink(kafka_service["bootstrap_servers"], "t", f"ver-{uuid.uuid4().hex[:6]}")
    client = sink._txn_client()
    broker_max = client._manager.broker_version_data.api_versions[EndTxnRequest.API_KEY][1]
    assert broker_max >= 5, "the test broker should speak EndTxn v5 (Kafka 4.x)"
    assert client.negotiated_version(kp.end_txn_request("t", 1, 0, True)) == 4
    sink.close()


@pytest.mark.kafka
def test_recovery_reports_an_earlier_commit_as_already_committed(kafka_service):
    """EndTxn answers NONE for a first commit and a repeated one alike; recovery asks the broker's
    transaction state first, so its report says which one it was."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"again-{uuid.uuid4().hex[:8]}"
    handle = _child_transaction(bs, topic, prefix, n=40)     # pre-committed, its process killed
    sink = KafkaSink(bs, topic, prefix)
    first = sink.recover_and_commit(handle)                  # a restart finds the decision
    assert first.outcome is CommitOutcome.COMMITTED and first.reason == ""
    # Killed again after the commit, before COMMITTED was logged: the next restart commits again.
    deadline = time.time() + 20
    while (again := sink.recover_and_commit(handle)).outcome is CommitOutcome.RETRY_LATER:
        assert time.time() < deadline, again          # markers still being written
        time.sleep(0.2)
    assert again.outcome is CommitOutcome.ALREADY_COMMITTED, again
    assert handle["transactional_id"] in again.reason and "committed" in again.reason
    # EndTxn alone cannot tell: commit() reports a repeat as committed, as the broker answers.
    assert sink.commit(handle).outcome is CommitOutcome.COMMITTED
    assert Counter(read_committed(bs, topic)) == Counter(f"{prefix}-{i}".encode() for i in range(40))
    sink.close()
