"""FileSink trusts nothing it did not check: paths from the log, S3 objects at its keys, what an
endpoint honours, the storage options it is given, the packages installed (issues 14 and 19).

Every test talks to the real servers (WebHDFS minicluster, moto and MinIO), except the
missing-package ones, which hide a package from a fresh interpreter.
"""

# ruff: noqa: F811 - the fixtures hdfs, hroot, s3, sroot and s3env come from test_files_remote
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import pytest

from tests.test_files_remote import (  # noqa: F401 - hdfs, hroot, s3, s3env, sroot are fixtures
    _StripConditionsProxy,
    batch,
    hdfs,
    hopts,
    hroot,
    prepare,
    roundtrip,
    s3,
    s3env,
    sopen,
    sroot,
    svisible,
)
from twophase import CommitOutcome, TransactionContext
from twophase.errors import ConfigurationError, HandleError, LogError, TwoPhaseError
from twophase.log import TransactionLog
from twophase.sinks.files import FileSink

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_visible(root) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not str(p.relative_to(root)).startswith(("_", "."))
    )


# ============================================================ 10. paths from the log
def test_local_commit_refuses_a_handle_whose_paths_leave_the_sink(tmp_path):
    out = tmp_path / "out"
    sink = FileSink(str(out))
    sink.open()
    h = prepare(sink, 1, 0, [1, 2, 3])
    precious = tmp_path / "elsewhere" / "precious.txt"
    precious.parent.mkdir()
    precious.write_text("not FileSink's")
    forged = [
        dict(h, staging=str(precious), size=precious.stat().st_size),  # any file
        dict(
            h, staging=str(out / "_twophase" / ".." / ".." / "elsewhere" / "precious.txt")
        ),  # '..'
        dict(
            h, final=str(tmp_path / "elsewhere" / "part-00000001-00000.parquet")
        ),  # target outside
        dict(
            h, final=str(out / "_twophase" / "q" / "part-00000001-00000.parquet")
        ),  # target in staging
        dict(h, staging=str(out / "part-00000009-00000.parquet")),  # staged outside _twophase
    ]
    for bad in forged:
        with pytest.raises(HandleError, match="not under"):
            sink.commit(bad)
        with pytest.raises(HandleError):
            sink.recover_and_commit(bad)
        with pytest.raises(HandleError):
            sink.recover_and_abort(bad)
    assert precious.read_text() == "not FileSink's"
    assert not (tmp_path / "elsewhere" / "part-00000001-00000.parquet").exists()
    assert local_visible(out) == []
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED  # the genuine handle still commits
    assert local_visible(out) == ["part-00000001-00000-q.parquet"]


def test_local_abort_lingering_refuses_an_intent_naming_another_folder(tmp_path):
    out = tmp_path / "out"
    sink = FileSink(str(out))
    sink.open()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep-me.txt").write_text("x")
    intent4 = sink.plan_batch("q", 4, 1)  # one execution (ballot) of batch 4
    later = prepare(sink, 4, 0, [7], intent=intent4)  # batch 4's staged file, pre-committed
    for intent in (
        {"staging": str(precious)},
        {"staging": str(out / "_twophase")},  # every query's staging
        {"staging": str(out / "_twophase" / "q" / "b00000004")},  # another batch's folder
        {"staging": intent4["staging"]},  # another batch's ballot folder (where `later` is staged)
        {"staging": str(out / "_twophase" / "q" / "b00000003" / ".." / "b00000004")},
        {"staging": str(out / "_twophase" / "q" / "b00000003.abcdef" / ".." / os.path.basename(intent4["staging"]))},
    ):
        with pytest.raises(HandleError, match="INTENT of batch 3"):
            sink.abort_lingering("q", 3, intent, [])
    assert (precious / "keep-me.txt").read_text() == "x"
    assert os.path.exists(later["staging"])
    # A kept handle outside the sink is refused too, and the right intent still works.
    with pytest.raises(HandleError):
        sink.abort_lingering("q", 4, intent4, [dict(later, staging=str(precious))])
    assert os.path.exists(later["staging"])
    assert sink.abort_lingering("q", 4, intent4, []) == 1
    assert not os.path.exists(later["staging"])


