"""MinIO on a test host of its own (tests/services/hosts.py): ``s3`` at its address.

The same server as ``tests/services/minio.py`` (the same binary, bucket and test credentials),
started in the ``s3`` host's network and UTS namespaces, listening on that host's address only,
with its data in the host's folder: a log store or a bucket that other test hosts reach over
the bridge, and that a fault can take away from one of them (``hosts.isolate``, ``hosts.cut``).
"""

from __future__ import annotations

from tests.services import hosts
from tests.services.minio import CONSOLE_PORT, PORT, MinioService


class MinioOnHostService(hosts.OnHost, MinioService):
    name = "minio_host"
    on_host = hosts.host("s3")
    host = on_host.address
    port = PORT
    console_port = CONSOLE_PORT


SERVICE = MinioOnHostService()
