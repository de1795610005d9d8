"""MinIO on a test host of its own (tests/services/hosts.py): ``s3`` at its address.

The same server as ``tests/services/minio.py`` (the same binary, bucket and test credentials),
started in the ``s3`` host's network and UTS namespaces, listening on that host's address only,
with its data in the host's folder: a log store or a bucket that other test hosts reach over
the bridge, and that a fault can take away from one of them (``hosts.isolate``, ``hosts.cut``).
"""

from __future__ import annotations

from pathlib import Path

from tests.services import hosts
from tests.services.minio import CONSOLE_PORT, PORT, MinioService

HOST = hosts.host("s3")


class MinioOnHostService(MinioService):
    name = "minio_host"
    host = HOST.address
    port = PORT
    console_port = CONSOLE_PORT

    @property
    def dir(self) -> Path:
        d = HOST.folder / "minio"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def install(self) -> None:
        hosts.SERVICE.start()  # the host must exist first (idempotent)
        super().install()

    def command(self, argv: list[str]) -> list[str]:
        return hosts.command(HOST.name, argv)


SERVICE = MinioOnHostService()