@pytest.mark.hdfs
def test_hdfs_abort_lingering_refuses_an_intent_naming_another_folder(hdfs_service, hdfs, hroot):
    url, path = hroot
    sink = FileSink(f"{url}/out", storage_options=hopts(hdfs_service))
    sink.open()
    hdfs.write(f"{path}/precious/deep/data.bin", b"not FileSink's")
    for staging in (
        f"{path}/precious",
        f"{path}/out/_twophase",
        f"{path}/out/_twophase/q/../../../precious",
    ):
        with pytest.raises(HandleError, match="INTENT of batch 3"):
            sink.abort_lingering("q", 3, {"staging": staging, "fs": "hdfs"}, [])
    assert hdfs.status(f"{path}/precious/deep/data.bin")["length"] == len(b"not FileSink's")


@pytest.mark.hdfs
def test_hdfs_commit_refuses_a_handle_whose_paths_leave_the_sink(hdfs_service, hdfs, hroot):
    url, path = hroot
    sink = FileSink(f"{url}/out", storage_options=hopts(hdfs_service))
    sink.open()
    h = roundtrip(sink, prepare(sink, 1, 0, [1, 2, 3]))
    hdfs.write(f"{path}/precious.bin", b"abc")
    e = h["files"][0]
    for bad in (
        dict(e, staging=f"{path}/precious.bin", size=3),
        dict(e, final=f"{path}/stolen.parquet"),
        dict(e, final=f"{path}/out/_twophase/q/x.parquet"),
        dict(e, staging=f"{path}/out/x/../../precious.bin"),
    ):
        forged = dict(h, files=[bad])
        with pytest.raises(HandleError, match="not under"):
            sink.commit(forged)
        with pytest.raises(HandleError):
            sink.recover_and_abort(forged)
    assert hdfs.status(f"{path}/precious.bin")["length"] == 3
    assert hdfs.status(f"{path}/stolen.parquet", strict=False) is None
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED


@pytest.mark.s3
def test_s3_abort_lingering_and_commit_refuse_keys_outside_the_sink(s3_service, s3, sroot, s3env):
    url, prefix = sroot
    bucket = s3_service["bucket"]
    sink = FileSink(f"{url}/data", storage_options=s3env)
    # Another writer's upload under a sibling prefix, named like one of our part files.
    foreign_key = f"{prefix}/foreign/part-00000009-00000.parquet"
    foreign = s3.create_multipart_upload(Bucket=bucket, Key=foreign_key)["UploadId"]
    etag = s3.upload_part(
        Bucket=bucket, Key=foreign_key, UploadId=foreign, PartNumber=1, Body=b"theirs"
    )["ETag"]
    for intent in (
        {"fs": "s3", "bucket": bucket, "prefix": f"{prefix}/foreign/", "names": "part-00000009-"},
        {"fs": "s3", "bucket": bucket, "prefix": "", "names": "part-00000009-"},
        {
            "fs": "s3",
            "bucket": "another-bucket",
            "prefix": f"{prefix}/data/",
            "names": "part-00000009-",
        },
    ):
        with pytest.raises(HandleError, match="INTENT of batch 9"):
            sink.abort_lingering("q", 9, intent, [])
    assert (foreign_key, foreign) in sopen(s3, bucket, prefix)
    h = prepare(sink, 9, 0, [1, 2])
    e = h["files"][0]
    for bad in (
        dict(e, key=foreign_key, upload_id=foreign, parts=[{"n": 1, "etag": etag}], size=6),
        dict(e, key=f"{prefix}/data/../foreign/part-00000009-00000.parquet"),
        dict(e, bucket="another-bucket"),
    ):
        with pytest.raises(HandleError, match="not under|bucket"):
            sink.commit(dict(h, files=[bad]))
    assert svisible(s3, bucket, prefix) == []  # the foreign upload was never completed
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED


# ========================================================= 9. "already committed" on S3
@pytest.mark.s3
def test_s3_foreign_object_of_the_same_size_is_not_taken_for_our_commit(
    s3_service, s3, sroot, s3env
):
    url, prefix = sroot
    bucket = s3_service["bucket"]
    sink = FileSink(url, storage_options=s3env)
    h = roundtrip(sink, prepare(sink, 0, 0, list(range(20))))
    e = h["files"][0]
    s3.put_object(
        Bucket=bucket, Key=e["key"], Body=b"z" * e["size"]
    )  # same size, plain (non-multipart) ETag
    with pytest.raises(TwoPhaseError, match="not this upload's"):
        sink.commit(h)
    with pytest.raises(TwoPhaseError, match="not this upload's"):
        sink.recover_and_commit(h)
    assert sopen(s3, bucket, prefix) == [
        (e["key"], e["upload_id"])
    ]  # our upload is kept, nothing lost
    assert s3.get_object(Bucket=bucket, Key=e["key"])["Body"].read() == b"z" * e["size"]


