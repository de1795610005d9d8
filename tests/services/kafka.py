"""Apache Kafka 4.x, KRaft single node (combined broker + controller) from Maven Central jars.

Jars: ``org.apache.kafka:kafka_2.13`` + runtime deps + a log4j2 SLF4J binding, resolved
with :mod:`tests.services.maven` into ``JAR_CACHE/kafka-<ver>/``.  The storage is
formatted once with ``kafka.tools.StorageTool format --standalone`` (dynamic quorum,
KIP-853) and the broker runs as ``java -cp ... kafka.Kafka server.properties``.

Also :func:`spark_kafka_jars` — the jars Spark's Kafka source needs on top of pyspark.
"""

from __future__ import annotations

import base64
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

from tests.services import (
    JAR_CACHE,
    Service,
    ServiceError,
    ensure_python_packages,
    pid_alive,
    popen,
    port_open,
)
from tests.services.maven import resolve

KAFKA_VERSION = "4.1.2"
SCALA = "2.13"
LOG4J_VERSION = "2.25.3"  # the log4j-core version kafka 4.1.2 itself depends on
PORT = 19092
CONTROLLER_PORT = 19093
SASL_PORT = 19094  # SASL_PLAINTEXT: SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER (unsecured JWTs)
SSL_PORT = 19095   # SSL with client certificates required (mutual TLS)
BOOTSTRAP = f"127.0.0.1:{PORT}"
NODE_ID = 1
#: A SCRAM user of the test broker (both mechanisms); a test server's credential, on loopback only.
SCRAM_USER, SCRAM_PASSWORD = "twophase-scram", "twophase-scram-secret"

COORDS = [
    f"org.apache.kafka:kafka_{SCALA}:{KAFKA_VERSION}",
    # Kafka 4.1 is built against slf4j-api 1.7.x: the matching log4j2 binding is log4j-slf4j-impl.
    f"org.apache.logging.log4j:log4j-slf4j-impl:{LOG4J_VERSION}",
    f"org.apache.logging.log4j:log4j-core:{LOG4J_VERSION}",
]

JVM_OPTS = [
    "-Xms256m", "-Xmx768m",
    "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
    "-Djava.awt.headless=true",
    "-Djava.net.preferIPv4Stack=true",
]

LOG4J2_XML = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="stdout" target="SYSTEM_OUT">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Logger name="kafka" level="INFO"/>
    <Logger name="org.apache.kafka" level="INFO"/>
    <Logger name="kafka.log.LogCleaner" level="WARN"/>
    <Logger name="state.change.logger" level="WARN"/>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="org.apache.kafka.storage.internals.log" level="WARN"/>
    <Root level="INFO">
      <AppenderRef ref="stdout"/>
    </Root>
  </Loggers>
