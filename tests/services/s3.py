"""S3: moto's standalone server (``moto[server]``, Flask/werkzeug) on 127.0.0.1:15000.

State is in memory: a restart starts with an empty store (``after_ready`` recreates
the test bucket).  Credentials are moto's usual dummies.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

from tests.services import Service, ServiceError, popen

HOST = "127.0.0.1"
PORT = 15000
ENDPOINT = f"http://{HOST}:{PORT}"
BUCKET = "twophase-test"
KEY = "testing"
SECRET = "testing"
REGION = "us-east-1"


def pip_command() -> list[str]:
    """The pip call that adds moto's server to this interpreter's environment.

    boto3 is pinned to the installed botocore (pinned in turn by aiobotocore, from
    s3fs) so pip neither upgrades botocore nor backtracks through boto3 releases.
    """
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "moto[server]"]
    try:
        cmd.append(f"boto3=={importlib.metadata.version('botocore')}")
    except importlib.metadata.PackageNotFoundError:
        cmd.append("boto3")
    return cmd


def storage_options(info: dict[str, Any]) -> dict[str, Any]:
    """s3fs / fsspec ``storage_options`` for the server described by ``info``."""
    return {
        "key": info["key"],
        "secret": info["secret"],
        "client_kwargs": {"endpoint_url": info["endpoint_url"], "region_name": info["region"]},
    }


def ensure_bucket(info: dict[str, Any]) -> None:
    """Create the test bucket of the server described by ``info`` unless it exists (moto, MinIO)."""
    s3 = client(info)
    try:
        s3.create_bucket(Bucket=info["bucket"])
    except (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        pass
    s3.head_bucket(Bucket=info["bucket"])


def client(info: dict[str, Any] | None = None, **kwargs):
    """A boto3 S3 client for the server (``info`` defaults to this module's constants);
    ``kwargs`` go to ``boto3.client`` (e.g. ``config=botocore.config.Config(...)``)."""
    import boto3

    info = info or SERVICE.info()
    return boto3.client(
        "s3", endpoint_url=info["endpoint_url"], region_name=info["region"],
        aws_access_key_id=info["key"], aws_secret_access_key=info["secret"], **kwargs,
    )


class S3Service(Service):
    name = "s3"
    start_timeout = 60.0

    def install(self) -> None:
        needed = ("moto", "flask", "flask_cors", "boto3")
        if all(importlib.util.find_spec(m) is not None for m in needed):
            return
        cmd = pip_command()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-30:])
            raise ServiceError(f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{tail}")
        importlib.invalidate_caches()

    def launch(self, log):
        return popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(PORT)], log,
                     env={"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                          "AWS_DEFAULT_REGION": REGION},
                     cwd=self.dir)

    def ready(self) -> bool:
        """An unsigned ListBuckets answers with moto's S3 XML (not just an open port)."""
        try:
            with urllib.request.urlopen(f"{ENDPOINT}/", timeout=2) as r:
                return r.status == 200 and b"ListAllMyBucketsResult" in r.read()
        except (OSError, urllib.error.URLError):
            return False

    def after_ready(self) -> None:
        ensure_bucket(self.info())

    def info(self) -> dict[str, Any]:
        return {"endpoint_url": ENDPOINT, "bucket": BUCKET, "key": KEY, "secret": SECRET, "region": REGION}


SERVICE = S3Service()
