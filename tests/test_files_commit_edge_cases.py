"""FileSink commits that used to be lost or stall after the decision (issue 25, "Also").

1. S3: a ``CompleteMultipartUpload`` whose answer does not come back in time (S3 is still
   assembling a large object when the client's read timeout fires, or the connection is reset).
   A proxy in front of the real endpoint (moto and MinIO) holds or drops exactly that request; it
   never changes a request, so MinIO's SigV4 check still passes.
2. Local disk: a mount without hard links (vfat).  ``open()`` must refuse it before anything is
   decided, instead of every commit failing after the decision.  Tried on a real vfat image mounted
   with ``fusefat`` (FUSE; the kernel here has no vfat driver to loop-mount); skipped, saying why,
   where that is impossible.  The rename-without-replace fallback (for a filesystem that has no
   hard links but has ``renameat2(RENAME_NOREPLACE)``, e.g. the kernel's vfat) is driven on the
   test machine's own filesystem with ``os.link`` failing as vfat's does.
"""

from __future__ import annotations

import errno
import http.client
import http.server
import os
import shutil
import subprocess
import threading
import uuid
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twophase import CommitOutcome, TransactionContext
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.sinks.files import FileSink


def _batch(ids):
    return pa.RecordBatch.from_pydict({"id": ids, "v": [f"row-{i}" for i in ids]})


def _prepare(sink, batch_id, partition, ids, query="q"):
    ctx = TransactionContext(query, batch_id, partition, 0, sink.plan_batch(query, batch_id, 2))
    txn = sink.begin_transaction(ctx)
    sink.write(txn, _batch(ids))
    return sink.pre_commit(txn)


