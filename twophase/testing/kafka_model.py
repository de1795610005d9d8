"""An in-memory model of a Kafka broker's transactional ids and topic logs, for the schedule
explorer (issue 59: "the explorer runs the code we ship").

The shipped :class:`twophase.sinks.kafka.KafkaSink` runs over it unchanged: its two client seams are
replaced, inside :func:`patched` only, by ones that talk to a :class:`ModelBroker`:

- ``twophase.sinks.kafka.protocol.TxnClient`` (the driver's and the executors' kafka-python client:
  InitProducerId, EndTxn, DescribeTransactions, DescribeProducers, the topic ids, the uncommitted
  batch-at-offset and transaction-marker reads) by :class:`ModelTxnClient`;
- ``confluent_kafka`` as the modules of ``twophase.sinks.kafka`` get it (``require``): the transactional
  ``Producer`` (``init_transactions``, ``begin_transaction``, ``produce``, ``flush``,
  ``abort_transaction``, its 'Acquired PID' debug line), the ``read_committed`` ``Consumer``
  (watermarks, poll) and the ``AdminClient`` (topic listing, configs), by :class:`ModelConfluent`.

Every broker request is one call of :meth:`ModelBroker.request`, which runs ``broker.before()``
first (the explorer's scheduling point) and ``broker.after(op, key, text)`` after (its trace line).
What the model answers, and the answers of the real broker it was checked against
(tests/test_explorer_kafka.py, ``kafka`` marker: the same sequence on both):

- **InitProducerId** ``(tid, timeout, producer_id=-1, epoch=-1)``: an unknown id is created (a new
  producer id, epoch 0), whatever the expectation; unconditional on a known id: an Ongoing
  transaction is aborted (its abort marker written under the bumped epoch, the answer
  CONCURRENT_TRANSACTIONS: ask again), else the epoch is bumped; conditional (a claim): bumped
  only from exactly the given producer id and epoch, the current epoch answered unbumped for the
  epoch before it (a retry), PRODUCER_FENCED otherwise, and an Ongoing transaction of the given
  producer id is aborted whatever the epoch (CONCURRENT_TRANSACTIONS), as Kafka 4.1 does.
- **EndTxn** under an exact producer id and epoch: commit or abort an Ongoing transaction (its
  markers written at once: no PrepareCommit/PrepareAbort window), a repeat of the same outcome is
  NONE, the other outcome INVALID_TXN_STATE, on an id with no transaction INVALID_TXN_STATE;
  another producer id INVALID_PRODUCER_ID_MAPPING, an older epoch PRODUCER_FENCED.
- **DescribeTransactions**, **ListTransactions**, **DescribeProducers**, **Produce** (with
  AddPartitionsToTxn: the first record of a partition opens the transaction; a fenced epoch is
  refused with PRODUCER_FENCED, which the producer reports as a fatal error), a
  ``read_committed`` view (below the last stable offset, aborted records and markers skipped),
  the uncommitted batch at an offset (``TxnClient.batch_at``) and a transaction's marker, topic ids.

Not modelled: time (the transaction timeout runs only when :meth:`ModelBroker.expire` says so: the
explorer calls it once every actor and the final owner are done), the PrepareCommit/PrepareAbort window (markers are written at
once, so CONCURRENT_TRANSACTIONS follows only a fencing InitProducerId), coordinator moves,
retriable network errors, lost answers, several brokers, retention, compaction, topic deletion
(:meth:`ModelBroker.recreate_topic` exists for tests), transactions v2 (KIP-890), sequence numbers
and idempotence, keys' partitioner (a record without a partition goes to partition 0).

Where it lives: the broker (the logs, the ids' states, its answers, the brokers by bootstrap
servers) in :mod:`twophase.testing.kafka_model_broker`; the clients over it (:class:`ModelTxnClient`,
:class:`ModelConfluent` and its producer, consumer and admin client) in
:mod:`twophase.testing.kafka_model_clients`; here, :func:`patched`, and every name of the two
importable from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from twophase.sinks.kafka import protocol as kp

# The broker and the clients live in modules of their own (kafka_model_broker.py: the logs, the
# ids' states and the answers; kafka_model_clients.py: the TxnClient and confluent_kafka over it);
# every name of theirs is importable from here.
from twophase.testing.kafka_model_broker import _BROKERS as _BROKERS
from twophase.testing.kafka_model_broker import _PRODUCER_ID_BASE as _PRODUCER_ID_BASE
from twophase.testing.kafka_model_broker import Batch as Batch
from twophase.testing.kafka_model_broker import ModelBroker as ModelBroker
from twophase.testing.kafka_model_broker import Partition as Partition
from twophase.testing.kafka_model_broker import Topic as Topic
from twophase.testing.kafka_model_broker import Txn as Txn
from twophase.testing.kafka_model_broker import TxnId as TxnId
from twophase.testing.kafka_model_broker import _bootstrap as _bootstrap
from twophase.testing.kafka_model_broker import _broker as _broker
from twophase.testing.kafka_model_broker import register as register
from twophase.testing.kafka_model_broker import unregister as unregister
from twophase.testing.kafka_model_clients import ModelAdminClient as ModelAdminClient
from twophase.testing.kafka_model_clients import ModelConfigResource as ModelConfigResource
from twophase.testing.kafka_model_clients import ModelConfluent as ModelConfluent
from twophase.testing.kafka_model_clients import ModelConsumer as ModelConsumer
from twophase.testing.kafka_model_clients import ModelKafkaError as ModelKafkaError
from twophase.testing.kafka_model_clients import ModelKafkaException as ModelKafkaException
from twophase.testing.kafka_model_clients import ModelProducer as ModelProducer
from twophase.testing.kafka_model_clients import ModelTopicPartition as ModelTopicPartition
from twophase.testing.kafka_model_clients import ModelTxnClient as ModelTxnClient
from twophase.testing.kafka_model_clients import _Future as _Future
from twophase.testing.kafka_model_clients import _Message as _Message
from twophase.testing.kafka_model_clients import _Metadata as _Metadata
from twophase.testing.kafka_model_clients import _states_text as _states_text

__all__ = ["ModelBroker", "ModelConfluent", "ModelTxnClient", "patched", "register"]


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Inside it, :class:`twophase.sinks.kafka.KafkaSink` talks to the model brokers registered
    under its bootstrap servers (:func:`register`): its ``confluent_kafka`` and its ``TxnClient``
    are the model's; the executors' client cache and topic checks are fresh, restored after."""
    from twophase.sinks.kafka import claims, committer, common, sink, writer

    model = ModelConfluent()
    # ``require`` is looked up in the module of the code that calls it: every module of the sink that does.
    new: list[tuple[Any, str, Any]] = [*((mod, "require", model.require) for mod in (common, sink, committer, claims, writer)),
                                       (kp, "TxnClient", ModelTxnClient),
                                       (common, "_TASK_CLIENTS", {}), (writer, "_TOPICS_SEEN", {})]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in new]
    for obj, attr, value in new:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)
