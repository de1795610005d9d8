"""Executor tasks: :class:`~twophase.sinks.kafka.KafkaSink`'s writer (``write``, ``pre_commit``,
``abort``), once the task's transactional id is claimed and its producer started (``claims.py``).

It produces the rows of each Arrow batch into the open transaction, flushes with zero delivery
errors, reads where the transaction's first records landed (and the topics' ids) for the handle,
and releases the producer with its transaction open, for the driver's commit.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from twophase._deps import require
from twophase.errors import TwoPhaseError
from twophase.sinks.kafka.common import KafkaTransaction, _KafkaSinkBase, log

#: How long a Python worker trusts that a topic it checked exists (seconds).  The check only
#: gives a clear error before anything is written; a topic deleted meanwhile still fails the
#: batch, at the produce.
TOPIC_CHECK_TTL_S = 60.0
# (bootstrap servers, topic) -> time.monotonic() of the last successful check, per process.
_TOPICS_SEEN: dict[tuple[str, str], float] = {}


def _is_binaryish(t: pa.DataType) -> bool:
    return (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)
            or pa.types.is_large_string(t) or pa.types.is_null(t))


class _Writer(_KafkaSinkBase):
    """Produce, flush, hand the transaction over, or abort it (executor)."""

    def _check_topic(self, txn: KafkaTransaction, topic: str) -> None:
        """Fail before producing to a topic that does not exist (unless auto_create_topics).

        One metadata request per topic and Python worker every TOPIC_CHECK_TTL_S seconds,
        not one per transaction.
        """
        if topic in txn.checked_topics:
            return
        key = (self.bootstrap_servers, topic)
        seen = _TOPICS_SEEN.get(key)
        if not self.auto_create_topics and (seen is None
                                            or time.monotonic() - seen > TOPIC_CHECK_TTL_S):
            md = txn.producer.list_topics(topic, timeout=self.request_timeout_s)
            t = md.topics.get(topic)
            if t is None or t.error is not None:
                raise TwoPhaseError(
                    f"{txn.ctx.label}: topic {topic!r} does not exist on {self.bootstrap_servers} "
                    "(KafkaSink(auto_create_topics=False)); create it and restart the query. Nothing of this "
                    "batch was committed.")
            _TOPICS_SEEN[key] = time.monotonic()
        txn.checked_topics.add(topic)

    def write(self, txn: KafkaTransaction, batch: pa.RecordBatch) -> None:
        """Produce the rows of one Arrow batch inside the transaction (executor)."""
        ck = require("confluent_kafka", "KafkaSink")
        ctx, names = txn.ctx, batch.schema.names
        if "value" not in names:
            raise TwoPhaseError(f"{ctx.label}: KafkaSink needs a 'value' column (binary or string), as "
                                f"Spark's Kafka sink; columns are {names}")
        for col in ("key", "value"):
            if col in names and not _is_binaryish(batch.schema.field(col).type):
                raise TwoPhaseError(f"{ctx.label}: column {col!r} must be binary or string, not "
                                    f"{batch.schema.field(col).type} (cast it, as for Spark's Kafka sink)")
        value_col = batch.column(names.index("value"))
        if value_col.null_count and not self.tombstones:
            first = value_col.is_null().to_pylist().index(True)
            raise TwoPhaseError(
                f"{ctx.label}: column 'value' is null in row {txn.rows + first} of this partition. Fix the "
                "input (or pass KafkaSink(tombstones=True) to write nulls as tombstones); nothing of this "
                "batch was committed and its replay writes it again.")
        values = value_col.to_pylist()
        n = len(values)
        keys = batch.column(names.index("key")).to_pylist() if "key" in names else None
        if self.topic is not None:
            topics = None
            self._check_topic(txn, self.topic)
            txn.topics.add(self.topic)
        elif "topic" in names:
            topics = batch.column(names.index("topic")).to_pylist()
            for t in set(topics):
                if t is None:
                    raise TwoPhaseError(f"{ctx.label}: column 'topic' is null and KafkaSink has no topic=...")
                self._check_topic(txn, t)
                txn.topics.add(t)
        else:
            raise TwoPhaseError(f"{ctx.label}: no topic: give KafkaSink(topic=...) or a 'topic' column")
        parts = batch.column(names.index("partition")).to_pylist() if "partition" in names else None
        headers = batch.column(names.index("headers")).to_pylist() if "headers" in names else None

        produce, poll = txn.producer.produce, txn.producer.poll
        topic = self.topic

        def refused(i: int, t: str | None, e: Exception) -> TwoPhaseError:
            err = e.args[0] if e.args else e
            return TwoPhaseError(
                f"{ctx.label}: Kafka refused row {txn.rows + i} for topic {t!r}: "
                f"{err.str() if hasattr(err, 'str') else err}. Fix the input; nothing of this batch "
                "was committed.")

        def produce_when_room(i: int, args: tuple, kwargs: dict[str, Any]) -> None:
            while True:  # the local queue is full: serve the producer, then retry
                poll(0.05)
                try:
                    produce(*args, **kwargs)
                    return
                except BufferError:
                    continue
                except ck.KafkaException as e:
                    raise refused(i, args[0], e) from None

        # Rows go in chunks of 1000, with a poll (delivery errors, queue room) after each chunk.
        for start in range(0, n, 1000):
            stop = min(n, start + 1000)
            if topics is None and parts is None and headers is None:  # the common shape: a tight loop
                i = start
                while i < stop:
                    j = i  # the loops leave j at the row that raised
                    try:
                        if keys is None:
                            for j in range(i, stop):
                                produce(topic, values[j])
                        else:
                            for j in range(i, stop):
                                produce(topic, values[j], keys[j])
                        break
                    except BufferError:
                        args: tuple = (topic, values[j], keys[j]) if keys is not None else (topic, values[j])
                        produce_when_room(j, args, {})
                        i = j + 1
                    except ck.KafkaException as e:
                        raise refused(j, topic, e) from None
            else:
                for i in range(start, stop):
                    t = topic if topics is None else topics[i]
                    args = (t, values[i], keys[i] if keys is not None else None)
                    kwargs: dict[str, Any] = {}
                    if parts is not None and parts[i] is not None:
                        kwargs["partition"] = int(parts[i])
                    if headers is not None and headers[i]:
                        kwargs["headers"] = [(h["key"], h["value"]) for h in headers[i]]
                    try:
                        produce(*args, **kwargs)
                    except BufferError:
                        produce_when_room(i, args, kwargs)
                    except ck.KafkaException as e:
                        raise refused(i, t, e) from None
            poll(0)
            if txn.error_count or txn.fatal:
                break
        txn.rows += n
        self._raise_errors(txn)

    def _raise_errors(self, txn: KafkaTransaction) -> None:
        if txn.fatal:
            raise TwoPhaseError(f"{txn.ctx.label}: the producer for {txn.transactional_id} failed: "
                                f"{txn.fatal[0]} (fenced by a newer attempt of this partition?)")
        if txn.error_count:
            raise TwoPhaseError(
                f"{txn.ctx.label}: {txn.error_count} records were not delivered to Kafka, e.g. "
                f"{'; '.join(txn.delivery_errors)}. Nothing of this batch was committed; fix the cause "
                "and its replay writes it again.")

    def pre_commit(self, txn: KafkaTransaction) -> dict:
        """Flush with zero delivery errors; return (id, producer id, epoch, topics, first offsets) (executor).

        Then the producer is released (:meth:`_release`): destroyed, never closed, so its
        transaction stays open for the driver's commit and no threads, sockets or
        statistics are left behind in the Python worker.  ``txn_start_offsets`` holds, for each topic
        partition the transaction wrote to, the offset of its first record there
        (DescribeTransactions for the partitions, DescribeProducers for the offsets): if a later
        commit finds the id moved on, that record tells whether the transaction was committed
        (:meth:`commit`).  Best effort: a handle without it is committed the same way.
        """
        remaining = txn.producer.flush(self.flush_timeout_s)
        if remaining:
            raise TwoPhaseError(f"{txn.ctx.label}: {remaining} records still undelivered after "
                                f"{self.flush_timeout_s:.0f}s (flush_timeout_s); nothing was committed")
        txn.producer.poll(0)  # serve remaining log lines and callbacks
        self._raise_errors(txn)
        pid_epoch = (txn.claimed[0], txn.claimed[1] + 1) if txn.claimed is not None else None
        if pid_epoch is None:
            pid_epoch = self._producer_id_epoch(txn)
            if pid_epoch is None:
                raise TwoPhaseError(f"{txn.ctx.label}: could not read the producer id and epoch of "
                                    f"{txn.transactional_id} from librdkafka; nothing was committed")
        offsets = self._first_offsets(txn, pid_epoch)
        txn.done = True
        handle = {"transactional_id": txn.transactional_id, "producer_id": pid_epoch[0],
                  "producer_epoch": pid_epoch[1],
                  "topics": sorted(txn.topics),
                  "rows": txn.rows, "started_at": round(txn.started_at, 3),
                  "timeout_ms": self.transaction_timeout_ms}
        if offsets:
            handle["txn_start_offsets"] = offsets
            # Name the incarnation of each topic the records are in: a topic deleted and recreated
            # under its name holds another transaction's record at the same offset (_records_fate).
            ids = self._topic_ids(txn, sorted({tp.rpartition(":")[0] for tp in offsets}))
            if ids:
                handle["txn_topic_ids"] = ids  # sorts after transactional_id: `twophase status` cuts handles at 200 characters
        self._release(txn)
        return handle

    def _first_offsets(self, txn: KafkaTransaction, pid_epoch: tuple[int, int]) -> dict[str, int]:
        """{"topic:partition": offset of the transaction's first record there} (executor; best effort).

        Raises if the broker shows the transaction is no longer open under this producer id and
        epoch (another actor initialised the id): such a handle could never be committed.
        """
        from twophase.sinks.kafka import protocol as kp

        tid = txn.transactional_id
        try:
            client = self._task_client()
            st = client.describe_transactions([tid]).get(tid)
            if st is None or st.error_code != kp.NONE:
                return {}
            if st.state != "Ongoing" or (st.producer_id, st.producer_epoch) != tuple(pid_epoch):
                raise TwoPhaseError(
                    f"{txn.ctx.label}: the transaction of {tid} (producer id {pid_epoch[0]}, epoch "
                    f"{pid_epoch[1]}) is no longer open: the broker reports {st.state} under producer id "
                    f"{st.producer_id} epoch {st.producer_epoch} (another actor initialised the id). "
                    "Nothing of it can be committed.")
            found = client.describe_producers(list(st.partitions))
        except TwoPhaseError:
            raise
        except Exception as e:  # noqa: BLE001 - an optional extra of the handle
            log.debug("%s: could not read the first offsets of %s: %s", txn.ctx.label, tid, e)
            return {}
        return {tp: e.txn_start_offset for tp, entries in sorted(found.items()) for e in entries
                if e.producer_id == pid_epoch[0] and e.txn_start_offset >= 0}

    def _topic_ids(self, txn: KafkaTransaction, topics: list[str]) -> dict[str, str]:
        """{topic: its topic id (UUID)} for the handle (executor; best effort, after the flush)."""
        try:
            return self._task_client().topic_ids(topics)
        except Exception as e:  # noqa: BLE001 - an optional extra of the handle
            log.debug("%s: could not read the topic ids of %s: %s", txn.ctx.label, topics, e)
            return {}

    def abort(self, txn: KafkaTransaction) -> None:
        """Abort the open transaction (executor; best effort).  Never called after pre_commit."""
        if txn.done:
            return
        txn.done = True
        try:
            txn.producer.abort_transaction(self.request_timeout_s)
        except Exception as e:  # the next attempt's init_transactions fences it anyway
            log.debug("%s: abort_transaction failed: %s", txn.ctx.label, e)
        self._release(txn)
