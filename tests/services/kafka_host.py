"""Apache Kafka on a test host of its own (tests/services/hosts.py): ``kafka`` at its address.

The same broker as ``tests/services/kafka.py`` (the same jars, KRaft, one node, transactions
configured alike), started in the ``kafka`` host's network and UTS namespaces, listening on and
advertising that host's address only (plain listener and controller; the SASL and TLS listeners
stay on the loopback broker), with its data in the host's folder: a target that other test
hosts reach over the bridge, and that a fault can take away from one of them.
"""

from __future__ import annotations

from typing import Any

from tests.services import hosts
from tests.services.kafka import KafkaService


class KafkaOnHostService(hosts.OnHost, KafkaService):
    name = "kafka_host"
    on_host = hosts.host("kafka")
    host = on_host.address
    secured = False

    def info(self) -> dict[str, Any]:
        return {"bootstrap_servers": self.bootstrap}


SERVICE = KafkaOnHostService()
