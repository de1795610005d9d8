"""Smoke tests proving the HDFS minicluster and the S3 (moto) server are real servers.

They also pin down the exact behaviour the file sinks rely on (DESIGN.md §3 Files):
HDFS rename onto an existing target fails without touching the target; an S3
multipart upload started in one process can be completed from another with only
the upload id and part ETags, and re-completing it succeeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

pytestmark = pytest.mark.services

MIB = 1 << 20


# ---------------------------------------------------------------------------- HDFS
@pytest.fixture(scope="module")
def hdfs_client(hdfs_service):
    from hdfs import InsecureClient

    return InsecureClient(hdfs_service["webhdfs_url"], user=hdfs_service["user"])


@pytest.fixture
def hdfs_dir(hdfs_client):
    d = f"/twophase-smoke/{uuid.uuid4().hex}"
    hdfs_client.makedirs(d)
    yield d
    hdfs_client.delete(d, recursive=True)


@pytest.mark.hdfs
def test_hdfs_is_a_real_namenode(hdfs_service):
    import requests

    base = hdfs_service["webhdfs_url"]
    assert hdfs_service["namenode"] == "hdfs://127.0.0.1:18020"
    beans = requests.get(f"{base}/jmx", params={"qry": "Hadoop:service=NameNode,name=NameNodeInfo"},
                         timeout=10).json()["beans"]
    assert beans and beans[0]["Safemode"] == ""
    assert beans[0]["Version"].startswith("3.")
    live = json.loads(beans[0]["LiveNodes"])
    assert len(live) == 1
    # The DataNode advertises loopback, so WebHDFS redirects land on 127.0.0.1.
    (dn,) = live.values()
    assert dn["xferaddr"].startswith("127.0.0.1:")


@pytest.mark.hdfs
def test_hdfs_write_read_rename(hdfs_client, hdfs_dir):
    data = os.urandom(256 * 1024) + b"tail"
    src, dst = f"{hdfs_dir}/part-0.tmp", f"{hdfs_dir}/part-0.parquet"
    hdfs_client.write(src, data)
    with hdfs_client.read(src) as r:
        assert r.read() == data
    assert hdfs_client.status(src)["length"] == len(data)

    hdfs_client.rename(src, dst)
    assert hdfs_client.status(src, strict=False) is None
    assert hdfs_client.status(dst)["length"] == len(data)
    with hdfs_client.read(dst) as r:
        assert hashlib.sha256(r.read()).digest() == hashlib.sha256(data).digest()
    assert sorted(hdfs_client.list(hdfs_dir)) == ["part-0.parquet"]


@pytest.mark.hdfs
def test_hdfs_rename_onto_existing_target_fails_and_keeps_target(hdfs_service, hdfs_client, hdfs_dir):
    import requests
    from hdfs import HdfsError

    src, dst = f"{hdfs_dir}/staged", f"{hdfs_dir}/final"
    hdfs_client.write(src, b"new contents")
    hdfs_client.write(dst, b"old")

    # The hdfs package turns WebHDFS's {"boolean": false} into HdfsError.
    with pytest.raises(HdfsError, match="Unable to rename"):
        hdfs_client.rename(src, dst)
    # Over raw WebHDFS: HTTP 200 with {"boolean": false}; no exception, no overwrite.
    r = requests.put(f"{hdfs_service['webhdfs_url']}/webhdfs/v1{src}",
                     params={"op": "RENAME", "destination": dst, "user.name": hdfs_service["user"]},
                     timeout=10)
    assert r.status_code == 200
    assert r.json() == {"boolean": False}

    with hdfs_client.read(dst) as f:
        assert f.read() == b"old"
    with hdfs_client.read(src) as f:
        assert f.read() == b"new contents"
    assert sorted(hdfs_client.list(hdfs_dir)) == ["final", "staged"]


# ------------------------------------------------------------------------------ S3
@pytest.fixture(scope="module")
def s3(s3_service):
    from tests.services.s3 import client

    return client(s3_service)


def _payload(n: int, seed: bytes) -> bytes:
    """Deterministic bytes so the child and the test can build the same content."""
    out = bytearray()
    block = hashlib.sha256(seed).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 128
    return bytes(out[:n])


CHILD = textwrap.dedent("""
    import json, sys
    from tests.services.s3 import client
    from tests.test_services_hdfs_s3 import _payload, MIB
    info = json.loads(sys.argv[1])
    s3 = client(info)
    key, seed = info["object_key"], info["seed"].encode()
    data = _payload(5 * MIB + 1234, seed)
    up = s3.create_multipart_upload(Bucket=info["bucket"], Key=key)["UploadId"]
    parts = []
    for n, chunk in enumerate((data[:5 * MIB], data[5 * MIB:]), start=1):
        r = s3.upload_part(Bucket=info["bucket"], Key=key, UploadId=up, PartNumber=n, Body=chunk)
        parts.append({"PartNumber": n, "ETag": r["ETag"]})
    print(json.dumps({"upload_id": up, "parts": parts}))
    # exit without completing: the upload stays open on the server