# ============================================================================== S3
class _CompletionProxy(http.server.ThreadingHTTPServer):
    """A real HTTP hop in front of an S3 endpoint that passes every request on unchanged (Host
    included: the SigV4 signature covers it) and plays one of three parts for the *first*
    CompleteMultipartUpload it sees:

    - ``"assembling"``: S3 assembles the object for longer than the client waits, through every
      completion the client sends (they join the one in progress).  Each is held, unanswered,
      until a request that is not a completion names the upload (the sink's ListParts, asking
      whether the upload still exists); only then does S3 finish — the first completion is
      passed on, then the later ones, then that request.  The held answers go to a client that
      has left.
    - ``"answer-lost"``: passed on at once (S3 completes the object), then the connection is
      closed without an answer (a reset after the server did the work).
    - ``"aborted"``: the upload is aborted behind the sink's back (a lifecycle rule) and the
      connection closed without an answer.

    ``requests`` records (method, operation) of what came through, in order.
    """

    daemon_threads = True

    def __init__(self, upstream: str, mode: str, admin=None, bucket: str = ""):
        u = urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port
        self.mode, self.admin, self.bucket = mode, admin, bucket
        self.lock = threading.Lock()
        self.held: str | None = None  # the upload id of the held completion
        self.release = threading.Event()  # set: pass the held completion on
        self.released = threading.Event()  # set: S3 answered the held completion
        self.requests: list[tuple[str, str]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _upstream(self, body):
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    return r.status, r.getheaders(), r.read()
                finally:
                    conn.close()

            def _answer(self, status, headers, data):
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                q = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
                upload = (q.get("uploadId") or [None])[0]
                complete = self.command == "POST" and upload is not None
                op = "CompleteMultipartUpload" if complete else ("ListParts" if upload and self.command == "GET"
                                                                 else self.command)
                with proxy.lock:
                    proxy.requests.append((self.command, op))
                    first = complete and proxy.held is None
                    if first:
                        proxy.held = upload
                    ours = upload is not None and upload == proxy.held
                if complete and ours and proxy.mode == "assembling" and not proxy.release.is_set():
                    proxy.release.wait(60)  # a safety cap only: the sink's ListParts releases it
                    if first:
                        try:
                            self._upstream(body)  # S3 completes the object now
                        finally:
                            proxy.released.set()
                    else:
                        proxy.released.wait(60)
                        self._upstream(body)  # a later completion, after the first finished
                    self.close_connection = True  # the client timed out and left; nobody reads this
                    return
                if first and proxy.mode == "answer-lost":
                    self._upstream(body)
                    self.close_connection = True  # completed, but the answer never reaches the client
                    return
                if first and proxy.mode == "aborted":
                    key = urlsplit(self.path).path.split("/", 2)[2]
                    proxy.admin.abort_multipart_upload(Bucket=proxy.bucket, Key=key, UploadId=upload)
                    self.close_connection = True
                    return
                if ours and not complete and proxy.mode == "assembling":
                    proxy.release.set()
                    proxy.released.wait(60)
                self._answer(*self._upstream(body))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.released.set()
        self.shutdown()
        self.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def s3(s3_service):
    from tests.services.s3 import client

    return client(s3_service)


@pytest.fixture
def sroot(s3_service, s3):
    """(url, key prefix) of a fresh S3 prefix; everything under it is removed afterwards."""
    prefix = f"twophase-test/{uuid.uuid4().hex[:10]}"
    bucket = s3_service["bucket"]
    yield f"s3://{bucket}/{prefix}", prefix
    for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        if u["Key"].startswith(prefix + "/"):
            s3.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        s3.delete_object(Bucket=bucket, Key=o["Key"])


@pytest.fixture
def s3env(s3_service, monkeypatch):
    monkeypatch.setenv("TP_TEST_S3_KEY", s3_service["key"])
    monkeypatch.setenv("TP_TEST_S3_SECRET", s3_service["secret"])
    return {"key": {"env": "TP_TEST_S3_KEY"}, "secret": {"env": "TP_TEST_S3_SECRET"},
            "endpoint_url": s3_service["endpoint_url"], "region_name": s3_service["region"]}


def _through(proxy, s3env):
    """Storage options that reach S3 through ``proxy``, with a 1 s read timeout: the client gives
    up on a held completion after 1 s (what botocore's 60 s does to a large object's)."""
    return dict(s3env, endpoint_url=proxy.endpoint,
                config_kwargs={"read_timeout": 1, "connect_timeout": 5})


def _uploads_under(s3, bucket, prefix):
    return [u for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
            if u["Key"].startswith(prefix + "/")]


@pytest.mark.s3
def test_s3_complete_that_times_out_while_s3_still_assembles_is_committed_not_lost(s3_service, s3, sroot, s3env):
    """The client's read timeout fires while S3 still assembles the object, on the first
    completion and on the ones sent again; S3 finishes between the sink's HEAD of the key and its
    ListParts.  Before the fix the sink HEADed the key (absent: still assembling), then found the
    upload gone and reported the decided file LOST: the coordinator raised DataLossError for a
    file that S3 had in fact committed."""
    url, prefix = sroot
    bucket = s3_service["bucket"]
    writer = FileSink(url, storage_options=s3env)
    h = _prepare(writer, 3, 0, list(range(100)))
    (e,) = h["files"]
    with _CompletionProxy(s3_service["endpoint_url"], "assembling") as proxy:
        sink = FileSink(url, storage_options=_through(proxy, s3env))
        res = sink.commit(h)
    assert res.done, res
    assert proxy.requests.count(("POST", "CompleteMultipartUpload")) >= 2  # held, and sent again
    head = s3.head_object(Bucket=bucket, Key=e["key"])
    assert head["ETag"] == e["etag"] and head["ContentLength"] == e["size"]
    data = s3.get_object(Bucket=bucket, Key=e["key"])["Body"].read()
    assert pq.read_table(pa.BufferReader(data)).column("id").to_pylist() == list(range(100))
    assert _uploads_under(s3, bucket, prefix) == []
    # A replay (recovery after a crash) finds it committed too.
    assert FileSink(url, storage_options=s3env).recover_and_commit(h).outcome is CommitOutcome.ALREADY_COMMITTED


@pytest.mark.s3
def test_s3_complete_whose_answer_is_lost_after_s3_completed_is_committed(s3_service, s3, sroot, s3env):
    """The connection is reset after S3 completed the object: the retried completion answers
    NoSuchUpload (moto: HTTP 500), and the object with this upload's multipart ETag is ours."""
    url, prefix = sroot
    bucket = s3_service["bucket"]
    h = _prepare(FileSink(url, storage_options=s3env), 4, 1, [7, 8, 9])
    (e,) = h["files"]
    with _CompletionProxy(s3_service["endpoint_url"], "answer-lost") as proxy:
        res = FileSink(url, storage_options=_through(proxy, s3env)).commit(h)
    assert res.done, res
    assert s3.head_object(Bucket=bucket, Key=e["key"])["ETag"] == e["etag"]
    assert _uploads_under(s3, bucket, prefix) == []


@pytest.mark.s3
def test_s3_complete_in_doubt_whose_upload_was_aborted_meanwhile_is_lost(s3_service, s3, sroot, s3env):
    """No answer, and the upload was aborted behind the sink's back: the retry answers
    NoSuchUpload and there is no object, so this one really is lost, and said to be."""
    url, prefix = sroot
    bucket = s3_service["bucket"]
    h = _prepare(FileSink(url, storage_options=s3env), 5, 0, [1, 2])
    (e,) = h["files"]
    with _CompletionProxy(s3_service["endpoint_url"], "aborted", admin=s3, bucket=bucket) as proxy:
        res = FileSink(url, storage_options=_through(proxy, s3env)).commit(h)
    assert res.outcome is CommitOutcome.LOST, res
    assert "no longer exists" in res.reason and e["key"] in res.reason
    assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount", 0) == 0


# ====================================================================== local disk
def _fusefat_mount(tmp_path):
    """A fresh 16 MiB vfat image mounted read-write with fusefat at ``tmp_path/mnt``; returns
    (mount point, unmount) or skips, saying why, where that is impossible."""
    missing = [t for t in ("mkfs.vfat", "fusefat", "fusermount") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"no vfat mount possible: {', '.join(missing)} not installed "
                    "(Debian: apt-get install -y dosfstools fusefat)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no vfat mount possible: /dev/fuse is missing (a container without FUSE)")
    img, mnt = tmp_path / "fat.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    r = subprocess.run(["mkfs.vfat", str(img)], capture_output=True, text=True, timeout=30)
    if r.returncode:
        pytest.skip(f"no vfat mount possible: mkfs.vfat failed: {r.stderr.strip()[:200]}")
    r = subprocess.run(["fusefat", "-o", "rw+", str(img), str(mnt)], capture_output=True, text=True, timeout=30)
    if r.returncode or not os.path.ismount(mnt):
        pytest.skip(f"no vfat mount possible: fusefat failed ({r.returncode}): "
                    f"{(r.stderr or r.stdout).strip()[-200:]} (needs FUSE and CAP_SYS_ADMIN)")

    def unmount():
        subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True, timeout=30)

    return str(mnt), unmount


