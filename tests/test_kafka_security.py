"""KafkaSink through the standard Kafka security setups, against the real broker's secured
listeners (tests/services/kafka.py): SASL/SCRAM-SHA-256 and -512, SASL/OAUTHBEARER (unsecured
JWTs, and OIDC client credentials from a token endpoint served here) and mutual TLS.

Each setup runs the executor path (librdkafka: begin_transaction, write, pre_commit) and the
driver path (kafka-python: the commit's EndTxn) with the same librdkafka settings, as a
pipeline does; a read_committed consumer on the plain listener then sees the rows.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
import uuid

import pyarrow as pa
import pytest

from tests.test_kafka_sink import _ctx, _topic, read_committed
from twophase.errors import TwoPhaseError
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink
from twophase.sinks.kafka import protocol as kp


def _claims(token: str) -> dict:
    body = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


# ------------------------------------------------------------------------ translation
def test_oauthbearer_settings_become_a_token_provider_of_the_same_kind():
    out = kp.kafka_python_config({
        "bootstrap.servers": "h:1", "security.protocol": "sasl_plaintext", "sasl.mechanism": "OAUTHBEARER",
        "enable.sasl.oauthbearer.unsecure.jwt": "true",
        "sasl.oauthbearer.config": "principal=etl scope=a,b lifeSeconds=60 extension_traceId=x1"})
    provider = out.pop("sasl_oauth_token_provider")
    assert out == {"bootstrap_servers": "h:1", "security_protocol": "SASL_PLAINTEXT",
                   "sasl_mechanism": "OAUTHBEARER"}
    token = provider.token()
    assert token.endswith(".") and token == provider.token()  # reused until near expiry
    claims = _claims(token)
    assert claims["sub"] == "etl" and claims["scope"] == ["a", "b"]
    assert 55 <= claims["exp"] - claims["iat"] <= 60
    assert provider.extensions() == {"traceId": "x1"}
    with pytest.raises(ValueError, match="needs sasl.oauthbearer.client.secret"):
        kp.kafka_python_config({"sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.method": "oidc",
                                "sasl.oauthbearer.client.id": "c",
                                "sasl.oauthbearer.token.endpoint.url": "http://idp/token"})
    with pytest.raises(ValueError, match="either sasl.oauthbearer.method=oidc"):
        kp.kafka_python_config({"sasl.mechanism": "OAUTHBEARER"})
    with pytest.raises(ValueError, match="sasl.oauthbearer.config given, but sasl.mechanism"):
        kp.kafka_python_config({"sasl.oauthbearer.config": "principal=x"})


def test_a_pkcs12_keystore_is_refused_with_the_conversion_to_pem():
    with pytest.raises(ValueError) as e:
        kp.kafka_python_config({"ssl.keystore.location": "/ks.p12", "ssl.keystore.password": "ks-secret"})
    assert "openssl pkcs12" in str(e.value) and "ssl.key.location" in str(e.value)
    assert "ks-secret" not in str(e.value)


# ----------------------------------------------------------------------------- broker
class _TokenEndpoint(http.server.BaseHTTPRequestHandler):
    """An OIDC token endpoint for the client-credentials grant: checks the client's Basic
    credentials and hands out an unsecured JWT (which the test broker's default validator takes)."""

    client = ("twophase-client", "oidc-client-secret")
    requests: list[str] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length", 0))
        form = self.rfile.read(length).decode()
        want = "Basic " + base64.b64encode(":".join(self.client).encode()).decode()
        if self.headers.get("Authorization") != want or "grant_type=client_credentials" not in form:
            self.send_response(401)
            self.end_headers()
            return
        type(self).requests.append(form)
        now = int(time.time())
        enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
        token = f"{enc({'alg': 'none'})}.{enc({'sub': 'oidc-user', 'iat': now, 'exp': now + 600})}."
        body = json.dumps({"access_token": token, "token_type": "bearer", "expires_in": 600}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def token_endpoint():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _TokenEndpoint.requests = []
    yield f"http://127.0.0.1:{srv.server_address[1]}/token"
    srv.shutdown()


def _setup(kind: str, info: dict, endpoint: str | None) -> tuple[str, dict]:
    """(bootstrap, librdkafka security settings) of one setup."""
    sasl = info["sasl_bootstrap_servers"]
    if kind.startswith("scram"):
        return sasl, {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": kind.upper(),
                      "sasl.username": info["scram_user"], "sasl.password": info["scram_password"]}
    if kind == "oauthbearer-unsecured":
        return sasl, {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER",
                      "enable.sasl.oauthbearer.unsecure.jwt": "true",
                      "sasl.oauthbearer.config": "principal=twophase-etl"}
    if kind == "oauthbearer-oidc":
        cid, secret = _TokenEndpoint.client
        return sasl, {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER",
                      "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.client.id": cid,
                      "sasl.oauthbearer.client.secret": secret,
                      "sasl.oauthbearer.token.endpoint.url": endpoint}
    tls = info["tls"]
    return info["ssl_bootstrap_servers"], {
        "security.protocol": "SSL", "ssl.ca.location": tls["ca"],
        "ssl.certificate.location": tls["cert"], "ssl.key.location": tls["key"]}


@pytest.mark.kafka
@pytest.mark.parametrize("kind", ["scram-sha-256", "scram-sha-512", "oauthbearer-unsecured",
                                  "oauthbearer-oidc", "mtls"])
def test_a_transaction_written_and_committed_over_a_secured_listener(kafka_service, kind, token_endpoint):
    plain = kafka_service["bootstrap_servers"]
    bootstrap, security = _setup(kind, kafka_service, token_endpoint)
    topic, prefix = _topic(plain), f"sec-{kind}-{uuid.uuid4().hex[:6]}"
    sink = KafkaSink(bootstrap, topic, prefix, producer_config=security)
    values = [f"{kind}-{i}".encode() for i in range(20)]
    try:
        sink.open()
        txn = sink.begin_transaction(_ctx(sink))  # librdkafka, as on an executor
        sink.write(txn, pa.RecordBatch.from_pydict({"value": values}))
        handle = sink.pre_commit(txn)
        assert read_committed(plain, topic, idle=1.0) == []
        assert sink.commit(handle).outcome is CommitOutcome.COMMITTED  # kafka-python, the driver's
        again = sink.commit(handle)  # idempotent (RETRY_LATER while the coordinator completes it)
        deadline = time.time() + 30
        while again.outcome is CommitOutcome.RETRY_LATER and time.time() < deadline:
            time.sleep(0.2)
            again = sink.commit(handle)
        assert again.outcome in (CommitOutcome.COMMITTED, CommitOutcome.ALREADY_COMMITTED), again
    finally:
        sink.close()
    assert sorted(read_committed(plain, topic, idle=1.0)) == sorted(values)
    if kind == "oauthbearer-oidc":
        assert _TokenEndpoint.requests, "the token endpoint was never asked"


@pytest.mark.kafka
def test_a_wrong_scram_password_is_a_clear_error_without_the_password(kafka_service):
    info = kafka_service
    topic = _topic(info["bootstrap_servers"])
    wrong = f"wrong-{uuid.uuid4().hex}"
    sink = KafkaSink(info["sasl_bootstrap_servers"], topic, f"sec-bad-{uuid.uuid4().hex[:6]}",
                     producer_config={"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
                                      "sasl.username": info["scram_user"], "sasl.password": wrong},
                     request_timeout_s=10)
    try:
        with pytest.raises(TwoPhaseError) as e:
            sink.open()
            sink._txn_client().describe_transactions([sink.transactional_id(0)])
        assert wrong not in str(e.value)
        assert "127.0.0.1:19094" in str(e.value), str(e.value)
    finally:
        sink.close()


# ------------------------------------------------------- Spark's Java settings (format("twophase-kafka"))
def test_spark_kafka_java_security_options_become_librdkafka_settings_and_the_unreadable_are_refused():
    from twophase.errors import ConfigurationError
    from twophase.sinks.spark_kafka import java_security_to_librdkafka as translate

    secret = f"s-{uuid.uuid4().hex}"
    jaas = ('org.apache.kafka.common.security.scram.ScramLoginModule required username="etl" '
            f'password="{secret}\\"x";')
    assert translate({"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.jaas.config": jaas,
                      "ssl.truststore.location": "/etc/ca.pem", "ssl.truststore.type": "PEM",
                      "ssl.endpoint.identification.algorithm": "", "linger.ms": "5"}) == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "etl",
        "sasl.password": secret + '"x', "ssl.ca.location": "/etc/ca.pem",
        "ssl.endpoint.identification.algorithm": "none", "linger.ms": "5"}
    assert translate({"ssl.keystore.type": "PEM", "ssl.keystore.location": "/etc/me.pem"}) == {
        "ssl.certificate.location": "/etc/me.pem", "ssl.key.location": "/etc/me.pem"}
    refused = {
        "a JKS truststore": ({"ssl.truststore.location": "/etc/t.jks", "ssl.truststore.password": secret},
                             "kafka.ssl.truststore.location is a JKS truststore"),
        "a JKS keystore": ({"ssl.keystore.location": "/etc/k.jks", "ssl.keystore.type": "JKS",
                            "ssl.keystore.password": secret}, "kafka.ssl.keystore.location is a JKS keystore"),
        "an OAuth login module": ({"sasl.jaas.config": "org.apache.kafka.common.security.oauthbearer."
                                   f'OAuthBearerLoginModule required clientSecret="{secret}";'},
                                  "kafka.sasl.jaas.config with OAuthBearerLoginModule is not translated"),
        "no password": ({"sasl.jaas.config": 'org.apache.kafka.common.security.plain.PlainLoginModule required '
                         'username="etl";'}, "needs username"),
    }
    for case, (config, line) in refused.items():
        with pytest.raises(ConfigurationError) as e:
            translate(config)
        assert line in str(e.value) and secret not in str(e.value), (case, str(e.value))


@pytest.mark.kafka
@pytest.mark.spark
def test_twophase_kafka_with_sparks_own_scram_options_writes_over_the_sasl_listener(kafka_service, spark, tmp_path):
    """The drop-in as a Spark user writes it: ``kafka.security.protocol``, ``kafka.sasl.mechanism``
    and ``kafka.sasl.jaas.config`` with the ScramLoginModule, as for ``format("kafka")``."""
    import twophase.datasource

    info = kafka_service
    plain, topic = info["bootstrap_servers"], _topic(info["bootstrap_servers"])
    twophase.datasource.register(spark)
    jaas = ('org.apache.kafka.common.security.scram.ScramLoginModule required '
            f'username="{info["scram_user"]}" password="{info["scram_password"]}";')
    df = spark.range(0, 40, 1, 2).selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
    (df.write.format("twophase-kafka").mode("append")
     .option("kafka.bootstrap.servers", info["sasl_bootstrap_servers"]).option("topic", topic)
     .option("kafka.security.protocol", "SASL_PLAINTEXT").option("kafka.sasl.mechanism", "SCRAM-SHA-256")
     .option("kafka.sasl.jaas.config", jaas)
     .option("twophase.logLocation", str(tmp_path / "log")).option("twophase.batchId", "0").save())
    assert sorted(int(v) for v in read_committed(plain, topic, idle=1.0)) == list(range(40))