@pytest.mark.s3
def test_s3_size_only_check_is_an_explicit_option_and_says_so(s3_service, s3, sroot, s3env):
    url, _ = sroot
    bucket = s3_service["bucket"]
    sink = FileSink(url, storage_options=s3env, s3_etags="opaque")
    assert (
        FileSink.from_config(json.loads(json.dumps(sink.to_config()))).to_config()["s3_etags"]
        == "opaque"
    )
    h = prepare(sink, 1, 0, [1, 2, 3])
    e = h["files"][0]
    s3.complete_multipart_upload(
        Bucket=bucket,
        Key=e["key"],
        UploadId=e["upload_id"],  # a crash after this
        MultipartUpload={"Parts": [{"PartNumber": p["n"], "ETag": p["etag"]} for p in e["parts"]]},
    )
    res = sink.recover_and_commit(h)
    assert res.outcome is CommitOutcome.ALREADY_COMMITTED
    assert "size" in res.reason and "s3_etags='opaque'" in res.reason
    # An object of our size while our upload is still open cannot be ours, whatever the ETags.
    h2 = prepare(sink, 1, 1, [4, 5, 6])
    e2 = h2["files"][0]
    s3.put_object(Bucket=bucket, Key=e2["key"], Body=b"z" * e2["size"])
    with pytest.raises(TwoPhaseError, match="not this upload's"):
        sink.commit(h2)
    with pytest.raises(ConfigurationError, match="s3_etags"):
        FileSink(url, storage_options=s3env, s3_etags="sizes")


# ============================================== 11. conditional completion on the data bucket
@pytest.fixture
def stripping_endpoint(s3_service):
    """moto behind a proxy that drops If-None-Match (a store without conditional writes)."""
    if s3_service.get("server") == "minio":
        pytest.skip(
            "the proxy that strips If-None-Match breaks the SigV4 signature, which MinIO "
            "checks and moto does not; the detection under test does not depend on the endpoint"
        )
    proxy = _StripConditionsProxy(s3_service["endpoint_url"])
    t = threading.Thread(target=proxy.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}"
    proxy.shutdown()


@pytest.mark.s3
def test_s3_sink_refuses_a_data_bucket_that_ignores_if_none_match(
    s3_service, s3, sroot, s3env, stripping_endpoint
):
    url, prefix = sroot
    bucket = s3_service["bucket"]
    opts = dict(s3env, endpoint_url=stripping_endpoint)
    with pytest.raises(ConfigurationError, match="If-None-Match.*s3_if_none_match='head-check'"):
        FileSink(url, storage_options=opts).open()
    assert (
        s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["KeyCount"] == 0
    )  # the probe left nothing
    assert sopen(s3, bucket, prefix) == []
    # Opted in: HEAD before completing keeps an existing object (the race is documented).
    sink = FileSink(url, storage_options=opts, s3_if_none_match="head-check")
    sink.open()
    intent = sink.plan_batch("q", 0, 2)  # one execution (ballot) of batch 0: both tasks below
    h = prepare(sink, 0, 0, [1, 2], intent=intent)
    e = h["files"][0]
    s3.put_object(Bucket=bucket, Key=e["key"], Body=b"someone else's data")
    with pytest.raises(TwoPhaseError, match="already exists"):
        sink.commit(h)
    assert s3.get_object(Bucket=bucket, Key=e["key"])["Body"].read() == b"someone else's data"
    h2 = prepare(sink, 0, 1, [3, 4], intent=intent)
    assert sink.commit(h2).outcome is CommitOutcome.COMMITTED
    assert sink.commit(h2).done  # a replay finds its own object
    assert svisible(s3, bucket, prefix) == [
        f"part-00000000-00000-q-{intent['ballot']}.parquet",
        f"part-00000000-00001-q-{intent['ballot']}.parquet",
    ]