</Configuration>
"""


def _cluster_id() -> str:
    # Kafka's Uuid string form: url-safe base64 of 16 bytes, no padding, not starting with '-'.
    while True:
        s = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not s.startswith("-"):
            return s


class KafkaService(Service):
    name = "kafka"
    start_timeout = 120.0
    _proc: subprocess.Popen | None = None
    #: The address the broker listens on and advertises.
    host = "127.0.0.1"
    #: The SASL (SCRAM, OAUTHBEARER) and mutual-TLS listeners too (the security tests' broker).
    secured = True

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{PORT}"

    def command(self, argv: list[str]) -> list[str]:
        """How the broker's commands are run (a subclass runs them on a test host)."""
        return argv

    # -- layout ---------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def config_path(self) -> Path:
        return self.dir / "server.properties"

    @property
    def log4j_path(self) -> Path:
        return self.dir / "log4j2.xml"

    @property
    def tls_dir(self) -> Path:
        return self.dir / "tls"

    def jars(self) -> list[Path]:
        return resolve(COORDS, f"kafka-{KAFKA_VERSION}")

    def _listeners(self) -> str:
        h = self.host
        out = f"PLAINTEXT://{h}:{PORT},CONTROLLER://{h}:{CONTROLLER_PORT}"
        return out + (f",SASL_PLAINTEXT://{h}:{SASL_PORT},SSL://{h}:{SSL_PORT}" if self.secured else "")

    def server_properties(self) -> str:
        props = {
            "process.roles": "broker,controller",
            "node.id": NODE_ID,
            "controller.quorum.bootstrap.servers": f"{self.host}:{CONTROLLER_PORT}",
            "listeners": self._listeners(),
            "advertised.listeners": self._listeners(),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": ("CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,"
                                               "SASL_PLAINTEXT:SASL_PLAINTEXT,SSL:SSL"),
            # Clients' security setups (issue 19): SCRAM and OAUTHBEARER on one SASL listener
            # (OAUTHBEARER with Kafka's default validator of unsecured JWTs, no identity
            # provider needed), mutual TLS on the SSL listener.
            "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512,OAUTHBEARER",
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.sasl_plaintext.oauthbearer.sasl.jaas.config":
                "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required "
                'unsecuredLoginStringClaim_sub="broker";',
            "listener.name.ssl.ssl.keystore.type": "PEM",
            "listener.name.ssl.ssl.keystore.location": str(self.tls_dir / "broker.pem"),
            "listener.name.ssl.ssl.truststore.type": "PEM",
            "listener.name.ssl.ssl.truststore.location": str(self.tls_dir / "ca.pem"),
            "listener.name.ssl.ssl.client.auth": "required",
            "log.dirs": str(self.data_dir),
            "num.partitions": 1,
            "default.replication.factor": 1,
            "min.insync.replicas": 1,
            "offsets.topic.replication.factor": 1,
            "offsets.topic.num.partitions": 10,
            "transaction.state.log.replication.factor": 1,
            "transaction.state.log.min.isr": 1,
            "transaction.state.log.num.partitions": 10,
            "transaction.max.timeout.ms": 900000,
            "share.coordinator.state.topic.replication.factor": 1,
            "share.coordinator.state.topic.min.isr": 1,
            "group.initial.rebalance.delay.ms": 0,
            "auto.create.topics.enable": "true",
            "delete.topic.enable": "true",
            # The data folder outlives runs (~/.cache): topics of tests and benchmarks (one
            # 200,000-row benchmark run writes about 0.7 GB) must not pile up until the disk is
            # full (46 GB were found in one day at 24 hours).  No test reads a topic two hours
            # after writing it; closed segments of 128 MiB go at the next check (every minute).
            "log.retention.minutes": 120,
            "log.retention.bytes": 1 << 30,
            "log.segment.bytes": 128 << 20,
            "log.retention.check.interval.ms": 60000,
        }
        if not self.secured:
            props = {k: v for k, v in props.items() if not k.startswith(("sasl.", "listener.name."))}
        return "".join(f"{k}={v}\n" for k, v in props.items())

    # -- Service API --------------------------------------------------------------
    #: Python packages this module needs besides the jars: the broker's TLS certificates (make_tls)
    #: and the readiness probe's admin client.
    PYTHON_NEEDS = {"cryptography": "cryptography>=42", "confluent_kafka": "confluent-kafka>=2.16.1,<2.17"}

    def install(self) -> None:
        ensure_python_packages(self.name, self.PYTHON_NEEDS)
        self.jars()

    def _java(self, main: str, args: list[str], jars: list[Path]) -> list[str]:
        return [
            "java", *JVM_OPTS,
            f"-Dlog4j2.configurationFile={self.log4j_path}",
            f"-Dkafka.logs.dir={self.dir}",
            "-cp", ":".join(str(j) for j in jars),
            main, *args,
        ]

    def _our_pid_running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return b"kafka.Kafka" in cmd and pid_alive(pid)

    def launch(self, log) -> subprocess.Popen | None:
        if self._our_pid_running():
            return None  # already starting (not ready yet): wait for it, never start a second broker
        if any(port_open(p, self.host) for p in (PORT, CONTROLLER_PORT, SASL_PORT, SSL_PORT)):
            raise ServiceError(
                f"ports {PORT}/{CONTROLLER_PORT}/{SASL_PORT}/{SSL_PORT} on {self.host} are taken by a "
                "process this module did not start "
                f"(no live pid in {self.pid_path}); stop it first"
            )
        jars = self.jars()
        if self.secured:
            make_tls(self.tls_dir)
        self.log4j_path.write_text(LOG4J2_XML)
        self.config_path.write_text(self.server_properties())
        if not (self.data_dir / "meta.properties").exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            cmd = self.command(self._java("kafka.tools.StorageTool", [
                "format", "--standalone", "--ignore-formatted",
                "-t", _cluster_id(), "-c", str(self.config_path),
            ], jars))
            r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
            log.write(f"$ java ... StorageTool format\n{r.stdout}{r.stderr}\n".encode())
            log.flush()
            if r.returncode != 0:
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
                raise ServiceError(f"kafka StorageTool format failed (exit {r.returncode}):\n{tail}")
        self._proc = popen(self.command(self._java("kafka.Kafka", [str(self.config_path)], jars)), log,
                           cwd=self.dir)
        return self._proc

    def ready(self) -> bool:
        if not port_open(PORT, self.host):
            return False
        try:
            from confluent_kafka.admin import AdminClient

            admin = AdminClient({"bootstrap.servers": self.bootstrap, "socket.timeout.ms": 2000, "log_level": 0})
            md = admin.list_topics(timeout=3)
            return len(md.brokers) >= 1 and md.controller_id is not None and md.controller_id >= 0
        except Exception:
            return False

    def after_ready(self) -> None:
        """The SCRAM user, for both mechanisms: each credential made once.  Not an upsert every
        time: a test session's fixture (each pytest-xdist worker's, each child pytest's) calls this,
        and a credential written anew (a new salt) under a client's SCRAM exchange fails its login."""
        if not self.secured:
            return
        from confluent_kafka.admin import (
            AdminClient,
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialUpsertion,
        )

        admin = AdminClient({"bootstrap.servers": BOOTSTRAP, "log_level": 0})
        have = set()
        try:
            for fut in admin.describe_user_scram_credentials([SCRAM_USER]).values():
                have.update(info.mechanism for info in fut.result(30).scram_credential_infos)
        except Exception:  # the user has no credential yet (RESOURCE_NOT_FOUND)
            have = set()
        for m in (ScramMechanism.SCRAM_SHA_256, ScramMechanism.SCRAM_SHA_512):  # one per request
            if m in have:
                continue
            up = UserScramCredentialUpsertion(SCRAM_USER, ScramCredentialInfo(m, 4096), SCRAM_PASSWORD.encode())
            for fut in admin.alter_user_scram_credentials([up]).values():
                fut.result(30)

    def info(self) -> dict[str, Any]:
        return {"bootstrap_servers": BOOTSTRAP,
                "sasl_bootstrap_servers": f"127.0.0.1:{SASL_PORT}",
                "ssl_bootstrap_servers": f"127.0.0.1:{SSL_PORT}",
                "scram_user": SCRAM_USER, "scram_password": SCRAM_PASSWORD,
                "tls": {"ca": str(self.tls_dir / "ca.pem"), "cert": str(self.tls_dir / "client.pem"),
                        "key": str(self.tls_dir / "client.key")}}


