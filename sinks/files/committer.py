"""Driver: FileSink's handles and their fate: commit (idempotent, file by file), the verdicts after
a restart, the check before a decision that every staged file is still there, and the sweeps of
staging (``abort_lingering``: this batch's other ballots, and late attempts of settled batches)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twophase.errors import HandleError, TwoPhaseError
from twophase.sink import CommitOutcome, CommitResult
from twophase.sinks.files.base import _FileSinkBase

if TYPE_CHECKING:
    from twophase.evidence import Settled


class _Committer(_FileSinkBase):
    """Driver: FileSink's handles, commit, recovery, ``verify_prepared`` and ``abort_lingering``."""

    # ---------------------------------------------------------------- handles
    def _entries(self, handle: dict) -> list[dict[str, Any]]:
        fs = handle.get("fs", "local")
        if fs != self.fs:
            raise HandleError(
                f"handle is for a {fs} FileSink but this sink writes to {self.fs} ({self.url}); "
                "recover with the sink configuration the batch was written with"
            )
        entries = list(handle["files"]) if "files" in handle else [handle]
        for e in entries:
            if not isinstance(e, dict):
                raise HandleError(f"a files handle entry is not an object: {str(e)[:80]!r}")
            self._backend.check_entry(e)
        return entries

    def encode_handle(self, handle: dict) -> dict[str, Any]:
        from twophase import handles as _handles

        version = 1 if "files" not in handle else 2
        return _handles.encode(self.kind, version, self.handle_to_json(handle))

    def handle_from_json(self, data: dict[str, Any], version: int) -> dict:
        if version == 1 and not {"staging", "final", "size"} <= data.keys():
            raise HandleError(f"files handle v1 needs staging, final and size: {sorted(data)}")
        if version == 2 and not isinstance(data.get("files"), list):
            raise HandleError("files handle v2 needs a 'files' list")
        return data

    # ---------------------------------------------------------------- driver
    def commit(self, handle: dict) -> CommitResult:
        """Make every file of the handle visible; idempotent, file by file (driver)."""
        return _combine([self._backend.commit_file(e) for e in self._entries(handle)])

    def recover_and_commit(self, handle: dict) -> CommitResult:
        """After a restart: on S3, a file whose object is already there is not completed again."""
        return _combine([self._backend.recover_file(e) for e in self._entries(handle)])

    def verify_prepared(
        self, batch_id: int, handles: list[dict], *, prepare_started_at: float
    ) -> None:
        """Before the decision: every staged file of the batch is still there with the size its
        handle records (S3: every upload is still open), else TwoPhaseError naming what is
        missing, so that the batch fails undecided and its replay writes it again rather than
        being decided and lost.  One listing per staging folder (S3: one ListMultipartUploads
        per batch), not a request per file."""
        entries = [e for h in handles for e in self._entries(h)]
        if not entries:
            return
        problems = self._backend.verify_files(entries)
        if problems:
            shown = "; ".join(problems[:5])
            if len(problems) > 5:
                shown += f"; and {len(problems) - 5} more"
            raise TwoPhaseError(
                f"batch {batch_id}: not deciding the batch: {len(problems)} of its "
                f"{len(entries)} pre-committed files are no longer staged ({shown}). Something "
                "removed them after the tasks pre-committed them (a cleanup of the staging "
                "folder, a bucket lifecycle rule aborting incomplete multipart uploads, another "
                "pipeline's sweep); the batch fails undecided and its replay writes it again."
            )

    def recover_and_abort(self, handle: dict) -> None:
        for e in self._entries(handle):
            self._backend.abort_entry(e)

    def abort_lingering(
        self, query_name: str, batch_id: int, intent: dict[str, Any], keep: list[dict], *,
        settled: Settled | None = None,
    ) -> int:
        """Abort what attempts of ``batch_id`` left under this INTENT, except ``keep``, and what
        late task attempts left for this query's *other* batches that the log says are finished
        (``settled``: a COMMITTED record, or a pruned range; local/HDFS: their staging folders;
        S3: their open uploads, found by the same one listing): no ballot of such a batch is
        decided again, so what is still staged under its name is nobody's decision to commit.

        Never by batch-id order (docs/design.md, "What may justify a destructive action"): batch
        jobs pick their ids, and a backfill of batch 5 may be staging while a run of batch 11
        cleans up (issue 59).  ``settled=None`` (no log at hand: a user's call, the CLI's
        ``abort-lingering``): only this batch's ballot is cleaned up."""
        kept = [e for h in keep for e in self._entries(h)]
        return self._backend.abort_lingering(
            query_name, batch_id, intent, kept, self._batch_names(batch_id, query_name, intent),
            earlier=self._query_names(query_name), settled=settled,
        )

    def describe_handle(self, handle: dict) -> str:
        try:
            entries = self._entries(handle)
        except (HandleError, KeyError):
            return super().describe_handle(handle)
        if len(entries) == 1 and "files" not in handle:
            e = entries[0]
            return f"file {e.get('final')} (staged {e.get('staging')}, {e.get('size')} bytes)"
        first = self._backend.describe(entries[0]) if entries else "no files"
        return first if len(entries) == 1 else f"{len(entries)} {self.fs} files, first {first}"


def _combine(results: list[CommitResult]) -> CommitResult:
    """One outcome for a handle's files: the first not-done outcome, else committed/already."""
    for r in results:
        if not r.done:
            return r
    if all(r.outcome is CommitOutcome.ALREADY_COMMITTED for r in results):
        # keep what each file's decision rested on (e.g. "decided by size only")
        return CommitResult.already_committed("; ".join(r.reason for r in results if r.reason))
    return CommitResult.committed()