""")


@pytest.mark.s3
def test_s3_is_a_real_endpoint(s3_service, s3):
    """Written through twophase's own S3 storage (botocore), read back with boto3."""
    from twophase.storage.s3 import S3Storage

    assert s3_service["bucket"] in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    key = f"smoke/{uuid.uuid4().hex}.txt"
    store = S3Storage(f"s3://{s3_service['bucket']}", {"key": s3_service["key"], "secret": s3_service["secret"],
                                                       "endpoint_url": s3_service["endpoint_url"],
                                                       "region_name": s3_service["region"]})
    store.put(key, b"via twophase.storage")
    assert s3.get_object(Bucket=s3_service["bucket"], Key=key)["Body"].read() == b"via twophase.storage"
    s3.delete_object(Bucket=s3_service["bucket"], Key=key)
    assert store.head(key) is None


@pytest.mark.s3
def test_s3_multipart_completed_from_another_process(s3_service, s3):
    bucket = s3_service["bucket"]
    key = f"smoke/{uuid.uuid4().hex}.bin"
    seed = uuid.uuid4().hex
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(dict(s3_service, object_key=key, seed=seed))],
        capture_output=True, text=True, timeout=60, cwd=repo,
    )
    assert child.returncode == 0, child.stderr
    handle = json.loads(child.stdout.strip().splitlines()[-1])
    parts = handle["parts"]
    assert [p["PartNumber"] for p in parts] == [1, 2]

    # Pre-committed: upload open, object invisible.
    open_ids = [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])]
    assert open_ids == [handle["upload_id"]]
    assert s3.list_objects_v2(Bucket=bucket, Prefix=key)["KeyCount"] == 0

    # Commit from this process with only the saved handle.
    first = s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=handle["upload_id"],
                                         MultipartUpload={"Parts": parts})
    assert first["ETag"].endswith('-2"')
    expected = _payload(5 * MIB + 1234, seed.encode())
    head = s3.head_object(Bucket=bucket, Key=key)
    assert head["ContentLength"] == len(expected)
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == expected

    # Completing again (a replayed commit): moto, like AWS, answers success with the same ETag;
    # MinIO answers NoSuchUpload (why FileSink's commit HEADs the object after any failure).
    if s3_service.get("server") == "minio":
        with pytest.raises(s3.exceptions.NoSuchUpload):
            s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=handle["upload_id"],
                                         MultipartUpload={"Parts": parts})
    else:
        second = s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=handle["upload_id"],
                                              MultipartUpload={"Parts": parts})
        assert second["ResponseMetadata"]["HTTPStatusCode"] == 200
        assert second["ETag"] == first["ETag"]
    head2 = s3.head_object(Bucket=bucket, Key=key)
    assert (head2["ContentLength"], head2["ETag"]) == (len(expected), first["ETag"])

    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []) == []
    s3.delete_object(Bucket=bucket, Key=key)


@pytest.mark.s3
def test_s3_complete_unknown_upload_is_an_error(s3_service):
    """An aborted (or never existing) upload id cannot be completed and creates nothing.

    AWS answers NoSuchUpload; moto 5.2.x answers HTTP 500 (KeyError in its backend),
    so recovery code must treat *any* error here as "HEAD the object and compare size".
    """
    from botocore.config import Config
    from botocore.exceptions import ClientError

    from tests.services.s3 import client

    # botocore retries HTTP 500 by default; one attempt keeps this fast.
    s3 = client(s3_service, config=Config(retries={"max_attempts": 1, "mode": "standard"}))
    bucket, key = s3_service["bucket"], f"smoke/{uuid.uuid4().hex}.bin"
    up = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * 10)["ETag"]
    s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=up)
    with pytest.raises(ClientError) as ei:
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up,
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert ei.value.response["Error"]["Code"] in ("NoSuchUpload", "500", "InternalError")
    assert s3.list_objects_v2(Bucket=bucket, Prefix=key)["KeyCount"] == 0
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []) == []
