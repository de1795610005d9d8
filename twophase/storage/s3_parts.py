"""FileSink's part files on S3: one multipart upload per part file, completed by the commit.

:class:`S3PartFiles` opens, finishes, commits (``CompleteMultipartUpload`` with
``If-None-Match: *``), recovers and aborts FileSink's part files on S3, over the primitives of
:class:`~twophase.storage.s3_storage.S3Storage`, and decides by looking what a completion it
did not see succeed left behind.
"""

from __future__ import annotations

import logging
import posixpath
import time
from typing import Any

from twophase.errors import ConfigurationError, HandleError, TwoPhaseError
from twophase.sink import CommitResult
from twophase.storage.parts import TAMPERED, PartFiles
from twophase.storage.s3_client import BotoCoreError, ClientError, _no_answer, s3_error, s3_status
from twophase.storage.s3_storage import S3Storage, multipart_etag

log = logging.getLogger("twophase.storage.s3")

#: CompleteMultipartUpload tries per commit of a file: one that got no answer is sent again (and
#: one answered with a server error while the upload is still open), after COMPLETE_BACKOFF
#: seconds, doubled each time.  The coordinator's own retries (with backoff) come on top.
COMPLETE_TRIES = 3
COMPLETE_BACKOFF = 0.5


# ------------------------------------------------------------ FileSink's part files
class S3PartFiles(PartFiles):
    """S3: one multipart upload per part file, held open (invisible) until commit completes it.

    The upload goes straight to the final key: an open upload is invisible, so no
    staging copy or server-side rename is needed.  Completion carries
    ``If-None-Match: *`` so an existing foreign object is never overwritten; :meth:`check`
    proves at ``open()`` that the endpoint honours it (``s3_if_none_match``) and that its
    ETags follow the MD5 rule the "already committed" check relies on (``s3_etags``).
    """

    fs = "s3"

    def __init__(self, storage: Any, part_size: int, etags: str, if_none_match: str):
        super().__init__(storage)
        self.bucket: str = storage.bucket
        self.part_size = part_size
        self.etags = etags
        self.if_none_match = if_none_match

    @classmethod
    def from_url(
        cls, url, storage_options, *, part_size=8 << 20, etags="md5", if_none_match="require", **_
    ):
        return cls(S3Storage(url, storage_options), part_size, etags, if_none_match)

    def spark_metadata(self) -> bool:
        return bool(self.storage.list_names(self.storage.prefix + "_spark_metadata/"))

    def check(self) -> None:
        st = self.storage
        where = f"s3://{self.bucket}/{self.root}"
        st.check_bucket("FileSink")
        # One probe upload, with the configured extra parameters: proves we may write, that
        # completion honours If-None-Match, and what shape the endpoint's ETags have.
        probe = st.probe_multipart("FileSink")
        if not probe.conditional_complete:
            if self.if_none_match == "require":
                raise ConfigurationError(
                    f"FileSink target {where}: this S3 endpoint ignores If-None-Match on "
                    "CompleteMultipartUpload (a probe upload replaced an existing object), so a "
                    "commit could overwrite an object that is not this sink's. Use an endpoint "
                    "with conditional writes (AWS S3, MinIO), or opt in to FileSink(..., "
                    "s3_if_none_match='head-check'): each commit then checks the key with HEAD "
                    "first and refuses an existing object, but an object written between that "
                    "HEAD and the completion is overwritten."
                )
            log.warning(
                "%s ignores If-None-Match on CompleteMultipartUpload; "
                "s3_if_none_match='head-check': commits check the key with HEAD first (an object written in between is "
                "overwritten)",
                where,
            )
        if not probe.md5_etags and self.etags == "md5":
            raise ConfigurationError(
                f"FileSink target {where}: this S3 endpoint's multipart ETags do not follow the "
                f"MD5 rule (probe object {probe.etag or 'without ETag'}, rule "
                f"{probe.expected_etag or 'n/a'}; e.g. SSE-C, some S3-compatible stores), so after "
                "a crash FileSink could not recognise its own objects by ETag. Pass FileSink(..., "
                "s3_etags='opaque') to decide by size and by the upload being gone instead (then "
                "an object of the same size written by someone else after an abort would be "
                "taken for this sink's)."
            )

    def batch_staging(self, query_name, batch_id):
        return ""

    def open_file(self, ctx, final, index):
        self.check_intent(ctx.intent, ctx.batch_id)
        return None, self.storage.hold(final, self.part_size)

    def finish_file(self, f):
        size = f.stream.finish()
        up = f.stream
        return {
            "bucket": self.bucket,
            "key": f.final,
            "upload_id": up.upload_id,
            "parts": up.parts,
            "size": size,
            "etag": multipart_etag([p["etag"] for p in up.parts]),
        }

    def abort_file(self, f):
        f.stream.cancel()

    # paths read back from the log
    def check_entry(self, entry):
        where = f"s3://{self.bucket}/{self.storage.prefix}"
        if entry.get("bucket") != self.bucket:
            raise HandleError(
                f"a files handle names bucket {entry.get('bucket')!r}, but this sink writes to "
                f"{where}. {TAMPERED}"
            )
        key = entry.get("key")
        prefix = self.storage.prefix
        rel = (
            key[len(prefix) :].split("/")
            if isinstance(key, str) and key.startswith(prefix)
            else None
        )
        if (
            rel is None
            or any(not seg or seg in (".", "..") or seg.startswith((".", "_")) for seg in rel)
            or not all("=" in seg for seg in rel[:-1])
        ):
            raise HandleError(
                f"a files handle names key {key!r}, which is not under {where} as a part file "
                f"(<prefix>[col=value/...]<name>, no '..'). {TAMPERED}"
            )
        if not isinstance(entry.get("upload_id"), str) or not entry["upload_id"]:
            raise HandleError(f"a files handle for {where}{rel[-1]} has no upload id. {TAMPERED}")

    def check_intent(self, intent, batch_id):
        record = f"the INTENT of batch {batch_id}"
        if intent.get("bucket", self.bucket) != self.bucket:
            raise HandleError(
                f"{record} names bucket {intent.get('bucket')!r}, but this sink writes to "
                f"s3://{self.bucket}/{self.storage.prefix}. {TAMPERED}"
            )
        if intent.get("prefix", self.storage.prefix) != self.storage.prefix:
            raise HandleError(
                f"{record} names key prefix {intent.get('prefix')!r}, which is not this sink's "
                f"({self.storage.prefix!r} in s3://{self.bucket}). {TAMPERED}"
            )

    # commit
    def _already(self, entry: dict[str, Any], head: dict[str, Any] | None) -> CommitResult | None:
        """ALREADY_COMMITTED when the object at the key is this upload's, else None."""
        if head is None:
            return None
        if self.etags == "md5":
            # The ETag S3 gives the completed object is predicted in the handle: only that is ours.
            expected = entry.get("etag")
            return (
                CommitResult.already_committed()
                if expected and head.get("ETag") == expected
                else None
            )
        # s3_etags='opaque' (ETags say nothing): Flink S3Committer's size rule, and only once our
        # upload is gone: while it is open, whatever object is at the key cannot be its result.
        if int(head.get("ContentLength", -1)) != int(entry["size"]):
            return None
        if self.storage.upload_alive(entry["key"], entry["upload_id"]):
            return None
        return CommitResult.already_committed(
            f"s3://{self.bucket}/{entry['key']}: decided by size only (s3_etags='opaque'): the "
            f"object has the expected {entry['size']} bytes and upload "
            f"{str(entry['upload_id'])[:16]}… no longer exists"
        )

    def _foreign(self, entry: dict[str, Any], head: dict[str, Any]) -> str:
        hint = (
            ""
            if entry.get("etag") or self.etags != "md5"
            else "; this handle has no expected ETag (the store's part ETags are not MD5s): "
            "see FileSink's s3_etags='opaque'"
        )
        return (
            f"{head.get('ContentLength')} bytes, ETag {head.get('ETag')}; "
            f"expected {entry['size']} bytes, ETag {entry.get('etag') or 'unknown'}{hint}"
        )

    def _resolve(
        self, entry: dict[str, Any], head: dict[str, Any] | None
    ) -> CommitResult | None:
        """What a completion this call did not see succeed left, ``head`` being the key's HEAD
        taken after it: ALREADY_COMMITTED (the object is this upload's), LOST, or None when the
        upload is still open and the key free, so completing it again may still work.  Raises
        when another object holds the key while our upload is open (nothing is lost: kept)."""
        res = self._already(entry, head)
        if res is not None:
            return res
        bucket, key, up = self.bucket, entry["key"], entry["upload_id"]
        if not self.storage.upload_alive(key, up):
            # Gone: completed or aborted.  A completion still running when ``head`` was taken (S3
            # assembles a large object for minutes; a timed-out request goes on without its
            # client) may have finished since: only the upload gone *and* no object of ours at
            # the key, looked at after, is a loss.
            head = self.storage.head(key)
            res = self._already(entry, head)
            if res is not None:
                return res
            if head is not None:
                return CommitResult.lost(
                    f"upload {up} of s3://{bucket}/{key} no longer exists and the object "
                    f"there is not its result ({self._foreign(entry, head)})"
                )
            return CommitResult.lost(
                f"upload {up} of s3://{bucket}/{key} no longer exists (aborted, or expired "
                "by a bucket lifecycle rule) and the object is absent"
            )
        if head is not None:
            raise TwoPhaseError(
                f"cannot commit s3://{bucket}/{key}: an object with that key already exists "
                f"and is not this upload's ({self._foreign(entry, head)}). Move it aside and "
                "restart; the upload is kept open."
            )
        return None

    def _not_completed(
        self, entry: dict[str, Any], head: dict[str, Any] | None, why: str
    ) -> CommitResult:
        """The outcome when this call did not complete the upload: as :meth:`_resolve`, and
        RETRY_LATER while the upload is open and the key free."""
        return self._resolve(entry, head) or CommitResult.retry_later(
            f"CompleteMultipartUpload of s3://{self.bucket}/{entry['key']} failed: {why}"
        )

    def commit_file(self, entry):
        """Complete the upload; idempotent.  A completion that gets no answer (the read timeout
        fired while S3 still assembles a large object, a reset connection) is sent again, as is
        one answered with a server error while the upload is still open: completing an upload
        that exists is idempotent.  Any other outcome is decided by looking: an object at the key
        with this upload's multipart ETag is ours (already committed), the upload gone and no
        such object is a loss, another object while the upload is open is an error."""
        key, up = entry["key"], entry["upload_id"]
        if self.if_none_match == "head-check":
            # The endpoint ignores If-None-Match (proved at open()): look before completing.  An
            # object written between this HEAD and the completion is overwritten (documented race).
            head = self.storage.head(key)
            if head is not None:
                return self._not_completed(entry, head, "the key is taken")
        why = ""
        for attempt in range(1, COMPLETE_TRIES + 1):
            try:
                self.storage.complete(key, up, entry["parts"])
                return CommitResult.committed()
            except (ClientError, BotoCoreError) as e:
                why = s3_error(e)
                no_answer = _no_answer(e)
                server_error = (s3_status(e) or 0) >= 500
            last = attempt == COMPLETE_TRIES
            delay = COMPLETE_BACKOFF * 2 ** (attempt - 1)
            if no_answer and not last:
                # S3 may have completed it, be assembling it, or never have seen the request:
                # completing again is safe, and its answer (or the HEAD after) tells which.
                log.warning(
                    "CompleteMultipartUpload of s3://%s/%s got no answer (%s); sending it again "
                    "(%d/%d) in %.1fs", self.bucket, key, why, attempt + 1, COMPLETE_TRIES, delay,
                )
                time.sleep(delay)
                continue
            # An answer (NoSuchUpload after an earlier completion, 412, moto's 500 for an unknown
            # upload id) or, on the last try, still none: did an earlier call (or a completion
            # that outlived its client) complete it, is it gone, or is the key someone else's?
            res = self._resolve(entry, self.storage.head(key))
            if res is not None:
                return res
            if (no_answer or server_error) and not last:
                log.warning(
                    "CompleteMultipartUpload of s3://%s/%s failed (%s) and the upload is still "
                    "open; trying again (%d/%d) in %.1fs", self.bucket, key, why, attempt + 1,
                    COMPLETE_TRIES, delay,
                )
                time.sleep(delay)
                continue
            break
        return CommitResult.retry_later(
            f"CompleteMultipartUpload of s3://{self.bucket}/{key} failed: {why}; the upload is "
            "still open"
        )

    def recover_file(self, entry):
        """After a restart: a file whose object is already there is not completed again."""
        return self._already(entry, self.storage.head(entry["key"])) or self.commit_file(entry)

    def abort_entry(self, entry):
        self.storage.abort(entry["key"], entry["upload_id"])

    def _lists_uploads_by_prefix(self) -> bool:
        return self.storage.lists_uploads_by_prefix()

    def _list_uploads(self, prefix: str | None) -> list[dict[str, Any]]:
        return self.storage._list_uploads(prefix)

    def abort_lingering(self, query_name, batch_id, intent, keep, names, *, earlier=None, settled=None):
        """One ListMultipartUploads (paged) under the prefix (MinIO: the bucket's, filtered),
        whatever the number of other batches: this batch's uploads under this INTENT, and this
        query's uploads of other batches the log says are finished (``settled``: late task
        attempts'), except ``keep``.  Never by batch-id order (a backfill of an older id may hold
        its open uploads now); ``settled=None``: no other batch's upload is touched."""
        self.check_intent(intent, batch_id)
        prefix = self.storage.prefix
        keep_ids = {e["upload_id"] for e in keep}
        n, late = 0, []
        for u in self.storage.open_uploads(prefix):
            rel = u["Key"][len(prefix) :]
            segs = rel.split("/")
            # Only this query's (pipeline's, generation's) part files: <k=v/>*<a name ``names``
            # matches> (this batch, this INTENT; rule: the ballot being cleaned up is closed, or
            # committed with ``keep``), or one ``earlier`` matches for another batch the log says
            # is finished, any ballot (rule: a COMMITTED record or a pruned range: no ballot of it
            # is decided again, so an upload still open is a late attempt's).  Never a batch the log
            # says nothing of (a backfill's, by any id), other pipelines' uploads or foreign keys.
            if not all("=" in seg for seg in segs[:-1]) or u["UploadId"] in keep_ids:
                continue
            if not names.fullmatch(segs[-1]):
                m = earlier.fullmatch(segs[-1]) if earlier is not None else None
                if m is None or settled is None or int(m.group(1)) == int(batch_id) \
                        or not settled(query_name, int(m.group(1))):
                    continue
                late.append(u["Key"])
            self.storage.abort(u["Key"], u["UploadId"])
            n += 1
        if late:
            log.warning(
                "batch %d: aborted %d uploads of other, finished batches of %s, opened late "
                "(after their batch's cleanup): %s", batch_id, len(late), query_name,
                ", ".join(late[:5]) + (", ..." if len(late) > 5 else ""),
            )
        return n

    def verify_files(self, entries):
        """Every entry's upload still open: one ListMultipartUploads (paged) under the keys'
        common prefix (on an endpoint that lists only by whole key, as MinIO does, the bucket's
        uploads, filtered).  An open upload keeps the parts the handle lists (only a holder of
        its id can replace one, and completion checks their ETags), so its size is not asked."""
        keys = [e["key"] for e in entries]
        common = posixpath.commonprefix(keys)
        alive = {(u["Key"], u["UploadId"]) for u in self.storage.open_uploads(common)}
        return [
            f"upload {str(e['upload_id'])[:16]}… of s3://{self.bucket}/{e['key']} is gone "
            "(aborted, or expired by a bucket lifecycle rule)"
            for e in entries
            if (e["key"], e["upload_id"]) not in alive
        ]

    def describe(self, entry):
        return (
            f"s3 object s3://{entry.get('bucket')}/{entry.get('key')} "
            f"(upload {str(entry.get('upload_id'))[:16]}…, "
            f"{len(entry.get('parts', []))} parts, {entry.get('size')} bytes)"
        )
