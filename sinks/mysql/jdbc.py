"""The driver (and Spark's data source, on the driver): a :class:`MySqlSink` from Spark's JDBC
options, its ``jdbc:mysql:`` or ``jdbc:mariadb:`` url parsed (``sink_from_jdbc_options``)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, unquote

from twophase.errors import ConfigurationError
from twophase.sinks.mysql.sink import MySqlSink

#: JDBC url properties that ask for TLS (Connector/J's and MariaDB Connector/J's): refused, as the
#: sink's PyMySQL connections take no TLS settings yet (a silent drop would not verify the server).
_URL_TLS = frozenset({"sslmode", "usessl", "requiressl", "verifyservercertificate", "trustcertificatekeystoreurl",
                      "trustcertificatekeystorepassword", "clientcertificatekeystoreurl",
                      "clientcertificatekeystorepassword", "ssl", "servercerts", "trustservercertificate",
                      "enabledsslprotocolsuites", "tlsversions"})
#: Of those, the ones that can say "no TLS" (``useSSL=false``, ``sslMode=DISABLED``): the same meaning here.
_URL_TLS_OFF = frozenset({"usessl", "requiressl", "sslmode", "ssl", "verifyservercertificate"})
_OFF = frozenset({"false", "disabled", "disable", "0", "no", "off"})
#: JDBC url properties with the same meaning here: the role and its password (as the options),
#: and Connector/J settings that change nothing of what is written (utf8mb4 text, batched inserts,
#: the MariaDB driver's mysql: scheme).
_URL_ACCEPTED = frozenset({"user", "password", "useunicode", "characterencoding", "rewritebatchedstatements",
                           "permitmysqlscheme"})


def _parse_jdbc_url(url: str) -> dict[str, Any]:
    """``jdbc:mysql://host[:port][/database][?k=v&...]`` (or ``jdbc:mariadb:``) as its parts."""
    m = re.fullmatch(r"jdbc:(mysql|mariadb)://([^/?]*)(?:/([^?]*))?(?:\?(.*))?", url.strip(), re.IGNORECASE)
    if not m:
        raise ConfigurationError("url must be jdbc:mysql://host:port/database or jdbc:mariadb://host:port/database "
                                 "(the url is not quoted here: it may hold a password)")
    hostport = m.group(2)
    if "@" in hostport or "(" in hostport or "=" in hostport:
        # Connector/J's user:password@host and address=(host=...)(password=...) forms: never parsed
        # into a host name, which messages and the sink's config show.
        raise ConfigurationError("the JDBC url's host part holds credentials or Connector/J's address=(...) "
                                 "form, which MySqlSink does not take: give host:port in the url and the user "
                                 "and password as options (the url is not quoted here: it may hold a password)")
    if "," in hostport:
        raise ConfigurationError("MySqlSink takes one host in the JDBC url (failover lists are not supported)")
    host, port_text = hostport, ""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif ":" in hostport:
        host, port_text = hostport.rsplit(":", 1)
    if port_text and not port_text.isdigit():
        raise ConfigurationError("the JDBC url's port is not a number (the url is not quoted here: it may hold "
                                 "a password)")
    port = int(port_text) if port_text else 3306
    params = {k: v for k, v in parse_qsl(m.group(4) or "", keep_blank_values=True)}
    for key in params:
        name = key.lower()
        if name in _URL_TLS and not (name in _URL_TLS_OFF and params[key].strip().lower() in _OFF):
            raise ConfigurationError(
                f"the JDBC url's {key} is not supported: MySqlSink's connections (PyMySQL) take no TLS "
                "settings yet, and would not verify the server as the url asks; drop it only where the "
                "network to the server is trusted")
        if name == "characterencoding" and params[key].strip().lower() not in ("utf8", "utf-8", "utf8mb4"):
            raise ConfigurationError(f"the JDBC url's {key}={params[key]} is not supported: MySqlSink writes text "
                                     "as utf8mb4; drop it")
        if name not in _URL_ACCEPTED and name not in _URL_TLS_OFF:
            raise ConfigurationError(f"the JDBC url's {key} is not supported by MySqlSink (PyMySQL); drop it "
                                     f"(accepted: {', '.join(sorted(_URL_ACCEPTED))})")
    return {"host": host or "127.0.0.1", "port": port, "database": unquote(m.group(3) or "") or None,
            "params": params}


def sink_from_jdbc_options(options: dict[str, str], **kw: Any) -> MySqlSink:
    """A MySqlSink from Spark's JDBC options (``url``, ``user``, ``password``, ``dbtable``).

    ``dbtable`` ``db.table`` names the database too (unquoted, as MySQL reads it); backticks quote
    a name with a dot.  ``user`` and ``password`` may also be in the url's parameters.  Other
    keyword arguments go to :class:`MySqlSink` (``mode``, ``key_columns``, ``gid_prefix`` ...)."""
    opts = {k.lower(): v for k, v in options.items()}
    if "url" not in opts:
        raise ConfigurationError("the JDBC options need url=jdbc:mysql://host:port/database")
    u = _parse_jdbc_url(opts["url"])
    params = {k.lower(): v for k, v in u["params"].items()}
    user = opts.get("user", params.get("user"))
    password = opts.get("password", params.get("password"))
    table = opts.get("dbtable")
    if not table:
        raise ConfigurationError("the JDBC options need dbtable=... (the target table)")
    database = u["database"]
    parts = re.findall(r"`((?:[^`]|``)*)`|([^.`]+)", table.strip())
    idents = [(q.replace("``", "`") if q else n.strip()) for q, n in parts]
    if len(idents) == 2:
        database, table = idents
    elif len(idents) == 1:
        table = idents[0]
    else:
        raise ConfigurationError(f"dbtable {table!r} is not table or database.table")
    if not database:
        raise ConfigurationError("the JDBC url names no database (jdbc:mysql://host:port/database) and "
                                 "dbtable is not database.table")
    return MySqlSink(u["host"], u["port"], database, table, user=user, password=password, **kw)
