"""The Kafka protocol of KafkaSink: client versions, EndTxn's version, what recovery reports for a
transaction an earlier call already committed, and the broker's answers the claims of transactional
ids rely on (real broker and unit twins)."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest

from tests.test_kafka_sink import _child_transaction, _topic, read_committed
from twophase.errors import MissingDependencyError
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink
from twophase.sinks.kafka import protocol as kp


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


# ------------------------------------------------- the broker facts claims rely on
def _ongoing(bs: str, topic: str, tid: str):
    """A librdkafka producer on ``tid`` with an open transaction (one record flushed)."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bs, "transactional.id": tid, "transaction.timeout.ms": 60_000})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(topic, b"open", partition=0)
    p.flush(30)
    return p


def _init(client: kp.TxnClient, tid: str, pid: int = -1, epoch: int = -1) -> tuple[str, int, int]:
    """InitProducerId, asked again while the broker answers CONCURRENT_TRANSACTIONS (an abort being
    written); the first answer's name is kept when it was CONCURRENT_TRANSACTIONS."""
    first = None
    for _ in range(100):
        code, p, e = client.init_producer_id(tid, 60_000, pid, epoch)
        first = first or kp.error_name(code)
        if code != kp.CONCURRENT_TRANSACTIONS:
            return first if first == "CONCURRENT_TRANSACTIONS" else kp.error_name(code), p, e
        time.sleep(0.1)
    raise AssertionError(f"InitProducerId on {tid} stayed CONCURRENT_TRANSACTIONS")


@pytest.mark.kafka
def test_init_producer_id_naming_the_current_producer_aborts_an_open_transaction_whatever_epoch_it_expects(
        kafka_service):
    """Why a claim never goes to an id with an open transaction: a conditional InitProducerId (KIP-360)
    that names the id's current producer id aborts its Ongoing transaction even when the epoch it
    expects is long gone.  Only a different producer id is refused without effect."""
    bs = kafka_service["bootstrap_servers"]
    topic, tid = _topic(bs, 1), f"fact1-{uuid.uuid4().hex[:8]}"
    client = kp.TxnClient({"bootstrap_servers": bs})
    _ongoing(bs, topic, tid)
    _ongoing(bs, topic, tid)  # a second producer: the open transaction is now at epoch 2
    st = client.describe_transactions([tid])[tid]
    assert (st.state, st.producer_epoch) == ("Ongoing", 2)
    code, _, _ = _init(client, tid, st.producer_id + 1000, st.producer_epoch)   # another producer id
    assert code == "PRODUCER_FENCED"
    assert client.describe_transactions([tid])[tid].state == "Ongoing"           # untouched
    code, _, _ = _init(client, tid, st.producer_id, 0)                           # a stale epoch
    assert code == "CONCURRENT_TRANSACTIONS"                                     # it is aborting it
    after = client.describe_transactions([tid])[tid]
    assert after.state in ("PrepareAbort", "CompleteAbort") and after.producer_epoch == 3
    client.close()


@pytest.mark.kafka
def test_claims_are_conditional_on_an_idle_id_and_a_new_id_takes_only_an_impossible_producer_id(kafka_service):
    """A claim (InitProducerId from the epoch just described) bumps the epoch once; a claim from an
    older epoch is refused without effect, and one from the epoch just before is answered as a retry
    (the current epoch, unbumped).  An id the broker does not know is created by a claim from an
    impossible producer id, which an existing id refuses, even with a transaction open."""
    bs = kafka_service["bootstrap_servers"]
    topic, tid = _topic(bs, 1), f"fact2-{uuid.uuid4().hex[:8]}"
    client = kp.TxnClient({"bootstrap_servers": bs})
    assert client.describe_transactions([tid])[tid].error_code == kp.TRANSACTIONAL_ID_NOT_FOUND
    code, pid, epoch = _init(client, tid, kp.UNUSED_PRODUCER_ID, 0)
    assert (code, epoch) == ("NONE", 0)
    assert _init(client, tid, kp.UNUSED_PRODUCER_ID, 0)[0] == "PRODUCER_FENCED"
    assert _init(client, tid, pid, 0) == ("NONE", pid, 1)          # the claim
    assert _init(client, tid, pid, 0) == ("NONE", pid, 1)          # a repeat of it: unbumped
    assert _init(client, tid) == ("NONE", pid, 2)                  # librdkafka's unconditional one
    assert _init(client, tid, pid, 0)[0] == "PRODUCER_FENCED"      # an older claim: refused
    assert _init(client, tid, pid, 1)[0] == "PRODUCER_FENCED"
    assert client.describe_transactions([tid])[tid].producer_epoch == 2
    _ongoing(bs, topic, tid)
    assert _init(client, tid, kp.UNUSED_PRODUCER_ID, 0)[0] == "PRODUCER_FENCED"
    assert client.describe_transactions([tid])[tid].state == "Ongoing"
    # EndTxn is conditional on the exact epoch: an older one aborts nothing.
    st = client.describe_transactions([tid])[tid]
    assert client.end_txn(tid, pid, st.producer_epoch - 1, commit=False) == kp.PRODUCER_FENCED
    assert client.describe_transactions([tid])[tid].state == "Ongoing"
    assert client.end_txn(tid, pid, st.producer_epoch, commit=False) == kp.NONE
    client.close()


@pytest.mark.kafka
def test_describe_producers_gives_the_first_offset_of_an_open_transaction(kafka_service):
    bs = kafka_service["bootstrap_servers"]
    topic, tid = _topic(bs, 1), f"fact3-{uuid.uuid4().hex[:8]}"
    client = kp.TxnClient({"bootstrap_servers": bs})
    _ongoing(bs, topic, tid).flush(30)
    st = client.describe_transactions([tid])[tid]
    assert st.partitions == (f"{topic}:0",)
    entries = client.describe_producers(list(st.partitions))[f"{topic}:0"]
    assert [(e.producer_id, e.producer_epoch, e.txn_start_offset) for e in entries] == \
        [(st.producer_id, st.producer_epoch, 0)]
    client.close()


@pytest.mark.kafka
def test_describe_producers_asks_a_cached_leader_and_looks_again_when_it_is_wrong(kafka_service):
    """The partition's leader is looked up once and reused (one round trip a call, not two); a cached
    leader that is wrong (a broker that moved, here one that does not exist) fails that request,
    the leaders are looked up again and the answer is the right one."""
    bs = kafka_service["bootstrap_servers"]
    topic, tid = _topic(bs, 1), f"fact4-{uuid.uuid4().hex[:8]}"
    client = kp.TxnClient({"bootstrap_servers": bs})
    _ongoing(bs, topic, tid).flush(30)
    st = client.describe_transactions([tid])[tid]
    want = [(st.producer_id, st.producer_epoch, 0)]

    def entries():
        return [(e.producer_id, e.producer_epoch, e.txn_start_offset)
                for e in client.describe_producers([f"{topic}:0"])[f"{topic}:0"]]

    assert entries() == want
    (tp, (leader, _)), = client._leaders.items()
    lookups = []
    real = client._admin._async_get_leader_for_partitions

    async def counted(tps):
        lookups.append(list(tps))
        return await real(tps)

    client._admin._async_get_leader_for_partitions = counted
    assert entries() == want and lookups == []                     # the cached leader, no lookup
    client._leaders[tp] = (leader + 1000, client._leaders[tp][1])  # a leader that is not there
    assert entries() == want and len(lookups) == 1                 # looked up again, right answer
    assert client._leaders[tp][0] == leader
    client.close()
