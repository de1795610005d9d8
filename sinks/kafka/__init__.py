"""Exactly-once Kafka sink: one Kafka transaction per Spark partition and batch, committed by the driver.

Executors produce with confluent-kafka's transactional producer and pre-commit by
flushing with zero delivery errors; the handle is (transactional id, producer id,
epoch, topics, the first offset of the transaction on each topic partition).  The driver
commits with FindCoordinator + EndTxn under that id and epoch, from any process, after
any crash (what Flink does, through public protocol).

Transactional ids come from a bounded pool: ``{prefix}-{partition}.{slot}``, a few slots per
partition (``slots_per_partition``), plus one id that is never used for a transaction, the plan
fence ``{prefix}-plans``.  Every ``plan_batch`` (one execution, a *ballot*, of a batch) bumps the
fence's epoch and records it in the INTENT with the pool's open transactions at that moment.  A
task *claims* a slot of its partition before librdkafka initialises it: it checks
(DescribeTransactions) that the fence is still its ballot's, and that the slot has no open
transaction, then claims it with a conditional InitProducerId (only from the epoch it just saw), and
then librdkafka's unconditional InitProducerId must land exactly one epoch later.  So an attempt of
an older ballot or batch (a stage retry's duplicate, a zombie executor, an orphaned Spark Connect
run) is refused, and no attempt ever initialises an id that holds another one's open transaction:
InitProducerId aborts such a transaction, even a decided one, whatever epoch it expects (verified on
Kafka 4.1.2).  Cleanup is conditional too: ``abort_lingering`` aborts with EndTxn under the exact
producer id and epoch it described, and only what the INTENT's snapshot lists as open before the
ballot, or anything not kept while no newer ballot has been planned.  See docs/kafka.md, including
what is left (a claim sent from a stale look at an id: two attempts of one number racing, or one
that stalls between two of its own requests; caught before the decision, the batch runs again).

Delivery guarantee: with :class:`twophase.coordinator.Coordinator`, every row of
every batch appears exactly once to consumers with ``isolation.level=read_committed``
(read_uncommitted consumers also see records of aborted attempts).

Before the decision is logged, ``verify_prepared`` checks with DescribeTransactions that every
transaction is still open under its producer id and epoch with ``commit_margin_ms`` of its timeout
left; otherwise the batch fails while undecided.  Handles of a decided batch are committed again
with EndTxn (which answers success for a first and a repeated commit alike, so recovery asks
DescribeTransactions first to tell them apart).  When EndTxn says the id moved on (fenced, expired),
the handle's first offsets tell what happened: a record that ``read_committed`` readers see was
committed; one the last stable offset has passed without it was aborted, which can never be
committed: that is reported as data loss.

The package, by where its code runs: ``sink.py`` (:class:`KafkaSink`: options, ``open``, config;
driver), ``pool.py`` (the transactional-id pool, plans, cleanup; driver), ``committer.py`` (verify,
commit, verdicts, recovery; driver), ``claims.py`` and ``writer.py`` (claim an id, produce,
pre-commit, abort; executor tasks), ``common.py`` (what both sides share), ``settings.py`` (option
defaults and checks), ``protocol.py`` and ``protocol_config.py`` (the transaction-coordinator client
both sides use, and its settings).
"""

from twophase.sinks.kafka.common import _ACQUIRED as _ACQUIRED
from twophase.sinks.kafka.common import POOL_VERSION, KafkaTransaction
from twophase.sinks.kafka.common import _LibrdkafkaLog as _LibrdkafkaLog
from twophase.sinks.kafka.settings import (
    DEFAULT_COMMIT_MARGIN_MS,
    DEFAULT_SLOTS_PER_PARTITION,
    DEFAULT_TRANSACTION_TIMEOUT_MS,
    JAVA_ONLY,
    check_producer_settings,
)
from twophase.sinks.kafka.sink import KafkaSink
from twophase.sinks.kafka.writer import TOPIC_CHECK_TTL_S

__all__ = [
    "DEFAULT_COMMIT_MARGIN_MS",
    "DEFAULT_SLOTS_PER_PARTITION",
    "DEFAULT_TRANSACTION_TIMEOUT_MS",
    "JAVA_ONLY",
    "POOL_VERSION",
    "TOPIC_CHECK_TTL_S",
    "KafkaSink",
    "KafkaTransaction",
    "check_producer_settings",
]