@pytest.fixture
def vfat(tmp_path):
    mnt, unmount = _fusefat_mount(tmp_path)
    try:
        yield mnt
    finally:
        unmount()


def test_local_mount_without_hard_links_is_refused_at_open_before_anything_is_decided(vfat):
    """A real vfat filesystem: creating, writing and renaming work, hard links do not (and fusefat
    has no rename-without-replace either).  Before the fix ``open()`` passed and every commit of a
    decided batch failed with EPERM, so the query stalled for good after its first decision."""
    out = os.path.join(vfat, "out")
    sink = FileSink(out)
    with pytest.raises(ConfigurationError) as info:
        sink.open()
    msg = str(info.value)
    assert out in msg and "hard link" in msg and "Operation not permitted" in msg
    assert "filesystem" in msg and "HDFS" in msg  # what to do instead
    # The probe left nothing behind, neither in the target folder nor in its staging folder.
    assert os.listdir(out) == ["_twophase"] and os.listdir(os.path.join(out, "_twophase")) == []


def test_local_commit_on_a_mount_without_hard_links_says_why_and_keeps_the_staged_file(vfat):
    """Where open() was not called (``twophase recover`` builds the sink from its config), the
    commit fails with an error naming the file and the missing operation, not a bare EPERM, and
    the staged data stays where it is."""
    out = os.path.join(vfat, "out")
    sink = FileSink(out, fsync=False)
    h = _prepare(sink, 0, 0, [1, 2, 3])
    with pytest.raises(TwoPhaseError, match="hard link") as info:
        sink.commit(h)
    assert h["staging"] in str(info.value)
    assert os.path.exists(h["staging"]) and not os.path.exists(h["final"])


def _eperm_link(real):
    """``os.link`` as vfat answers it (EPERM) inside ``root``; elsewhere the real one."""

    def link(src, dst, *a, **kw):
        if str(dst).startswith(_eperm_link.root):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(src), None, str(dst))
        return real(src, dst, *a, **kw)

    return link


def test_local_without_hard_links_but_with_rename_noreplace_commits_by_rename(tmp_path, monkeypatch):
    """No real twin here: the kernel's vfat (no hard links, but renameat2 RENAME_NOREPLACE) cannot
    be loop-mounted in this container, so ``os.link`` fails with vfat's EPERM on the test
    machine's own filesystem, where rename-without-replace works.  open() accepts the target,
    commit publishes by that rename, a replay finds it committed, and a foreign file at the target
    is never overwritten."""
    from twophase.storage import local

    if not local.rename_noreplace_available():
        pytest.skip("renameat2(RENAME_NOREPLACE) is not available here (not Linux with glibc 2.28+)")
    out = str(tmp_path / "out")
    _eperm_link.root = out
    monkeypatch.setattr(os, "link", _eperm_link(os.link))
    sink = FileSink(out)
    sink.open()
    h = _prepare(sink, 0, 0, [1, 2, 3])
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    assert not os.path.exists(h["staging"])
    assert pq.read_table(h["final"]).column("id").to_pylist() == [1, 2, 3]
    assert sink.commit(h).outcome is CommitOutcome.ALREADY_COMMITTED
    # A foreign file at the next target: the commit stops, nothing is overwritten or moved.
    h2 = _prepare(sink, 1, 0, [4])
    with open(h2["final"], "wb") as f:
        f.write(b"not ours")
    with pytest.raises(TwoPhaseError, match="already exists"):
        sink.commit(h2)
    assert open(h2["final"], "rb").read() == b"not ours" and os.path.exists(h2["staging"])
