"""The driver: :class:`~twophase.sinks.kafka.KafkaSink`'s committer and its verdicts.

``verify_prepared`` (before the decision: every transaction still open with ``commit_margin_ms`` of
its timeout left), ``commit`` (EndTxn by producer id and epoch) and, when EndTxn says the id moved
on, the verdict read from the transaction's first records (``_records_fate``: committed, aborted
and never visible, pending, gone, unknown), ``recover_and_commit`` / ``recover_and_abort`` after a
restart, and the age warnings of pending handles.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from twophase._deps import require
from twophase.errors import TransactionTakenError, TwoPhaseError
from twophase.sink import CommitOutcome, CommitResult
from twophase.sinks.kafka.common import _KafkaSinkBase, log


class _Committer(_KafkaSinkBase):
    """Verify, commit, tell what became of a transaction, recover (driver)."""

    def verify_prepared(self, batch_id: int, handles: list[dict], *,
                        prepare_started_at: float) -> None:
        """Before the decision: each transaction still open, ``commit_margin_ms`` left (driver).

        The broker aborts a transaction ``transaction.timeout.ms`` after its first record,
        whether or not the batch's other tasks are done: with several waves of tasks, the
        first wave's transactions age while the last wave runs.  Deciding a batch one of
        whose transactions is already aborted (or about to be) turns into data loss at
        the commit.  So this asks DescribeTransactions (one request per transaction
        coordinator) that each handle's transaction is ``Ongoing`` under the handle's
        producer id and epoch, and that it has at least ``commit_margin_ms`` of its
        timeout left.  A transaction's age is the driver's clock minus the broker's
        start time of the transaction, capped at the time since ``prepare_started_at``
        (it cannot be older than the batch).  Raises :class:`TwoPhaseError` otherwise;
        the batch is then undecided and the coordinator aborts its transactions.  When every
        transaction found closed is less than half its timeout old, another actor's
        InitProducerId closed it, not the broker's clock: :class:`TransactionTakenError`, and
        the coordinator runs the batch again in a new ballot.
        """
        from twophase.sinks.kafka import protocol as kp

        if not handles:
            return
        client = self._txn_client()
        tids = [str(h["transactional_id"]) for h in handles]
        try:
            states: dict[str, Any] | None = self._describe(client, tids)
        except kp.UnsupportedRequest as e:
            log.warning("batch %d: cannot check the Kafka transactions before the decision (%s); "
                        "only the batch's duration is checked against transaction_timeout_ms",
                        batch_id, e)
            states = None
        now = time.time()
        duration = max(0.0, now - float(prepare_started_at))
        margin_s = self.commit_margin_ms / 1000.0
        not_open: list[str] = []
        taken: list[str] = []
        tight: list[tuple[float, str]] = []
        oldest_age, oldest_tid, oldest_timeout_s = -1.0, "", self.transaction_timeout_ms / 1000.0
        for h, tid in zip(handles, tids):
            pid, epoch = int(h["producer_id"]), int(h["producer_epoch"])
            timeout_s = int(h.get("timeout_ms", self.transaction_timeout_ms)) / 1000.0
            # No transaction of this batch can be older than the batch: cap every estimate there.
            started = h.get("started_at")
            age = duration if started is None else min(duration, max(0.0, now - float(started)))
            st = None if states is None else states.get(tid)
            is_open = False
            if states is None:
                is_open = True  # the broker cannot tell: the clock check alone
            elif st is None:
                not_open.append(f"{tid}: its transaction coordinator did not answer "
                                f"DescribeTransactions within {self.request_timeout_s:.0f}s "
                                "(request_timeout_s)")
            elif st.error_code != kp.NONE:
                not_open.append(f"{tid}: DescribeTransactions answered {kp.error_name(st.error_code)}")
            elif st.state != "Ongoing" or st.producer_id != pid or st.producer_epoch != epoch:
                not_open.append(self._not_open_reason(tid, pid, epoch, st, timeout_s))
                if age < timeout_s / 2:
                    # Far younger than its timeout (whatever the clocks' skew): not the broker's
                    # abort but another actor's InitProducerId on the id (a late task attempt).
                    taken.append(not_open[-1])
            else:
                is_open = True
                # The broker's clock started the timeout: prefer its start time to the executor's.
                timeout_s = st.timeout_ms / 1000.0
                if st.start_time_ms > 0:
                    age = min(duration, max(0.0, now - st.start_time_ms / 1000.0))
            if age > oldest_age:
                oldest_age, oldest_tid, oldest_timeout_s = age, tid, timeout_s
            if is_open and timeout_s - age < margin_s:
                tight.append((timeout_s - age, tid))
        if not not_open and not tight:
            return

        def more(items: list[str]) -> str:
            rest = f" (and {len(items) - 5} more)" if len(items) > 5 else ""
            return "; ".join(items[:5]) + rest

        if taken and len(taken) == len(not_open) and not tight:
            raise TransactionTakenError(
                f"batch {batch_id}: not deciding the batch: {len(taken)} of its {len(handles)} Kafka "
                f"transactions were aborted long before their timeout: {more(taken)}. Another actor "
                "initialised the id (a late attempt of one of the batch's tasks, which claimed it from a "
                "stale look at its state). Nothing of this batch is visible; the ballot's transactions "
                "are aborted and the batch runs again in a new ballot.")

        parts = [(f"batch {batch_id}: not deciding the batch: {len(not_open) + len(tight)} of its "
                  f"{len(handles)} Kafka transactions could not be committed safely.")]
        if not_open:
            parts.append(f"Not open any more: {more(not_open)}.")
        if tight:
            parts.append(f"Less than commit_margin_ms={self.commit_margin_ms} ({margin_s:.0f}s) of "
                         f"their timeout left: {more([t for _, t in sorted(tight)])}.")
        age_txt = f"its oldest transaction ({oldest_tid}) is {oldest_age:.0f}s old"
        parts.append(
            "The broker aborts a transaction transaction_timeout_ms="
            f"{int(oldest_timeout_s * 1000)} ms ({oldest_timeout_s:.0f}s) after its first record; "
            f"the batch's tasks have run for {duration:.0f}s so far and {age_txt}. Nothing of this "
            "batch is visible; its transactions are aborted and its replay writes it again. The "
            "timeout must cover the whole prepare phase (every wave of tasks) plus the commit "
            "margin: raise transaction_timeout_ms (up to the brokers' "
            "transaction.max.timeout.ms, default 900000; raise that on the brokers if needed), or "
            "shorten the batch: fewer rows per batch (e.g. maxOffsetsPerTrigger) or fewer waves "
            "of tasks (no more partitions than executor cores).")
        raise TwoPhaseError(" ".join(parts))

    @staticmethod
    def _not_open_reason(tid: str, pid: int, epoch: int, st: Any, timeout_s: float) -> str:
        where = f"{tid} (producer id {pid}, epoch {epoch})"
        seen = f"{st.state} under producer id {st.producer_id} epoch {st.producer_epoch}"
        aborted = st.state in ("PrepareAbort", "CompleteAbort", "PrepareEpochFence")
        if st.producer_id == pid and (st.producer_epoch > epoch
                                      or (aborted and st.producer_epoch == epoch)):
            return (f"{where}: the broker already aborted it ({seen}): it outlived its "
                    f"transaction timeout of {timeout_s:.0f}s, or something else initialised this "
                    "transactional id")
        return f"{where}: the broker reports {seen}, not this handle's open transaction"

    def commit(self, handle: dict) -> CommitResult:
        """EndTxn(commit) with the handle's producer id and epoch (driver; idempotent).

        The broker answers success both for this commit and for a repeated one (so a
        retry after a lost answer also reports COMMITTED); :meth:`recover_and_commit`
        tells them apart.  When the broker says the id moved on (PRODUCER_FENCED,
        INVALID_PRODUCER_EPOCH, INVALID_TXN_STATE, INVALID_PRODUCER_ID_MAPPING), a commit that
        landed earlier cannot be told from an abort by EndTxn: a zombie that initialised the id
        after the commit, or the id's expiry, look the same.  The handle's first offsets can
        (:meth:`_records_fate`): visible to read_committed readers -> ALREADY_COMMITTED; skipped
        by them with the last stable offset past it, on a topic that is not compacted -> LOST
        with ``never_visible`` (the batch, if every handle is so, is void and runs again: the
        broker's transaction timeout no longer loses a decided batch); deleted, or on a compacted
        topic -> LOST (data loss: the record's fate cannot be proven); not decided yet ->
        RETRY_LATER.  Handles without offsets (the executor's read of them is best effort) are
        LOST on those answers.
        """
        from twophase.sinks.kafka import protocol as kp

        warning = self.pending_age_warning(handle)
        if warning:
            log.warning("%s", warning)
        tid, pid, epoch = handle["transactional_id"], int(handle["producer_id"]), int(handle["producer_epoch"])
        code = self._txn_client().end_txn(tid, pid, epoch, commit=True)
        name = kp.error_name(code)
        if code == kp.NONE:
            return CommitResult.committed()
        if code in kp.RETRIABLE:
            return CommitResult.retry_later(f"{name} from the transaction coordinator of {tid}")
        if code in (kp.INVALID_PRODUCER_EPOCH, kp.PRODUCER_FENCED, kp.INVALID_TXN_STATE,
                    kp.INVALID_PRODUCER_ID_MAPPING) and handle.get("txn_start_offsets"):
            # The id moved on (re-initialised, expired): EndTxn cannot tell a commit that landed
            # earlier from an abort.  The transaction's own records can.
            verdict, where = self._records_fate(handle["txn_start_offsets"], pid, epoch,
                                                handle.get("txn_topic_ids"))
            if verdict == "committed":
                return CommitResult.already_committed(
                    f"EndTxn answered {name} for {tid} (producer id {pid}, epoch {epoch}): the id was "
                    f"initialised again or expired since, but {where} is visible to read_committed readers: "
                    "an earlier commit made the transaction visible")
            if verdict == "pending":
                return CommitResult.retry_later(
                    f"EndTxn answered {name} for {tid}; whether its transaction committed shows once {where}")
            if verdict == "unknown":
                return CommitResult.retry_later(
                    f"EndTxn answered {name} for {tid}, and reading {where} to tell whether its transaction "
                    "committed failed")
            lost = self._lost(handle, code, name)
            if verdict == "aborted":
                # Proof that nothing of it was ever visible: its first record is still in the
                # partition (not deleted), the topic is not compacted (so a committed record is
                # never removed one by one), and read_committed readers, with the last stable
                # offset past it, skip it: its transaction was aborted, everywhere (a transaction
                # commits or aborts as a whole), and an aborted transaction never commits later.
                return CommitResult.lost(f"{lost.reason}; {where}: read_committed readers never saw it",
                                         never_visible=True)
            return CommitResult.lost(f"{lost.reason}; whether it had committed cannot be checked: {where}")
        return self._lost(handle, code, name)

    def _lost(self, handle: dict, code: int, name: str) -> CommitResult:
        from twophase.sinks.kafka import protocol as kp

        tid, pid, epoch = handle["transactional_id"], int(handle["producer_id"]), int(handle["producer_epoch"])
        age = self.handle_age(handle)
        age_txt = f"{age:.0f}s old" if age is not None else "age unknown"
        timeout = int(handle.get("timeout_ms", self.transaction_timeout_ms))
        if code in (kp.INVALID_PRODUCER_EPOCH, kp.PRODUCER_FENCED):
            return CommitResult.lost(
                f"{name}: the transaction of {tid} (producer id {pid}, epoch {epoch}, {age_txt}) was aborted "
                f"by the broker: it outlived transaction.timeout.ms={timeout} ms, or something else "
                "initialised this transactional id (another query with the same transactional_id_prefix?)")
        if code == kp.INVALID_TXN_STATE:
            return CommitResult.lost(f"{name}: the transaction of {tid} (producer id {pid}, epoch {epoch}, "
                                     f"{age_txt}) was aborted, not committed")
        if code == kp.INVALID_PRODUCER_ID_MAPPING:
            return CommitResult.lost(
                f"{name}: the broker no longer knows transactional id {tid} with producer id {pid} "
                f"({age_txt}): it expired (transactional.id.expiration.ms) or was taken over")
        return CommitResult.retry_later(f"{name} from the transaction coordinator of {tid}")

    def _consumer_config(self) -> dict[str, Any]:
        """Connection and security settings of ``producer_config`` for a read_committed consumer."""
        conf = {k: v for k, v in self._resolved_config().items()
                if k == "bootstrap.servers" or k.startswith(("security.", "ssl.", "sasl.", "enable.ssl",
                                                             "enable.sasl", "socket.", "client.dns",
                                                             "broker.address"))}
        conf.update({"group.id": f"twophase-check-{uuid.uuid4().hex[:12]}", "isolation.level": "read_committed",
                     "enable.auto.commit": False, "enable.partition.eof": True,
                     "auto.offset.reset": "error", "enable.sparse.connections": False})
        return conf

    def _absent(self, topic: str, aborted: str) -> tuple[str, str]:
        """The verdict for a first record a read_committed reader skips: aborted, unless the topic is
        compacted (compaction removes committed records superseded by a later one with the same
        key, which then read exactly like aborted ones)."""
        admin_mod = require("confluent_kafka.admin", "KafkaSink")
        res = admin_mod.ConfigResource(admin_mod.ResourceType.TOPIC, topic)
        admin = self._admin()  # referenced until the answer is in: a dropped client fails its requests
        try:
            entries = admin.describe_configs([res], request_timeout=self.request_timeout_s)[res].result()
        except Exception as e:  # noqa: BLE001 - asked again later
            return "unknown", f"{aborted}, but the cleanup policy of {topic} could not be read ({type(e).__name__})"
        entry = entries.get("cleanup.policy")
        policy = str(entry.value) if entry is not None and entry.value is not None else "delete"
        if "compact" in policy:
            return "gone", (f"{aborted.replace(' was aborted', ' is not there')}, but {topic} is compacted "
                            f"(cleanup.policy={policy}), which may have removed it after a commit")
        return "aborted", aborted

    def _topic_is_ours(self, name: str, offset: int, topic_ids: dict[str, str] | None) -> tuple[str, str] | None:
        """None if the topic of ``name`` is the incarnation the handle names (or it names none), else
        ("gone", why) or ("unknown", why): see :meth:`_record_is_ours`."""
        topic = name.rpartition(":")[0]
        want = (topic_ids or {}).get(topic)
        if not want:
            return None
        try:
            now = self._txn_client().topic_ids([topic]).get(topic)
        except Exception as e:  # noqa: BLE001 - asked again later
            return "unknown", f"the topic id of {topic} could not be read ({type(e).__name__}: {e})"
        if now == want:
            return None
        state = "no longer exists" if now is None else f"was deleted and recreated (topic id now {now})"
        return "gone", (f"topic {topic} {state} since the transaction wrote to it (topic id {want}): whatever "
                        f"{name} holds at offset {offset} now is not its record, so whether it committed "
                        "cannot be read")

    def _record_is_ours(self, name: str, offset: int, producer_id: int | None,
                        producer_epoch: int | None) -> tuple[str, str] | None:
        """None if ``name`` (``"topic:partition"``) still holds, at ``offset``, a record of this
        transaction (this producer id and epoch; the topic incarnation is :meth:`_topic_is_ours`'s);
        otherwise the verdict: ("gone", why) when it holds another's or none, ("unknown", why) when
        that cannot be read.

        A handle names its record: the topic id (``txn_topic_ids``, since issue 59) and the producer id
        and epoch.  A topic deleted and recreated under its name, or a log truncated and written
        again (an unclean leader election), holds another transaction's record at that offset, or
        none: what a reader finds there says nothing of this transaction, so it is neither "never
        visible" (void, run again: a duplicate if it had committed) nor "committed" (silent loss if
        it was aborted).  Handles without ``txn_topic_ids`` (written before) are checked by the
        producer id and epoch alone, which a recreated topic's records do not share (producer ids
        are allocated cluster-wide)."""
        topic = name.rpartition(":")[0]
        client = self._txn_client()
        if producer_id is None:
            return None
        try:
            kind, what = client.batch_at(name, offset)
        except Exception as e:  # noqa: BLE001 - asked again later
            return "unknown", f"reading {name} at offset {offset} failed ({type(e).__name__}: {e})"
        if kind == "batch":
            pid, ep, control = what
            if not control and pid == int(producer_id) and (producer_epoch is None or ep == int(producer_epoch)):
                return None
            whose = "a transaction marker" if control else f"a record of producer id {pid} epoch {ep}"
            return "gone", (f"{name} holds {whose} at offset {offset}, not this transaction's (producer id "
                            f"{producer_id} epoch {producer_epoch}): topic {topic} was recreated or its offsets "
                            "reused, so whether the transaction committed cannot be read")
        if kind == "out-of-range":  # the caller saw the partition start at or before it: past the end
            return "gone", (f"{name} now ends before offset {offset}: topic {topic} was recreated or its log "
                            "truncated, so whether the transaction committed cannot be read")
        if kind == "no-topic":
            return "gone", f"topic {topic} no longer exists, so whether the transaction committed cannot be read"
        if kind == "beyond":
            return "gone", (f"{name} now ends at offset {what}, before {offset}: topic {topic} was recreated or "
                            "its log truncated, so whether the transaction committed cannot be read")
        return "gone", (f"{name} holds no record at offset {offset} (the next is at {what}): removed, so whether "
                        "the transaction committed cannot be read")

    def _records_fate(self, offsets: dict[str, int], producer_id: int | None = None,
                      producer_epoch: int | None = None,
                      topic_ids: dict[str, str] | None = None) -> tuple[str, str]:
        """What became of a transaction whose first records are at ``offsets`` (driver).

        First, each partition must still hold this transaction's record at that offset
        (:meth:`_record_is_ours`: same topic incarnation, producer id and epoch); if it holds
        another's, or none, the verdict is ("gone", why): never "aborted", never "committed".

        ("committed", where): a read_committed consumer gets the record at that offset.
        ("aborted", where): the last stable offset is past it and the consumer skips it (the
        next record it gets is later, or it reaches the end) on a topic that is not compacted.
        A transaction commits or aborts as a whole, so one topic partition answers.
        ("pending", where): the last stable offset is not past it yet (a transaction still open
        before or at it) and, with ``producer_id``, the transaction's own marker cannot be read
        either (:meth:`TxnClient.transaction_marker`: read uncommitted, so another open
        transaction holding the last stable offset back does not hide it; a marker answers only
        while the transaction's first record is still there; an abort marker on a compacted topic
        is "gone", as for a skipped record).  ("gone", where): the record was deleted (retention), or is absent
        from a compacted topic.  ("unknown", where): reading it failed.
        """
        ck = require("confluent_kafka", "KafkaSink")
        consumer = ck.Consumer(self._consumer_config())
        verdict, where = "unknown", "no topic partition to read"
        held: str | None = None  # a partition whose last stable offset is held back, its marker unread
        # An absent record proves an abort only where records are not deleted one by one: see _absent.
        try:
            for name, offset in sorted(offsets.items()):
                topic, _, part = name.rpartition(":")
                offset, where = int(offset), f"its first record on {name} (offset {int(offset)})"
                foreign = self._topic_is_ours(name, offset, topic_ids)
                if foreign is None:
                    tp = ck.TopicPartition(topic, int(part))
                    try:
                        low, stable = consumer.get_watermark_offsets(tp, timeout=self.request_timeout_s,
                                                                     cached=False)
                    except ck.KafkaException as e:
                        verdict, where = "unknown", f"{where}: {e.args[0].str() if e.args else e}"
                        continue
                    if offset < low:
                        verdict, where = "gone", f"{where} was deleted (the partition now starts at {low})"
                        continue
                    foreign = self._record_is_ours(name, offset, producer_id, producer_epoch)
                if foreign is not None:  # another partition of the transaction may still tell
                    verdict, where = foreign
                    continue
                if stable <= offset:
                    pending = f"the last stable offset of {name} ({stable}) passes {offset}"
                    marker = None
                    if producer_id is not None:
                        try:
                            marker = self._txn_client().transaction_marker(name, offset, int(producer_id))
                        except Exception as e:  # noqa: BLE001 - then the last stable offset decides
                            log.debug("reading the transaction marker after %s failed: %s", where, e)
                    if marker == "commit":
                        return "committed", f"{where} (its transaction's commit marker)"
                    if marker == "abort":
                        verdict, where = self._absent(topic, f"{where} was aborted (its transaction's abort "
                                                             f"marker, read uncommitted; {pending} yet)")
                        if verdict == "aborted":
                            return verdict, where
                        continue
                    held = held or pending  # another partition of the transaction may answer
                    continue
                consumer.assign([ck.TopicPartition(topic, int(part), offset)])
                deadline = time.monotonic() + self.request_timeout_s
                while time.monotonic() < deadline:
                    m = consumer.poll(0.2)
                    if m is None:
                        continue
                    err = m.error()
                    if err is not None and err.code() != ck.KafkaError._PARTITION_EOF:
                        verdict, where = "unknown", f"{where}: {err.str()}"
                        break
                    if err is None and m.offset() == offset:
                        return "committed", where
                    skipped = (f"the end, offset {m.offset()}, without it" if err is not None else
                               f"offset {m.offset()} next")
                    verdict, where = self._absent(topic, f"{where} was aborted (read_committed readers reach "
                                                         f"{skipped})")
                    if verdict == "aborted":
                        return verdict, where
                    break  # a compacted topic: another partition's record may still tell
                else:
                    verdict, where = "unknown", f"{where}: no answer within {self.request_timeout_s:.0f}s"
            if held is not None:
                return "pending", held
            return verdict, where
        finally:
            consumer.close()

    def recover_and_commit(self, handle: dict) -> CommitResult:
        """Commit a handle found in the log after a restart; tell an earlier commit apart (driver).

        EndTxn answers success for a first commit and for a repeated one alike, so the
        broker's transaction state is asked first: ``CompleteCommit`` under the handle's
        producer id and exact epoch means an earlier call committed it (each producer
        runs one transaction under its epoch, and an abort by timeout or fencing bumps
        the epoch) -> ALREADY_COMMITTED; ``PrepareCommit`` (an earlier commit whose markers
        are being written) -> RETRY_LATER.  Otherwise EndTxn decides; a success after any
        state but ``Ongoing`` (e.g. the state could not be read) is reported as COMMITTED
        with the reason "committed (or already committed: the broker cannot tell)".
        """
        from twophase.sinks.kafka import protocol as kp

        tid = handle["transactional_id"]
        pid, epoch = int(handle["producer_id"]), int(handle["producer_epoch"])
        try:
            st = self._txn_client().describe_transactions([tid]).get(tid)
        except Exception as e:  # e.g. a broker without DescribeTransactions: EndTxn alone decides
            log.debug("DescribeTransactions for %s failed: %s", tid, e)
            st = None
        ours = (st is not None and st.error_code == kp.NONE and st.producer_id == pid
                and st.producer_epoch == epoch)
        what = f"the transaction of {tid} (producer id {pid}, epoch {epoch})"
        if ours and st.state == "CompleteCommit":
            return CommitResult.already_committed(f"the broker reports {what} committed")
        if ours and st.state == "PrepareCommit":
            # An earlier EndTxn was accepted; the broker is writing its markers.
            return CommitResult.retry_later(f"the broker is completing the commit of {what}")
        res = self.commit(handle)
        if res.outcome is CommitOutcome.COMMITTED and not (ours and st.state == "Ongoing"):
            return CommitResult(CommitOutcome.COMMITTED,
                                "committed (or already committed: the broker cannot tell)")
        return res

    def recover_and_abort(self, handle: dict) -> None:
        """Abort a pre-committed transaction by EndTxn(abort) under its exact producer id and epoch
        (driver).  Returns once the broker confirmed it: aborted now, or no longer open under that
        epoch (ended before, or the id moved on); transient errors are retried for a minute, then
        (and on any other answer) it raises: the transaction may still be open."""
        self._abort_open(self._txn_client(), handle["transactional_id"], int(handle["producer_id"]),
                         int(handle["producer_epoch"]), f"aborting {self.describe_handle(handle)}")

    def describe_handle(self, handle: dict) -> str:
        # "topics" since delivery reports stopped naming partitions; older handles have "partitions"
        where = ", ".join(handle.get("topics") or []) or f"{len(handle.get('partitions') or [])} topic partitions"
        return (f"transactional id {handle.get('transactional_id')} producer id {handle.get('producer_id')} "
                f"epoch {handle.get('producer_epoch')} ({handle.get('rows', '?')} rows to {where})")

    @staticmethod
    def handle_age(handle: dict, now: float | None = None) -> float | None:
        """Seconds since the handle's transaction began (the broker's timeout clock), or None."""
        started = handle.get("started_at")
        if started is None:
            return None
        return max(0.0, (time.time() if now is None else now) - float(started))

    def pending_age_warning(self, handle: dict, age_seconds: float | None = None) -> str | None:
        """A warning for ``twophase status`` and the commit path when a pending transaction nears its timeout.

        The age is the larger of ``age_seconds`` (e.g. time since the decision was
        logged) and the time since the transaction began (recorded in the handle:
        the broker's timeout clock starts there).  None while younger than
        ``warn_age_fraction`` of its timeout.
        """
        ages = [a for a in (self.handle_age(handle), age_seconds) if a is not None]
        if not ages:
            return None
        age = max(float(a) for a in ages)
        timeout_s = int(handle.get("timeout_ms", self.transaction_timeout_ms)) / 1000.0
        tid = handle.get("transactional_id")
        if age >= timeout_s:
            return (f"pending Kafka transaction {tid} is {age:.0f}s old, past its transaction.timeout.ms "
                    f"({timeout_s:.0f}s): the broker has probably aborted it; committing it will report "
                    "data loss")
        if age >= self.warn_age_fraction * timeout_s:
            return (f"pending Kafka transaction {tid} is {age:.0f}s old, {100 * age / timeout_s:.0f}% of its "
                    f"transaction.timeout.ms ({timeout_s:.0f}s): commit it soon (restart the query or run "
                    "'twophase recover') or the broker aborts it")
        return None
