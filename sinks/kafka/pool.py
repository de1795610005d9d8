"""The driver: :class:`~twophase.sinks.kafka.KafkaSink`'s pool of transactional ids and its plans.

The pool is ``{prefix}-{partition}.{slot}``, ``slots_per_partition`` ids per partition, plus the
plan fence ``{prefix}-plans``, which never holds a transaction.  ``plan_batch`` bumps the fence and
records, in the INTENT, its new epoch and which of the pool's transactions are open (``open``:
leftovers of closed ballots; ``held``: no evidence whose).  ``abort_lingering`` cleans up a
ballot's ids (EndTxn under the exact producer id and epoch it described), closing a decided
ballot's plan at the fence first; ``plan_superseded`` tells whether a newer plan moved the fence.
INTENTs of earlier versions (ids ``{prefix}-{partition}``, no pool) are cleaned up by fencing.
The executor side of the fence is the tasks' claim (``claims.py``).
"""

from __future__ import annotations

import time
from typing import Any

from twophase.errors import TwoPhaseError
from twophase.sinks.kafka.common import OWN_IDS_VERSION, POOL_VERSION, _KafkaSinkBase, log


class _Pool(_KafkaSinkBase):
    """The pool of transactional ids, its plans and the cleanup of a ballot's ids (driver)."""

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """INTENT of one ballot: the pool's ids for ``num_partitions`` partitions, the plan fence's
        new epoch, and which ids of the pool had an open transaction at this moment (driver).

        Bumps the plan fence ``{prefix}-plans`` (an unconditional InitProducerId on an id that never
        holds a transaction, so it aborts nothing) and records the new (producer id, epoch): a
        task whose INTENT names an older epoch is late and claims nothing, and the cleanup of this
        ballot knows whether a newer one has been planned since.  The fence also keeps, in its
        transaction timeout field (which the broker never acts on for an id without a
        transaction), the widest plan so far, so that ids of partitions an earlier, wider batch
        used are still looked at.  Then one DescribeTransactions (per transaction coordinator) of
        those ids: the ones found ``Ongoing`` are listed ``open`` (leftovers of closed executions,
        whose exact (producer id, epoch) this ballot's tasks and cleanup may abort, however late)
        only with the evidence described below, the fence read again after the describe
        included; else ``held``.  Nothing in the pool is changed here.
        """
        if self.transactional_ids == "per-plan":
            return self._plan_own_ids(batch_id, num_partitions)
        n, r = int(num_partitions), self.slots_per_partition
        ids = self.pool_ids(n)
        pool: dict[str, Any] = {"version": POOL_VERSION, "partitions": n, "slots": r, "widest": n,
                                "fence": self.plan_fence_id(), "fence_producer": None, "open": {}}
        intent = {"transactional_ids": ids, "transaction_timeout_ms": self.transaction_timeout_ms,
                  "pool": pool}
        if not ids:
            return intent
        from twophase.sinks.kafka import protocol as kp

        client = self._txn_client()
        fence = self.plan_fence_id()
        before = self._describe(client, [fence]).get(fence)
        widest = n
        if before is not None and before.error_code == kp.NONE:
            widest = max(n, int(before.timeout_ms))
        widest = min(widest, self.transaction_timeout_ms)  # a timeout the broker accepts
        pool["widest"] = max(n, widest)
        fence_now = list(self._bump_plan_fence(client, batch_id, max(1, widest)))
        pool["fence_producer"] = fence_now
        # Whose are the transactions open now?  Rule (docs/design.md, issue 59): an open transaction
        # is a leftover (abortable by this ballot's tasks and cleanup) only with evidence that its
        # ballot is closed.  The evidence this sink holds: the plan just before this one (the
        # fence moved from its epoch by exactly this bump: no other plan in between) is one whose
        # ballot is closed: this object's own previous plan (its coordinator opens a ballot only
        # after closing its earlier ones), or one whose closed ballot it cleaned up
        # (abort_lingering, recovery's included).  Then whatever is open was claimed under closed
        # ballots, or was already held by that plan.  Otherwise another run planned in between (a
        # backfill of an older batch id, a run that took the log over) or this object knows no
        # plan (a restart): what is open may be a live, even decided, ballot's, so it is *held*:
        # never aborted by this ballot, left to its owner or to the broker's transaction timeout.
        chain = self._chain
        proven = (chain is not None and chain["fence"][0] == fence_now[0]
                  and chain["fence"][1] + 1 == fence_now[1])
        held_before: dict[str, list[int]] = chain["held"] if proven and chain is not None else {}
        states = self._describe(client, self._scanned_ids(pool))
        found = {t: [d.producer_id, d.producer_epoch] for t, d in states.items()
                 if d.error_code == kp.NONE and d.state == "Ongoing"}
        if proven and found:
            # The bump and the describe are two requests: another run's plan can land between them
            # and its tasks open transactions that the describe then finds (review r9).  So the
            # fence is read again, after the describe's answer: still at this plan's epoch, no plan
            # landed from the bump to after every id was described, and what is open belongs to
            # the plans before (the proof above).  Moved or unknown: no proof, everything is held.
            # A plan landing after this read opens its transactions after it, so not in `found`.
            proven = self._plan_fence_state(client, pool) is True
        pool["open"] = {t: pe for t, pe in found.items() if proven and held_before.get(t) != pe}
        pool["held"] = {t: pe for t, pe in found.items() if t not in pool["open"]}
        self._chain = {"fence": fence_now, "held": dict(pool["held"])}
        if pool["held"]:
            log.info("batch %d: %d open transactions on this query's ids (%s) are left alone by this "
                     "ballot: another plan came before it, and they may be that run's", batch_id,
                     len(pool["held"]), ", ".join(sorted(pool["held"])[:5]))
        return intent

    def plan_batch_job(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """INTENT of one ballot of a batch job: transactional ids of its own (``transactional_ids=
        "auto"``, the default, or ``"per-plan"``; ``"pool"``: :meth:`plan_batch`'s pool) (driver).

        Two runs of a batch job overlap (a backfill of batch 5 beside a run of batch 11).  On a
        shared pool, a task of one that claimed an id and paused before its producer's
        InitProducerId (librdkafka's, unconditional) aborts, when it resumes, whatever the other
        run opened on that id since, a decided transaction included (the explorer's
        ``decided-fenced``, docs/kafka.md).  Ids only this ballot names cannot meet another run's.
        """
        if self.transactional_ids == "pool":
            return self.plan_batch(query_name, batch_id, num_partitions)
        return self._plan_own_ids(batch_id, num_partitions)

    def _plan_own_ids(self, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """A ballot on ids of its own: ``{prefix}-{pid}.{epoch}-{partition}.{slot}``, named after the
        plan fence's (producer id, epoch) that this plan's bump returned, which the broker gives one
        plan only.  Nothing can be open on them yet: no describe, nothing ``open`` or ``held``.  The
        bump still makes every earlier ballot's late attempts claim nothing.  A task claims one of
        them only while the broker does not know it (claims.py), so each has one claimant ever:
        ``2 * slots_per_partition`` of them per partition."""
        # Each id is claimed once (claims.py), so every attempt of a partition takes a slot of its
        # own: twice the pool's, which costs the brokers nothing (an id exists once claimed).
        n, r = int(num_partitions), 2 * self.slots_per_partition
        fence = self.plan_fence_id()
        pool: dict[str, Any] = {"version": OWN_IDS_VERSION, "partitions": n, "slots": r, "widest": n,
                                "fence": fence, "fence_producer": None, "open": {}, "held": {}}
        intent: dict[str, Any] = {"transactional_ids": [], "transaction_timeout_ms": self.transaction_timeout_ms,
                                  "pool": pool}
        if n == 0:
            return intent
        from twophase.sinks.kafka import protocol as kp

        client = self._txn_client()
        before = self._describe(client, [fence]).get(fence)
        widest = n  # the fence keeps the widest plan of the pool's ids (plan_batch): never lowered here
        if before is not None and before.error_code == kp.NONE:
            widest = max(n, int(before.timeout_ms))
        widest = min(widest, self.transaction_timeout_ms)
        # Kept for the fence alone (this ballot looks at its own ids, _own_ids): the close of this
        # plan writes it back, and must not lower it either (the review of this change).
        pool["widest"] = max(n, widest)
        fence_now = list(self._bump_plan_fence(client, batch_id, max(1, widest)))
        pool["fence_producer"] = fence_now
        pool["ids"] = f"{fence_now[0]}.{fence_now[1]}"  # rule: names no other plan can give
        intent["transactional_ids"] = self._own_ids(pool)
        # This plan proves nothing about the pool's ids (plan_batch's chain): the next pool plan of
        # this object holds whatever it finds open.
        self._chain = None
        return intent

    @staticmethod
    def _own_ids(pool: dict[str, Any]) -> list[str]:
        prefix = str(pool["fence"])[:-len("-plans")]
        return [f"{prefix}-{pool['ids']}-{p}.{s}" for p in range(int(pool["partitions"]))
                for s in range(int(pool["slots"]))]

    @classmethod
    def _scanned_ids(cls, pool: dict[str, Any]) -> list[str]:
        """The ids a ballot looks at for leftovers: its own, and those of wider earlier plans (named
        from the INTENT's plan fence ``{prefix}-plans``, not from this sink's settings).  A ballot
        on ids of its own (``pool["ids"]``, :meth:`plan_batch_job`) looks at those alone."""
        if pool.get("ids"):
            return cls._own_ids(pool)
        prefix = str(pool["fence"])[:-len("-plans")]
        return [f"{prefix}-{p}.{s}" for p in range(int(pool.get("widest") or pool["partitions"]))
                for s in range(int(pool["slots"]))]

    def transactional_id(self, partition_id: int, slot: int = 0) -> str:
        """The pool's id for ``slot`` of ``partition_id``: ``{prefix}-{partition}.{slot}``."""
        return f"{self.transactional_id_prefix}-{int(partition_id)}.{int(slot)}"

    def pool_ids(self, num_partitions: int) -> list[str]:
        """Every transactional id a batch of ``num_partitions`` partitions may use (not the plan fence)."""
        return [self.transactional_id(p, s) for p in range(int(num_partitions))
                for s in range(self.slots_per_partition)]

    def plan_fence_id(self) -> str:
        """The id whose epoch marks the latest plan of this query (it never holds a transaction)."""
        return f"{self.transactional_id_prefix}-plans"

    def _bump_plan_fence(self, client, batch_id: int, widest: int) -> tuple[int, int]:
        from twophase.sinks.kafka import protocol as kp

        fence = self.plan_fence_id()
        deadline = time.monotonic() + max(60.0, 2 * self.request_timeout_s)
        delay = 0.02
        while True:
            code, pid, epoch = client.init_producer_id(fence, widest)
            if code == kp.NONE:
                return pid, epoch
            if code not in kp.RETRIABLE or time.monotonic() > deadline:
                raise TwoPhaseError(
                    f"batch {batch_id}: cannot plan the batch: InitProducerId on the plan fence {fence} "
                    f"answered {kp.error_name(code)}. Check the broker and the ACLs for transactional ids "
                    "with this prefix (Write), then restart the query.")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any],
                        keep: list[dict]) -> int:
        """Abort what this ballot's attempts left open on its ids, never what a newer one opened (driver).

        Describes the INTENT's ids (and those of wider earlier plans, see :meth:`plan_batch`)
        first, then, if an open transaction there depends on it, the plan fence (after a clean
        batch nothing is open: one request).  An open transaction (not one of
        ``keep``) is aborted, by EndTxn under the exact producer id and epoch just described, if
        the INTENT's snapshot lists it as open before this ballot was planned (a leftover of a
        closed execution), or if the plan fence still holds this INTENT's epoch (no execution has
        been planned since, so nothing open on these ids can belong to a newer one).  Otherwise
        (a deposed coordinator's late cleanup) it is left alone: it may be a newer ballot's
        decided transaction, and the newest ballot's own cleanup aborts what is a leftover.  An
        EndTxn that finds another epoch aborts nothing.  INTENTs of earlier versions (ids
        ``{prefix}-{partition}``, no "pool") are fenced as before: no ballot planned now uses those
        ids.  A ballot on ids of its own (:meth:`plan_batch_job`) aborts whatever is open on them and
        not kept: no other ballot names them.  Returns how many open transactions were aborted.
        """
        from twophase.sinks.kafka import protocol as kp

        pool = intent.get("pool")
        if not isinstance(pool, dict):
            return self._abort_lingering_unpooled(batch_id, intent, keep)
        if not intent.get("transactional_ids"):
            return 0
        tids = self._scanned_ids(pool)
        kept = {(str(h["transactional_id"]), int(h["producer_id"]), int(h["producer_epoch"])) for h in keep}
        client = self._txn_client()
        # A decided ballot (``keep`` names its committed handles) never runs again: close its plan at
        # the fence, before looking at the ids, so that a late attempt of it (a zombie task, a stage
        # retry's duplicate) claims nothing from now on instead of opening a transaction after this
        # cleanup, which another run's plan cannot attribute (it holds it) and which would hold
        # read_committed readers back until its timeout.  An undecided ballot's plan is not closed:
        # the sink's contract lets a caller clean up (keep=[]) before running its INTENT again.  A
        # ballot on ids of its own is closed either way: its ids are fenced below, so its INTENT
        # cannot run again, and a late attempt must find the fence moved after its claim (the third
        # review: an undecided ballot's cleanup raced a live attempt for the ids it claimed).
        closed = self._close_plan_fence(client, pool) if kept or pool.get("ids") else None
        states = self._describe(client, tids)
        latest: bool | None = None  # the plan fence, asked after the ids (see the docstring) and
        snapshot = pool.get("open") or {}  # only if an open transaction depends on it
        held = pool.get("held") or {}
        aborted, left = 0, []
        for tid in tids:
            st = states.get(tid)
            if st is None or st.error_code != kp.NONE or st.state != "Ongoing":
                continue
            if (tid, st.producer_id, st.producer_epoch) in kept:
                continue
            if held.get(tid) == [st.producer_id, st.producer_epoch]:
                # Open before this ballot was planned, with no evidence whose: another run's
                # live ballot, maybe decided (rule: no abort without evidence).  Left alone.
                left.append(tid)
                continue
            listed = snapshot.get(tid) == [st.producer_id, st.producer_epoch]
            # rule: ids of its own (plan_batch_job) are named by this ballot alone, and its slot is
            # filled (keep names every handle its decision counts): what is open there is its garbage.
            own = bool(pool.get("ids"))
            if not (listed or own) and latest is None:
                latest = self._plan_fence_state(client, pool, closed) is True
            if listed or own or latest:
                # rule: listed = open under a plan of this object's whose ballot it saw closed, with
                # the fence read after the plan's describe still at its epoch (no plan in between);
                # latest = opened after this ballot's plan with no plan since (the fence, read after
                # the describe, still at its epoch, or at the epoch this cleanup closed it with,
                # conditionally from that epoch): this ballot's own.
                if self._abort_open(client, tid, st.producer_id, st.producer_epoch, f"batch {batch_id}"):
                    aborted += 1
            else:
                left.append(tid)
        if pool.get("ids"):
            self._fence_own_ids(client, pool, tids, states, kept, closed, batch_id)
        if left:
            log.info("batch %d: left %d open transactions on this execution's ids alone (%s): another "
                     "execution or batch was planned before or since, and they may be its own; its cleanup "
                     "aborts them if they are leftovers, or the broker's transaction timeout does",
                     batch_id, len(left), ", ".join(left[:5]))
        self._closed_plan(pool, closed)
        return aborted

    def _fence_own_ids(self, client, pool: dict[str, Any], tids: list[str], states: dict[str, Any],
                       kept: set[tuple[str, int, int]], closed: list[int] | None, batch_id: int) -> None:
        """After the cleanup of a ballot on ids of its own: no late attempt of it may open a
        transaction there afterwards (nothing later looks at these ids again, and one left open
        would hold read_committed readers back until its timeout; the second review of this change).

        An id claimed but with no transaction (Empty, not kept) is bumped from the exact producer id
        and epoch described: the attempt's producer, initialised or not, is fenced (its
        ``init_transactions`` lands one epoch off and gives the id up, or its first produce is
        refused).  A bump refused because the id moved (the attempt's own ``init_transactions``
        landed in between: the third review) is followed by a new describe and the same rules, an
        open transaction not kept aborted: each own id has one claimant, which sends one
        unconditional InitProducerId, so this settles in a round or two.  An id the broker does not
        know is left to the attempt's own check of the plan fence after its claim (claims.py) when
        this cleanup closed the plan (``closed``); otherwise (the close did not land) it is claimed
        here, from the impossible producer id, so that no attempt can ever claim it.  Best effort:
        an id still moving after a few rounds is left to the broker's transaction timeout."""
        from twophase.sinks.kafka import protocol as kp

        todo = list(tids)
        for rounds in range(4):
            moved: list[str] = []
            for tid in todo:
                st = states.get(tid)
                if st is None:
                    continue
                if st.error_code == kp.TRANSACTIONAL_ID_NOT_FOUND:
                    if closed is not None:
                        continue
                    expect = (kp.UNUSED_PRODUCER_ID, 0)
                elif st.error_code != kp.NONE or (tid, st.producer_id, st.producer_epoch) in kept:
                    continue
                elif st.state == "Ongoing":  # rule: not kept, on an id this closed ballot alone names
                    if rounds:  # (the first describe's were aborted by abort_lingering already)
                        self._abort_open(client, tid, st.producer_id, st.producer_epoch, f"batch {batch_id}",
                                         wait=False)
                    continue
                elif st.state == "Empty":
                    expect = (st.producer_id, st.producer_epoch)  # rule: this closed ballot's id alone
                else:
                    continue
                code, _, _ = client.init_producer_id(tid, self.transaction_timeout_ms, *expect)
                if code != kp.NONE:
                    moved.append(tid)
            if not moved:
                return
            todo, states = moved, self._describe(client, moved)
        log.info("batch %d: %d ids of this ballot still moving after its cleanup (%s): a late attempt's "
                 "transaction there, if any, is left to the broker's timeout", batch_id, len(todo),
                 ", ".join(todo[:5]))

    def _close_plan_fence(self, client, pool: dict[str, Any]) -> list[int] | None:
        """Bump the plan fence from exactly ``pool``'s epoch (a conditional InitProducerId: the
        broker refuses if another plan moved it): [producer id, epoch] the fence now holds, or None
        if it moved on (or cannot be told).  From then on every task of that ballot is late and
        claims nothing (:meth:`_check_plan_fence`).  The same ballot closed twice (its own cleanup and
        another run's recovery) is answered the same epoch again (the broker takes it for a retry);
        after another plan's (unconditional) bump the answer is PRODUCER_FENCED."""
        from twophase.sinks.kafka import protocol as kp

        fence, mine = pool.get("fence"), pool.get("fence_producer")
        if not fence or not mine:
            return None
        widest = max(1, min(int(pool.get("widest") or pool.get("partitions") or 1), self.transaction_timeout_ms))
        deadline = time.monotonic() + self.request_timeout_s
        delay = 0.02
        while True:
            code, pid, epoch = client.init_producer_id(str(fence), widest, int(mine[0]), int(mine[1]))
            if code == kp.NONE:
                if [pid, epoch] != [int(mine[0]), int(mine[1]) + 1]:
                    return None
                self._fence_closes[(int(mine[0]), int(mine[1]))] = [pid, epoch]
                return [pid, epoch]
            if code not in kp.RETRIABLE or time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _closed_plan(self, pool: dict[str, Any], closed: list[int] | None = None) -> None:
        """Note that the ballot planned as ``pool`` is closed: the protocol calls abort_lingering only
        once the ballot's slot is filled (committed or closed), recovery's included.  The next plan
        of this object, if its bump lands exactly one epoch after that plan's, may then take what is
        open (and was not held by that plan) for leftovers of closed ballots (:meth:`plan_batch`)."""
        fence, chain = pool.get("fence_producer"), self._chain
        if not fence or "held" not in pool:  # INTENTs of earlier versions did not tell what they held
            return
        if pool.get("ids"):  # ids of its own: it looked at none of the pool's, so it proves nothing of them
            return
        fence = list(closed) if closed is not None else [int(fence[0]), int(fence[1])]
        if chain is None or chain["fence"][0] != fence[0] or chain["fence"][1] < fence[1]:
            self._chain = {"fence": fence, "held": dict(pool["held"])}

    def plan_superseded(self, intent: dict[str, Any]) -> bool:
        """True if the plan fence has moved past ``intent``'s epoch: a newer plan (a deposed
        coordinator's, landing late) makes every task of that ballot refuse to claim an id.
        A fence that cannot be read is not known to have moved: the failure stands."""
        pool = intent.get("pool")
        if not isinstance(pool, dict) or not intent.get("transactional_ids"):
            return False
        mine = pool.get("fence_producer")
        # This object's own close of that ballot (its cleanup) is no newer plan.
        closed = self._fence_closes.get((int(mine[0]), int(mine[1]))) if mine else None
        return self._plan_fence_state(self._txn_client(), pool, closed) is False

    def _plan_fence_state(self, client, pool: dict[str, Any], closed: list[int] | None = None) -> bool | None:
        """The plan fence against ``pool``'s epoch: True if it still holds it (or ``closed``, the
        epoch this object's cleanup closed that plan with), False if it moved, None if unknown (no
        fence in the INTENT, or no answer)."""
        from twophase.sinks.kafka import protocol as kp

        fence, mine = pool.get("fence"), pool.get("fence_producer")
        if not fence or mine is None:
            return None
        st = self._describe(client, [str(fence)]).get(str(fence))
        if st is None or st.error_code != kp.NONE:
            return None
        return [st.producer_id, st.producer_epoch] in (list(mine), list(closed or mine))

    def _abort_lingering_unpooled(self, batch_id: int, intent: dict[str, Any], keep: list[dict]) -> int:
        """abort_lingering for INTENTs of earlier versions: ids ``{prefix}-{partition}``, fenced.

        Fencing is an unconditional InitProducerId: the broker aborts the open transaction and
        bumps the epoch.  Safe now because no ballot planned by this version uses these ids.
        """
        from twophase.sinks.kafka import protocol as kp

        tids = list(intent.get("transactional_ids") or [])
        keep_ids = {h["transactional_id"] for h in keep}
        candidates = [t for t in tids if t not in keep_ids]
        if not candidates:
            return 0
        client = self._txn_client()
        try:
            states = client.describe_transactions(candidates)
        except Exception as e:  # e.g. a broker without DescribeTransactions: fence all
            log.debug("DescribeTransactions failed (%s); fencing all %d ids", e, len(candidates))
            states = {}
        to_fence = []
        for t in candidates:
            st = states.get(t)
            if st is None:
                to_fence.append(t)  # unknown answer: fencing an idle id is harmless
            elif st.error_code == kp.TRANSACTIONAL_ID_NOT_FOUND:
                continue
            elif st.error_code == kp.NONE and st.state not in ("Ongoing", "PrepareAbort", "PrepareEpochFence"):
                continue
            else:
                to_fence.append(t)
        aborted = 0
        for t in to_fence:
            was_open = states.get(t) is None or states[t].state != "Empty"
            self._fence(client, t, batch_id)
            aborted += 1 if was_open else 0
        return aborted

    def _fence(self, client, tid: str, batch_id: int) -> None:
        from twophase.sinks.kafka import protocol as kp

        deadline = time.monotonic() + max(60.0, 2 * self.request_timeout_s)
        delay = 0.02
        while True:
            code, pid, epoch = client.init_producer_id(tid, self.transaction_timeout_ms)
            if code == kp.NONE:
                log.info("batch %d: fenced transactional id %s (now producer id %d epoch %d)",
                         batch_id, tid, pid, epoch)
                return
            if code not in kp.RETRIABLE or time.monotonic() > deadline:
                raise TwoPhaseError(
                    f"batch {batch_id}: cannot fence transactional id {tid} (to abort what a crashed "
                    f"attempt left open): {kp.error_name(code)}. Check the broker and the ACLs for "
                    "transactional ids with this prefix, then restart the query.")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
