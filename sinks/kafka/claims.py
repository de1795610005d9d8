"""Executor tasks: a task of :class:`~twophase.sinks.kafka.KafkaSink` claims a transactional id of
its partition and starts a producer on it (``begin_transaction``).

The claim checks that the plan fence still holds its INTENT's epoch (else the attempt is late and
claims nothing), takes an id with no transaction open or closing by a conditional InitProducerId
from the producer id and epoch it just described, and then librdkafka's own InitProducerId must land
exactly one epoch later.  The driver side of the fence is ``pool.py``; what the task does with its
producer afterwards is ``writer.py``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from twophase._deps import require
from twophase.context import TransactionContext
from twophase.errors import TwoPhaseError
from twophase.sinks.kafka.common import (
    _CLAIMABLE,
    OWN_IDS_VERSION,
    POOL_VERSION,
    KafkaTransaction,
    _KafkaSinkBase,
    _LibrdkafkaLog,
    _rdlog,
)


class _Claims(_KafkaSinkBase):
    """Claim a transactional id of the partition, start its producer, begin (executor)."""

    def _producer_config(self, tid: str, txn_box: list) -> dict[str, Any]:
        conf = self._resolved_config()
        conf.update({
            "transactional.id": tid,
            "transaction.timeout.ms": self.transaction_timeout_ms,
            "enable.idempotence": True,
            "acks": "all",
            "debug": "eos",
            "statistics.interval.ms": 1000,
        })
        conf.setdefault("allow.auto.create.topics", self.auto_create_topics)
        # The Java client's partitioner (murmur2 of the key; Spark's Kafka sink, Kafka Streams and
        # every Java producer use it), not librdkafka's default CRC32: a key lands on the partition
        # it lands on from them, so per-key order, compaction and co-partitioning hold across them.
        conf.setdefault("partitioner", "murmur2_random")
        conf.setdefault("linger.ms", 5)
        conf.setdefault("client.id", f"twophase-{tid}")
        # A producer lives for one transaction.  With sparse connections (librdkafka's default)
        # init_transactions found no broker connection up right after creation and waited for
        # librdkafka's coordinator query timer: 50 ms typically, 500 ms for about one in ten.
        # Connecting to the brokers at once makes it a few ms (benchmarks/kafka.py --txn-cost).
        conf.setdefault("enable.sparse.connections", False)

        # Delivery reports for failed records only: a Python callback per delivered record cost
        # about a third of produce time (benchmarks/kafka.py); errors are all the sink needs.
        conf["delivery.report.only.error"] = True

        def on_delivery(err, msg):
            if err is None:
                return
            txn = txn_box[0]
            txn.error_count += 1
            if len(txn.delivery_errors) < 5:
                txn.delivery_errors.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")

        def on_error(err):
            if err.fatal():
                txn_box[0].fatal.append(err.str())
            else:
                _rdlog.debug("%s: %s", tid, err.str())

        def on_stats(s):
            try:
                txn_box[0].eos_stats = json.loads(s).get("eos") or {}
            except ValueError:
                pass

        conf["on_delivery"] = on_delivery
        conf["error_cb"] = on_error
        conf["stats_cb"] = on_stats
        return conf

    def begin_transaction(self, ctx: TransactionContext) -> KafkaTransaction:
        """Claim a free transactional id of the partition, initialise a producer on it, begin (executor).

        1. Describe the partition's ``slots_per_partition`` ids, then the plan fence.  A fence
           past the INTENT's epoch means a newer execution of this batch, or a later batch, was
           planned: this attempt is late and stops before touching any id.
        2. Take the first id with no transaction open or closing, starting from the slot of the
           attempt's number (so that the attempts of one stage attempt, a retry and the zombie it
           replaced, never race for one id while there are slots enough), and claim it with a
           conditional InitProducerId from the producer id and epoch just described (an id the
           broker does not know yet: from an impossible producer id, which only a new id
           accepts).  The broker refuses if the id moved meanwhile.  An id with an open
           transaction is never claimed: InitProducerId would abort it, whatever epoch it
           expects, and it may be a decided one.  One that the INTENT lists as open before the
           plan is a leftover of a closed execution: it is aborted (EndTxn under its exact epoch),
           and claimed once the abort is complete if no other id is free.
        3. librdkafka's ``init_transactions`` (an unconditional InitProducerId) must then land
           exactly one epoch after the claim; otherwise another attempt initialised the id in
           between, and this one gives the id up (nothing of it is open) and tries the next.

        A fresh producer per transaction; no earlier attempt's transaction is fenced (each attempt
        has an id of its own; the batch's cleanup aborts what failed attempts left open).
        """
        from twophase.sinks.kafka import protocol as kp

        tids = ctx.intent.get("transactional_ids")
        if tids is None:
            raise TwoPhaseError(f"{ctx.label}: the batch INTENT has no transactional ids (was it planned "
                                "by another sink?)")
        pool = ctx.intent.get("pool")
        if not isinstance(pool, dict) or pool.get("version") not in (POOL_VERSION, OWN_IDS_VERSION):
            raise TwoPhaseError(
                f"{ctx.label}: the batch INTENT was planned by an earlier twophase version (one transactional "
                "id per partition, no claims); nothing was written. Its replay plans the batch again.")
        r, n = int(pool["slots"]), int(pool["partitions"])
        if ctx.partition_id >= n:
            raise TwoPhaseError(f"{ctx.label}: partition {ctx.partition_id} is outside the batch INTENT "
                                f"({n} partitions planned); nothing was written")
        slots = list(tids[ctx.partition_id * r:(ctx.partition_id + 1) * r])
        # Each attempt number starts on a slot of its own: a retry and the zombie attempt it replaced
        # (paused, cut off) are alive at once, and two claimants of one slot can abort each other's
        # transaction (a claim from a stale look at the slot's state, see docs/kafka.md).
        k = ctx.attempt % r
        slots = slots[k:] + slots[:k]
        client = self._task_client()
        states = self._describe(client, slots)
        self._check_plan_fence(ctx, client, pool)  # after the ids: a plan seen here precedes them
        snapshot = pool.get("open") or {}
        # rule: ids of its own (plan_batch_job) are claimed only while the broker does not know them
        # (from the impossible producer id, which only a new id accepts): each has one claimant ever,
        # so no claim sent from a stale look (a stage retry's duplicate attempt of this very ballot)
        # can reach a transaction opened on it, a decided one included.
        once = bool(pool.get("ids"))
        tried: list[str] = []
        freed: list[str] = []
        for tid in slots:
            d = states.get(tid)
            if d is None:
                tried.append(f"{tid}: no answer from its transaction coordinator")
                continue
            if d.error_code == kp.TRANSACTIONAL_ID_NOT_FOUND:
                expect = None  # never used: only a new id accepts the impossible producer id
            elif once:
                tried.append(f"{tid}: claimed before (this ballot's ids are claimed once: by another attempt, "
                             "or by one whose answer was lost, or fenced by the ballot's cleanup)")
                continue
            elif d.error_code != kp.NONE:
                tried.append(f"{tid}: {kp.error_name(d.error_code)}")
                continue
            elif d.state == "Ongoing" and snapshot.get(tid) == [d.producer_id, d.producer_epoch]:
                if self._abort_open(client, tid, d.producer_id, d.producer_epoch, ctx.label, wait=False):
                    freed.append(tid)
                tried.append(f"{tid}: held a transaction left open before this batch was planned (aborted)")
                continue
            elif d.state not in _CLAIMABLE:
                tried.append(f"{tid}: {d.state} under producer id {d.producer_id} epoch {d.producer_epoch}")
                continue
            else:
                expect = (d.producer_id, d.producer_epoch)
            txn = self._claim(ctx, client, tid, expect, tried, fence=pool if once else None)
            if txn is not None:
                return txn
        # Every other id is taken: one whose leftover this attempt just aborted is free once the
        # broker has completed the abort (its markers written).  Described again, then claimed.
        deadline, delay = time.monotonic() + self.request_timeout_s, 0.02
        while freed and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            states = self._describe(client, freed)
            self._check_plan_fence(ctx, client, pool)
            waiting = []
            for tid in freed:
                d = states.get(tid)
                if d is not None and d.error_code == kp.NONE and d.state in _CLAIMABLE:
                    txn = self._claim(ctx, client, tid, (d.producer_id, d.producer_epoch), tried)
                    if txn is not None:
                        return txn
                elif d is not None and d.error_code == kp.NONE and d.state == "PrepareAbort":
                    waiting.append(tid)
            freed = waiting
        if once:
            raise TwoPhaseError(
                f"{ctx.label}: none of the {len(slots)} transactional ids of partition {ctx.partition_id} could be "
                f"claimed: {'; '.join(tried)}. Nothing was written. Each id of this ballot is claimed once: "
                "other attempts of this partition took them, or the ballot was closed and its cleanup fenced "
                "them (this attempt is late). A run of the batch plans new ones (raise slots_per_partition "
                "if attempts of one ballot run out of ids).")
        raise TwoPhaseError(
            f"{ctx.label}: none of the {len(slots)} transactional ids of partition {ctx.partition_id} could be "
            f"claimed: {'; '.join(tried)}. Nothing was written. Other attempts of this partition hold them "
            "(raise slots_per_partition above spark.task.maxFailures if task attempts run out of ids); "
            "the batch's cleanup aborts what failed attempts left open.")

    def _check_plan_fence(self, ctx: TransactionContext, client, pool: dict[str, Any]) -> None:
        """Raise unless the plan fence still holds the epoch of this attempt's INTENT (executor)."""
        from twophase.sinks.kafka import protocol as kp

        fence = str(pool["fence"])
        st = self._describe(client, [fence]).get(fence)
        if st is None or st.error_code != kp.NONE:
            why = "no answer" if st is None else kp.error_name(st.error_code)
            raise TwoPhaseError(f"{ctx.label}: cannot read the plan fence {fence} ({why}); nothing was "
                                "written")
        if [st.producer_id, st.producer_epoch] != list(pool["fence_producer"]):
            raise TwoPhaseError(
                f"{ctx.label}: this task attempt is late: its execution of batch {ctx.batch_id} was closed, or a "
                f"newer one or a later batch was planned after its own (the plan fence {fence} is at producer id {st.producer_id} "
                f"epoch {st.producer_epoch}, its INTENT's at {pool['fence_producer']}). It claims no "
                "transactional id and writes nothing.")

    def _claim(self, ctx: TransactionContext, client, tid: str, expect: tuple[int, int] | None,
               tried: list[str], fence: dict[str, Any] | None = None) -> KafkaTransaction | None:
        """Claim ``tid`` from ``expect`` (None: a new id), then initialise a producer on it; None if lost.

        ``fence``: the INTENT's pool, whose plan fence is read again after the claim (an own id,
        :meth:`~twophase.sinks.kafka.pool._Pool.plan_batch_job`): a claim that landed after the
        ballot's cleanup closed the plan finds the fence moved and stops, writing nothing; one that
        landed before is seen by that cleanup, which fences it (``_fence_own_ids``)."""
        from twophase.sinks.kafka import protocol as kp

        ck = require("confluent_kafka", "KafkaSink")
        pid, epoch = expect if expect is not None else (kp.UNUSED_PRODUCER_ID, 0)
        deadline = time.monotonic() + self.request_timeout_s
        delay = 0.02
        while True:
            code, cpid, cepoch = client.init_producer_id(tid, self.transaction_timeout_ms, pid, epoch)
            if code == kp.NONE:
                break
            if code in (kp.PRODUCER_FENCED, kp.INVALID_PRODUCER_EPOCH, kp.INVALID_PRODUCER_ID_MAPPING,
                        kp.CONCURRENT_TRANSACTIONS):
                tried.append(f"{tid}: taken by another attempt ({kp.error_name(code)})")
                return None
            if code in kp.RETRIABLE and time.monotonic() < deadline:
                # A claim of a known id that was applied but whose answer was lost is answered again,
                # unbumped; of a new id (from the impossible producer id) it is refused: that id is
                # given up below (PRODUCER_FENCED) and stays unused, a slot lost, never a transaction.
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if code in kp.RETRIABLE:
                tried.append(f"{tid}: {kp.error_name(code)} for {self.request_timeout_s:.0f}s")
                return None
            raise TwoPhaseError(f"{ctx.label}: cannot claim transactional id {tid} on {self.bootstrap_servers}: "
                                f"{kp.error_name(code)}. Check the ACLs for transactional ids with this prefix "
                                "(Write); nothing was written.")
        if fence is not None:
            self._check_plan_fence(ctx, client, fence)  # rule: after the claim (see the docstring)
        handler = _LibrdkafkaLog(f"{ctx.label} ({tid})")
        rdk_logger = logging.Logger(f"twophase.rdkafka.{tid}")
        rdk_logger.setLevel(logging.DEBUG)
        rdk_logger.addHandler(handler)
        box: list = [None]
        conf = self._producer_config(tid, box)
        conf["logger"] = rdk_logger
        producer = ck.Producer(conf)
        txn = KafkaTransaction(ctx, tid, producer, handler, started_at=time.time())
        box[0] = txn
        try:
            producer.init_transactions(self.request_timeout_s * 2)
        except ck.KafkaException as e:
            self._release(txn)
            raise TwoPhaseError(f"{ctx.label}: cannot start a Kafka transaction as {tid} on "
                                f"{self.bootstrap_servers}: {e.args[0].str() if e.args else e}") from None
        got = self._producer_id_epoch(txn)
        if got != (cpid, cepoch + 1):
            # Someone else's InitProducerId landed between our claim and librdkafka's: the id is
            # not ours.  Nothing of ours is open on it; the producer goes.
            self._release(txn)
            tried.append(f"{tid}: initialised by another attempt between this one's claim (epoch {cepoch}) and "
                         f"its producer ({'unknown' if got is None else f'producer id {got[0]} epoch {got[1]}'})")
            return None
        txn.claimed = (cpid, cepoch)
        try:
            producer.begin_transaction()
        except ck.KafkaException as e:
            self._release(txn)
            raise TwoPhaseError(f"{ctx.label}: cannot begin a Kafka transaction as {tid}: "
                                f"{e.args[0].str() if e.args else e}") from None
        txn.started_at = time.time()
        return txn
