"""S3: a MinIO server on 127.0.0.1:15100, built from source with ``go install``.

moto (``tests/services/s3.py``) is a Python mock: its CompleteMultipartUpload copies
and re-hashes every byte of the object (measured: 0.4-0.5 s of server CPU per 100 MB,
whatever the part count), while S3 and MinIO assemble a multipart object from its
stored parts without copying (MinIO: about 10 ms and no measurable CPU for 100 MB).
A commit by CompleteMultipartUpload is FileSink's whole exactly-once protocol on S3,
so the benchmarks measure it against MinIO, and the S3 tests run against both.

MinIO publishes no Go-module release tags, so the build is pinned to a commit by its
Go pseudo-version (``MINIO_MODULE``).  The binary is cached outside the repository
(``~/.cache/twophase/minio/bin``); the Go module cache is Go's own.  The data
directory is emptied at each start: the server holds test data only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.services import JAR_CACHE, Service, ServiceError, popen

HOST = "127.0.0.1"
PORT = 15100
CONSOLE_PORT = 15101
ENDPOINT = f"http://{HOST}:{PORT}"
BUCKET = "twophase-test"
KEY = "twophase"
SECRET = "twophase-test-secret"  # a test server's credential, on loopback only
REGION = "us-east-1"
MINIO_MODULE = "github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
BIN_DIR = Path(os.environ.get("TWOPHASE_MINIO_BIN", JAR_CACHE.parent / "minio" / "bin"))


class MinioService(Service):
    name = "minio"
    start_timeout = 60.0
    host = HOST
    port = PORT
    console_port = CONSOLE_PORT

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, argv: list[str]) -> list[str]:
        """How the server is started (a subclass runs it on a test host)."""
        return argv

    @property
    def binary(self) -> Path:
        return BIN_DIR / "minio"

    def install(self) -> None:
        if self.binary.exists():
            return
        go = shutil.which("go")
        if go is None:
            raise ServiceError("the MinIO test server is built from source and needs Go (`go` on PATH); "
                               "install Go >= 1.24")
        BIN_DIR.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, GOBIN=str(BIN_DIR), CGO_ENABLED="0")
        cmd = [go, "install", MINIO_MODULE]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0 or not self.binary.exists():
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-30:])
            raise ServiceError(f"`{' '.join(cmd)}` failed (exit {r.returncode}):\n{tail}")

    def launch(self, log):
        data = self.dir / "data"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        return popen(self.command([str(self.binary), "server", str(data), "--address", f"{self.host}:{self.port}",
                                   "--console-address", f"{self.host}:{self.console_port}", "--quiet"]), log,
                     env={"MINIO_ROOT_USER": KEY, "MINIO_ROOT_PASSWORD": SECRET,
                          "MINIO_BROWSER": "off", "MINIO_UPDATE": "off"},
                     cwd=self.dir)

    def ready(self) -> bool:
        """MinIO's readiness probe answers 200 once the server takes requests."""
        try:
            with urllib.request.urlopen(f"{self.endpoint}/minio/health/ready", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def after_ready(self) -> None:
        from tests.services.s3 import ensure_bucket

        ensure_bucket(self.info())

    def info(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "bucket": BUCKET, "key": KEY, "secret": SECRET, "region": REGION,
                "server": "minio"}


SERVICE = MinioService()