SERVICE = KafkaService()


def read_committed(bootstrap: str, topic: str, timeout: float = 10.0, idle: float = 2.0,
                   part: str = "value") -> list[bytes]:
    """Every record's ``part`` ("value" or "key") a read_committed consumer sees in ``topic``, from
    the start, until ``idle`` s pass without records (or ``timeout`` s in all): the examples'
    reader, with the tests' shorter waits."""
    from examples.wordcount_jdbc import read_topic

    return read_topic(bootstrap, topic, idle=idle, timeout=timeout, part=part)


def make_tls(folder: Path) -> None:
    """A test CA, the broker's PEM keystore (key + certificate for 127.0.0.1/localhost) and a
    client certificate and key, all signed by that CA; made once per service directory."""
    if (folder / "client.key").exists():
        return
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, usage=None) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=3650))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def pem_cert(c: x509.Certificate) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("twophase test CA", ca_key, "twophase test CA", ca_key, ca=True)
    broker_key = ec.generate_private_key(ec.SECP256R1())
    broker = cert("127.0.0.1", broker_key, "twophase test CA", ca_key, ca=False,
                  usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = cert("twophase-client", client_key, "twophase test CA", ca_key, ca=False,
                  usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    (folder / "ca.pem").write_bytes(pem_cert(ca))
    (folder / "broker.pem").write_bytes(pem_key(broker_key) + pem_cert(broker) + pem_cert(ca))
    (folder / "client.pem").write_bytes(pem_cert(client))
    (folder / "client.key").write_bytes(pem_key(client_key))
    for f in ("broker.pem", "client.key"):
        (folder / f).chmod(0o600)


# -- Spark's Kafka source --------------------------------------------------------------

_VERSION_TAIL = re.compile(r"^\d+(\.\d+)+")


def jar_artifact(filename: str) -> str:
    """``artifactId`` of a ``<artifactId>-<version>[-<classifier>].jar`` file name.

    The version starts at the last ``-<digits>.<digits>`` boundary, so names like
    ``spark-token-provider-kafka-0-10_2.13-4.3.0.jar`` and ``log4j-1.2-api-2.24.3.jar``
    come out right.
    """
    stem = filename[:-4] if filename.endswith(".jar") else filename
    parts = stem.split("-")
    for i in range(len(parts) - 1, 0, -1):
        if _VERSION_TAIL.match(parts[i]):
            return "-".join(parts[:i])
    return stem


def pyspark_jars_dir() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "jars"


MAVEN_CENTRAL = "https://repo.maven.apache.org/maven2"


def _release_key(v: str) -> tuple[int, ...] | None:
    """Numeric key of a plain release version (``4.2.0``); None for previews, RCs, snapshots."""
    if not re.fullmatch(r"\d+(\.\d+)*", v):
        return None
    return tuple(int(x) for x in v.split("."))


def _spark_kafka_version(spark_ver: str, cache: Path) -> str:
    """Version of ``spark-sql-kafka-0-10`` to use with pyspark ``spark_ver``.

    The exact version when Maven Central has it; otherwise (pyspark sometimes reaches
    PyPI before the Maven artifacts exist) the newest plain release of the same major
    version that is not newer than pyspark.  The choice is remembered in the cache so
    later calls need no network.  ``TWOPHASE_SPARK_KAFKA_VERSION`` overrides it.
    """
    import os
    import urllib.request

    if os.environ.get("TWOPHASE_SPARK_KAFKA_VERSION"):
        return os.environ["TWOPHASE_SPARK_KAFKA_VERSION"]
    chosen = cache / ".artifact-version"
    if chosen.exists():
        return chosen.read_text().strip()
    url = f"{MAVEN_CENTRAL}/org/apache/spark/spark-sql-kafka-0-10_{SCALA}/maven-metadata.xml"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            meta = r.read().decode()
    except OSError as e:
        raise ServiceError(f"cannot read {url}: {e}") from None
    versions = re.findall(r"<version>([^<]+)</version>", meta)
    if spark_ver in versions:
        ver = spark_ver
    else:
        want = _release_key(spark_ver) or (0,)
        ok = [v for v in versions if _release_key(v) and _release_key(v)[0] == want[0] and _release_key(v) <= want]
        if not ok:
            raise ServiceError(f"no spark-sql-kafka-0-10_{SCALA} release usable with pyspark {spark_ver} in {url}")
        ver = max(ok, key=_release_key)
    cache.mkdir(parents=True, exist_ok=True)
    chosen.write_text(ver + "\n")
    return ver


def spark_kafka_jars() -> list[str]:
    """Absolute paths of ``spark-sql-kafka-0-10_2.13`` (pyspark's version, see
    :func:`_spark_kafka_version`) and the runtime deps pyspark does not already ship (any
    version of an artifact pyspark has is left out: duplicates on the classpath can break
    Spark).  Comma-join them for ``spark.jars``."""
    import pyspark

    name = f"spark-kafka-{pyspark.__version__}"
    ver = _spark_kafka_version(pyspark.__version__, JAR_CACHE / name)
    jars = resolve([f"org.apache.spark:spark-sql-kafka-0-10_{SCALA}:{ver}"], name)
    shipped = {jar_artifact(p.name) for p in pyspark_jars_dir().glob("*.jar")}
    if not shipped:
        raise ServiceError(f"no jars found in {pyspark_jars_dir()}: is pyspark installed completely?")
    out = [str(p) for p in jars if jar_artifact(p.name) not in shipped]
    if not any("spark-sql-kafka" in Path(p).name for p in out):
        raise ServiceError(f"spark-sql-kafka jar missing from {JAR_CACHE / name}")
    return out