# =========================================================== 12. storage options
@pytest.mark.s3
def test_s3_server_side_encryption_from_s3_additional_kwargs_is_applied_or_refused(
    s3_service, s3, sroot, s3env
):
    url, prefix = sroot
    bucket = s3_service["bucket"]
    opts = dict(
        s3env,
        s3_additional_kwargs={
            "ServerSideEncryption": "AES256",
            "Metadata": {"written-by": "twophase-test"},
        },
    )
    sink = FileSink(url, storage_options=opts)
    if (
        s3_service.get("server") == "minio"
    ):  # MinIO without a KMS refuses SSE-S3: so must we, before writing
        with pytest.raises(ConfigurationError, match="NotImplemented"):
            sink.open()
        assert sopen(s3, bucket, prefix) == []
        return
    sink.open()
    h = prepare(sink, 0, 0, [1, 2, 3])
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    head = s3.head_object(Bucket=bucket, Key=h["files"][0]["key"])
    assert head["ServerSideEncryption"] == "AES256"
    assert head["Metadata"] == {"written-by": "twophase-test"}
    # The transaction log on S3 takes the same options (its records are PutObjects).
    tlog = TransactionLog(f"{url}/log", storage_options=opts)
    assert (
        s3.head_object(Bucket=bucket, Key=f"{prefix}/log/log.json")["ServerSideEncryption"]
        == "AES256"
    )
    assert tlog.store.read("log.json")


@pytest.mark.s3
def test_s3_metadata_from_s3_additional_kwargs_reaches_the_object(s3_service, s3, sroot, s3env):
    url, _ = sroot
    sink = FileSink(
        url, storage_options=dict(s3env, s3_additional_kwargs={"Metadata": {"team": "etl"}})
    )
    sink.open()
    h = prepare(sink, 0, 0, [1])
    assert sink.commit(h).done
    assert s3.head_object(Bucket=s3_service["bucket"], Key=h["files"][0]["key"])["Metadata"] == {
        "team": "etl"
    }


@pytest.mark.s3
@pytest.mark.hdfs
def test_unknown_storage_options_are_refused_naming_the_accepted_ones(
    s3_service, sroot, s3env, hdfs_service, hroot, tmp_path
):
    url, _ = sroot
    cases = [
        (
            dict(s3env, s3_aditional_kwargs={"ServerSideEncryption": "aws:kms"}),
            "'s3_aditional_kwargs'",
        ),
        (
            dict(s3env, s3_additional_kwargs={"ServerSideEncrpytion": "aws:kms"}),
            "'ServerSideEncrpytion'",
        ),
        (dict(s3env, client_kwargs={"endpoint": "http://x"}), "'endpoint'"),
        (dict(s3env, config_kwargs={"retires": 3}), "'retires'"),
        (dict(s3env, default_block_size=8 << 20), "part_size"),
    ]
    for opts, named in cases:
        with pytest.raises(ConfigurationError, match=named):
            FileSink(url, storage_options=opts)
        with pytest.raises(ConfigurationError, match=named):
            TransactionLog(f"{url}/log", storage_options=opts)
    hurl, _ = hroot
    with pytest.raises(ConfigurationError, match="'kerberos'.*webhdfs_url"):
        FileSink(hurl, storage_options=dict(hopts(hdfs_service), kerberos=True))
    with pytest.raises(ConfigurationError, match="'kerberos'"):
        TransactionLog(f"{hurl}/log", storage_options=dict(hopts(hdfs_service), kerberos=True))
    with pytest.raises(ConfigurationError, match="local path .* takes no storage options"):
        FileSink(str(tmp_path / "out"), storage_options={"key": "x"})


