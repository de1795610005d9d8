"""Both sides (the driver and the executor tasks), before a KafkaSink's transaction client is built
(:class:`twophase.sinks.kafka.protocol.TxnClient`): the sink's resolved librdkafka settings as
kafka-python's connection and security settings (:func:`kafka_python_config`), OAUTHBEARER
included (:func:`oauth_token_provider`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from twophase._deps import require

# librdkafka (confluent-kafka) setting -> kafka-python setting.  Only connection and
# security settings matter to the driver; the rest configure the producer.
_KP_KEYS = {
    "bootstrap.servers": "bootstrap_servers",
    "client.id": "client_id",
    "security.protocol": "security_protocol",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "sasl.kerberos.service.name": "sasl_kerberos_service_name",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.crl.location": "ssl_crlfile",
}
_KP_IGNORED_PREFIXES = ("ssl.", "sasl.")
#: OAUTHBEARER settings the driver turns into a token provider (see :func:`oauth_token_provider`).
_OAUTH_KEYS = ("sasl.oauthbearer.config", "enable.sasl.oauthbearer.unsecure.jwt",
               "sasl.oauthbearer.method", "sasl.oauthbearer.client.id",
               "sasl.oauthbearer.client.secret", "sasl.oauthbearer.token.endpoint.url",
               "sasl.oauthbearer.scope", "sasl.oauthbearer.extensions")


def kafka_python_config(rdkafka_config: dict[str, Any]) -> dict[str, Any]:
    """Translate resolved librdkafka settings into kafka-python client settings (connection part).

    Security settings kafka-python has no equivalent for raise ValueError (naming the
    setting, never its value): committing with different security than the producers
    would fail later in a less clear way.  OAUTHBEARER (``sasl.mechanism``) becomes a token
    provider of the same kind librdkafka uses: unsecured JWTs
    (``enable.sasl.oauthbearer.unsecure.jwt``) or OIDC client credentials
    (``sasl.oauthbearer.method=oidc``).
    """
    out: dict[str, Any] = {}
    for k, v in rdkafka_config.items():
        if k in _KP_KEYS:
            kp = _KP_KEYS[k]
            out[kp] = v.upper() if kp in ("security_protocol",) else v
        elif k == "ssl.endpoint.identification.algorithm":
            out["ssl_check_hostname"] = str(v).lower() not in ("none", "")
        elif k in _OAUTH_KEYS:
            continue
        elif k in ("ssl.keystore.location", "ssl.keystore.password"):
            raise ValueError(
                f"the driver-side Kafka client cannot read a PKCS#12 keystore ({k!r}); give the same "
                "certificate and key as PEM files, which the producers accept too: openssl pkcs12 -in "
                "KEYSTORE.p12 -clcerts -nokeys -out client.pem; openssl pkcs12 -in KEYSTORE.p12 -nocerts "
                "-nodes -out client.key; then ssl.certificate.location=client.pem, "
                "ssl.key.location=client.key")
        elif k.startswith(_KP_IGNORED_PREFIXES) and k not in ("ssl.providers",):
            raise ValueError(f"the driver-side Kafka client cannot use the security setting {k!r}; "
                             "supported: " + ", ".join(sorted([*_KP_KEYS, *_OAUTH_KEYS])))
    if str(out.get("sasl_mechanism", "")).upper() == "OAUTHBEARER":
        out["sasl_mechanism"] = "OAUTHBEARER"
        out["sasl_oauth_token_provider"] = oauth_token_provider(rdkafka_config)
    elif any(k in rdkafka_config for k in _OAUTH_KEYS):
        given = ", ".join(sorted(k for k in rdkafka_config if k in _OAUTH_KEYS))
        raise ValueError(f"{given} given, but sasl.mechanism is not OAUTHBEARER")
    return out


def _b64url(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _parse_kv(text: str, what: str, sep: str = " ") -> dict[str, str]:
    out = {}
    for part in (p for p in text.split(sep) if p.strip()):
        key, eq, value = part.strip().partition("=")
        if not eq or not key:
            raise ValueError(f"{what}: expected name=value pairs, got an entry without '='")
        out[key] = value
    return out


def oauth_token_provider(conf: dict[str, Any]) -> Any:
    """A kafka-python token provider for librdkafka's OAUTHBEARER settings ``conf``.

    * ``enable.sasl.oauthbearer.unsecure.jwt=true`` with ``sasl.oauthbearer.config``
      (``principal=NAME [principalClaimName=sub] [scope=a,b] [lifeSeconds=3600]
      [extension_NAME=value ...]``): an unsigned JWT, as librdkafka makes it (brokers accept
      these only with their default, development-only validator);
    * ``sasl.oauthbearer.method=oidc`` with ``sasl.oauthbearer.client.id``,
      ``.client.secret``, ``.token.endpoint.url`` (and ``.scope``, ``.extensions``): the
      client-credentials grant against the identity provider, the token reused until shortly
      before it expires.
    """
    require("kafka", "KafkaSink's driver-side client")
    from kafka.net.sasl.oauth import AbstractTokenProvider

    def flag(name: str) -> bool:
        return str(conf.get(name, "false")).lower() in ("true", "1")

    class _Provider(AbstractTokenProvider):
        def __init__(self, fetch, extensions: dict[str, str]):
            super().__init__()
            self._fetch, self._ext = fetch, extensions
            self._token: str | None = None
            self._until = 0.0
            self._lock = threading.Lock()

        def token(self) -> str:
            with self._lock:
                if self._token is None or time.time() >= self._until:
                    self._token, lifetime = self._fetch()
                    self._until = time.time() + max(1.0, lifetime * 0.8)
                return self._token

        def extensions(self) -> dict[str, str]:
            return dict(self._ext)

    if flag("enable.sasl.oauthbearer.unsecure.jwt"):
        import json
        cfg = _parse_kv(str(conf.get("sasl.oauthbearer.config", "")), "sasl.oauthbearer.config")
        principal = cfg.get("principal")
        if not principal:
            raise ValueError("enable.sasl.oauthbearer.unsecure.jwt needs sasl.oauthbearer.config="
                             "'principal=NAME ...' (the token's subject)")
        claim = cfg.get("principalClaimName", "sub")
        life = int(cfg.get("lifeSeconds", "3600"))
        scope = [x for x in cfg.get("scope", "").split(",") if x]
        ext = {k[len("extension_"):]: v for k, v in cfg.items() if k.startswith("extension_")}

        def unsecured() -> tuple[str, float]:
            now = time.time()
            claims: dict[str, Any] = {claim: principal, "iat": now, "exp": now + life}
            if scope:
                claims["scope"] = scope
            head = _b64url(json.dumps({"alg": "none"}).encode())
            return f"{head}.{_b64url(json.dumps(claims).encode())}.", float(life)

        return _Provider(unsecured, ext)
    if str(conf.get("sasl.oauthbearer.method", "default")).lower() == "oidc":
        missing = [k for k in ("sasl.oauthbearer.client.id", "sasl.oauthbearer.client.secret",
                               "sasl.oauthbearer.token.endpoint.url") if not conf.get(k)]
        if missing:
            raise ValueError(f"sasl.oauthbearer.method=oidc needs {', '.join(missing)}")
        ext = _parse_kv(str(conf.get("sasl.oauthbearer.extensions", "")), "sasl.oauthbearer.extensions",
                        sep=",")

        def client_credentials() -> tuple[str, float]:
            import base64
            import json
            import urllib.parse
            import urllib.request

            url = str(conf["sasl.oauthbearer.token.endpoint.url"])
            ident = f"{conf['sasl.oauthbearer.client.id']}:{conf['sasl.oauthbearer.client.secret']}"
            form = {"grant_type": "client_credentials"}
            if conf.get("sasl.oauthbearer.scope"):
                form["scope"] = str(conf["sasl.oauthbearer.scope"])
            req = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(), headers={
                "Authorization": "Basic " + base64.b64encode(ident.encode()).decode(),
                "Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    body = json.loads(r.read())
            except Exception as e:  # noqa: BLE001 - the endpoint, never the secret, is named
                raise ConnectionError(f"OAUTHBEARER token request to {url} failed: "
                                      f"{type(e).__name__}: {getattr(e, 'code', '') or e}") from None
            if "access_token" not in body:
                raise ConnectionError(f"OAUTHBEARER token endpoint {url} answered without access_token")
            return str(body["access_token"]), float(body.get("expires_in", 300))

        return _Provider(client_credentials, ext)
    raise ValueError("sasl.mechanism=OAUTHBEARER needs, for the driver-side client as for librdkafka "
                     "without a refresh callback, either sasl.oauthbearer.method=oidc (with "
                     "sasl.oauthbearer.client.id, .client.secret and .token.endpoint.url) or "
                     "enable.sasl.oauthbearer.unsecure.jwt=true with sasl.oauthbearer.config")