@pytest.mark.s3
def test_s3_options_with_s3fs_names_reach_the_client(s3_service, s3, sroot, s3env, monkeypatch):
    """client_kwargs, use_ssl, requester_pays and secrets in client_kwargs, as s3fs takes them."""
    url, _ = sroot
    monkeypatch.setenv("TP_TEST_S3_KEY2", s3_service["key"])
    opts = {
        "secret": {"env": "TP_TEST_S3_SECRET"},
        "requester_pays": True,
        "use_ssl": False,
        "client_kwargs": {
            "endpoint_url": s3_service["endpoint_url"],
            "region_name": s3_service["region"],
            "aws_access_key_id": {"env": "TP_TEST_S3_KEY2"},
        },
        "config_kwargs": {"connect_timeout": 5},
    }
    sink = FileSink(url, storage_options=opts)
    sink.open()
    h = prepare(sink, 0, 0, [1, 2])
    assert sink.commit(h).done
    assert "testing" not in json.dumps(sink.to_config()).replace("twophase-test", "")
    sent = []

    def record(params, **kw):
        sent.append(dict(params.get("headers", {})))

    client = sink._backend.storage.client
    client.meta.events.register("before-call.s3.CreateMultipartUpload", record)
    try:
        prepare(sink, 0, 1, [3])
    finally:
        client.meta.events.unregister("before-call.s3.CreateMultipartUpload", record)
    assert sent and sent[-1].get("x-amz-request-payer") == "requester"
    with pytest.raises(ConfigurationError, match="'aws_secret_access_key' is given by value"):
        FileSink(
            url,
            storage_options=dict(
                opts, client_kwargs=dict(opts["client_kwargs"], aws_secret_access_key="x")
            ),
        ).to_config()


# ====================================================== 19. WebHDFS address, missing packages
@pytest.mark.hdfs
def test_hdfs_unreachable_webhdfs_is_named_with_where_its_address_came_from(
    hdfs_service, hdfs, hroot
):
    # The namenode's RPC address, as Spark users write it; WebHDFS is derived as port 9870, where
    # nothing listens here (the test NameNode serves HTTP on another port).
    rpc = hdfs_service["namenode"]
    assert rpc.endswith(":18020")
    want = r"WebHDFS at http://127\.0\.0\.1:9870 \(derived from .*18020.*webhdfs_url"
    with pytest.raises(LogError, match=want):
        TransactionLog(f"{rpc}/twophase-test/{uuid.uuid4().hex}/log")
    sink = FileSink(f"{rpc}/twophase-test/x")
    with pytest.raises(ConfigurationError, match=want):
        sink.open()
    url, _ = hroot
    good = FileSink(url, storage_options=hopts(hdfs_service))
    h = prepare(good, 0, 0, [1, 2])
    lost_way = FileSink(url)  # the same directory without webhdfs_url
    with pytest.raises(TwoPhaseError, match=want):
        lost_way.commit(h)
    # On an executor: the staged file cannot be created, which begin_transaction reports.
    with pytest.raises(TwoPhaseError, match=want):
        lost_way.begin_transaction(TransactionContext("q", 1, 0, 0, lost_way.plan_batch("q", 1, 1)))
    assert good.commit(h).outcome is CommitOutcome.COMMITTED


HIDE = """
import sys
sys.modules[{module!r}] = None  # as if the package were not installed
from twophase.errors import MissingDependencyError
try:
    {code}
except MissingDependencyError as e:
    print("MissingDependencyError:", e)
except BaseException as e:
    print(type(e).__name__ + ":", e)
"""


@pytest.mark.parametrize(
    "module,code,extra",
    [
        (
            "botocore",
            "from twophase.sinks.files import FileSink; FileSink('s3://bucket/out').open()",
            "s3",
        ),
        (
            "botocore",
            "from twophase.log import TransactionLog; TransactionLog('s3://bucket/log')",
            "s3",
        ),
        (
            "hdfs",
            "from twophase.sinks.files import FileSink; FileSink('hdfs://nn:8020/out').open()",
            "hdfs",
        ),
        (
            "hdfs",
            "from twophase.log import TransactionLog; TransactionLog('hdfs://nn:8020/log')",
            "hdfs",
        ),
    ],
)
def test_a_missing_storage_package_names_the_extra_that_installs_it(module, code, extra):
    r = subprocess.run(
        [sys.executable, "-c", HIDE.format(module=module, code=code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MissingDependencyError:"), r.stdout
    assert f"pip install 'twophase[{extra}]'" in r.stdout


def test_the_s3_extra_installs_what_the_code_imports():
    import ast
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(r.startswith("botocore") for r in extras["s3"]) and not any(
        "s3fs" in r for r in extras["s3"]
    )
    imported = set()
    for folder in ("twophase", "sinks", "coordinator"):
        for dirpath, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        tree = ast.parse(f.read())
                    for node in ast.walk(tree):
                        if isinstance(node, ast.Import):
                            imported |= {a.name.split(".")[0] for a in node.names}
                        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                            imported.add(node.module.split(".")[0])
    assert "s3fs" not in imported
