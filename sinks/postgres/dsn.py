"""Driver (wherever a PostgresSink is constructed): its connection strings, libpq's key=value
and URI forms, and pgjdbc's JDBC URLs.

libpq strings are parsed by libpq itself (psycopg2's ``parse_dsn``); ``jdbc:postgresql:`` URLs
are read with pgjdbc's rules and translated to libpq parameters.  A malformed string may split
a password anywhere, so no error raised here ever quotes a piece of the string.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

from twophase._deps import require
from twophase.errors import ConfigurationError

log = logging.getLogger("twophase.sinks.postgres")

_ENCODE_HINT = (
    "In a URI, percent-encode @ / ? # % & = : and spaces inside the user name or password (%40 %2F "
    "%3F %23 %25 %26 %3D %3A %20); in key=value form, quote a value with spaces or quotes "
    "(password='p@ss w0rd', with \\' and \\\\ for a quote and a backslash inside); or leave the "
    'password out of the dsn and pass password={"env": "VAR"}. (The dsn is not shown: it may '
    "hold a password.)"
)

# libpq's parse errors (fe-connect.c) by their fixed words, each with what it means for the user.
# libpq's own text quotes the offending piece of the string, which may be part of a password.
_LIBPQ_ERRORS = (
    ('missing "=" after', 'a word without "=" follows a value (an unquoted value with a space?)'),
    ("unterminated quoted string", "a quoted value is not closed"),
    ("invalid connection option", "it names an option libpq does not know (a value with a space?)"),
    (
        "invalid URI query parameter",
        "its ?query names an option libpq does not know (an & in a value?)",
    ),
    ("key/value separator", "a ?query parameter is not key=value (an & or = in a value?)"),
    ("invalid percent-encoded token", "a % is not followed by two hex digits (write % as %25)"),
    ("forbidden value %00", "it holds %00"),
    ("unexpected spaces", "it has a space where a URI allows none (write it as %20)"),
    ("IPv6", "its [IPv6] host is malformed"),
    ("unexpected character", "its host:port part is malformed"),
)


def _refuse(what: str) -> ConfigurationError:
    return ConfigurationError(
        f"PostgresSink dsn is not a valid connection string: {what}. {_ENCODE_HINT}"
    )


def parse(dsn: str) -> dict[str, str]:
    """The connection parameters of ``dsn``, password included (the caller takes it out).

    Accepts libpq key=value strings, ``postgresql://`` / ``postgres://`` URIs and
    ``jdbc:postgresql:`` URLs.  Refuses, without quoting it, a string libpq cannot
    parse and a URI whose user:password part libpq would read into the host, port or
    database (an unencoded ``@`` or ``/`` in the password).
    """
    text = dsn.strip()
    if text[:5].lower() == "jdbc:":
        params = jdbc_to_libpq(text)
    else:
        if text.startswith(("postgresql://", "postgres://")):
            _check_uri(text)
        pg = require("psycopg2", "PostgresSink")
        import psycopg2.extensions

        try:
            params = dict(psycopg2.extensions.parse_dsn(text))
        except pg.ProgrammingError as e:
            raise _refuse(_explain(str(e))) from None
    for port in params.get("port", "").split(","):
        if not re.fullmatch(r"[0-9]*", port.strip()):
            raise _refuse("its port is not a number (a ':' or '/' in an unencoded password?)")
    return params


def _check_uri(text: str) -> None:
    """Refuse a URI whose user:password part libpq would not end where the user meant it to.

    libpq ends the user:password part at the first ``@`` or ``/``; a password holding one of
    them spills into the host, port or database.  After that point a well-formed URI has
    no ``@`` before its ``?query``.
    """
    rest = text.split("://", 1)[1]
    ends = [i for i in (rest.find("@"), rest.find("/")) if i >= 0]
    cut = min(ends) if ends else -1
    after = rest[cut + 1 :] if cut >= 0 and rest[cut] == "@" else rest
    if "@" in after.split("?", 1)[0]:
        raise _refuse("its user:password part holds an unencoded '@' or '/'")


def _explain(message: str) -> str:
    for words, meaning in _LIBPQ_ERRORS:
        if words in message:
            return meaning
    return "libpq cannot parse it"


# ----------------------------------------------------------------------------- JDBC
# pgjdbc property (lower-cased) -> libpq keyword, where the meaning is the same.
_JDBC_SAME = {
    "user": "user",
    "password": "password",
    "sslmode": "sslmode",
    "sslrootcert": "sslrootcert",
    "sslcert": "sslcert",
    "sslkey": "sslkey",
    "sslpassword": "sslpassword",
    "applicationname": "application_name",
    "connecttimeout": "connect_timeout",
    "options": "options",
    "gssencmode": "gssencmode",
    "kerberosservername": "krbsrvname",
    "channelbinding": "channel_binding",
}
_JDBC_TARGET = {
    "any": "any",
    "primary": "primary",
    "master": "primary",
    "secondary": "standby",
    "standby": "standby",
    "slave": "standby",
    "prefersecondary": "prefer-standby",
    "preferstandby": "prefer-standby",
    "preferslave": "prefer-standby",
}
# Properties that only tune the Java driver (statement caching, fetch sizes, logging, Java
# socket options): nothing to translate, dropped.
_JDBC_JAVA_ONLY = frozenset(
    p.lower()
    for p in (
        "prepareThreshold",
        "preparedStatementCacheQueries",
        "preparedStatementCacheSizeMiB",
        "preferQueryMode",
        "defaultRowFetchSize",
        "reWriteBatchedInserts",
        "stringtype",
        "binaryTransfer",
        "binaryTransferEnable",
        "binaryTransferDisable",
        "loggerLevel",
        "loggerFile",
        "logUnclosedConnections",
        "socketTimeout",
        "loginTimeout",
        "cancelSignalTimeout",
        "tcpKeepAlive",
        "tcpNoDelay",
        "receiveBufferSize",
        "sendBufferSize",
        "autosave",
        "cleanupSavepoints",
        "readOnly",
        "readOnlyMode",
        "assumeMinServerVersion",
        "disableColumnSanitiser",
        "escapeSyntaxCallMode",
        "allowEncodingChanges",
        "logServerErrorDetail",
        "quoteReturningIdentifiers",
        "unknownLength",
        "hostRecheckSeconds",
        "loadBalanceHosts",
        "databaseMetadataCacheFields",
        "databaseMetadataCacheFieldsMiB",
        "maxResultBuffer",
        "adaptiveFetch",
        "adaptiveFetchMinimum",
        "adaptiveFetchMaximum",
        "hideUnprivilegedObjects",
        "groupStartupParameters",
        "protocolVersion",
        "sslResponseTimeout",
    )
)
_JDBC_NO_LIBPQ = frozenset(
    p.lower()
    for p in (
        "sslfactory",
        "sslfactoryarg",
        "sslhostnameverifier",
        "sslpasswordcallback",
        "socketFactory",
        "socketFactoryArg",
        "authenticationPluginClassName",
        "jaasApplicationName",
        "jaasLogin",
        "gsslib",
        "sspiServiceClass",
        "useSpnego",
    )
)
_LIBPQ_FORMS = (
    "a libpq URI postgresql://user@host:port/db or key=value pairs (host=... port=... "
    "dbname=... user=...)"
)


def jdbc_to_libpq(url: str) -> dict[str, str]:
    """libpq parameters for a ``jdbc:postgresql:`` URL, read as pgjdbc reads it.

    Forms: ``jdbc:postgresql://host[:port][,host[:port]...][/database][?k=v&...]`` and
    ``jdbc:postgresql:database``.  Values are URL-decoded as pgjdbc does (``+`` is a
    space).  A host left out is ``localhost`` and a port left out 5432, as in pgjdbc.
    ``ssl=true`` without ``sslmode`` is ``sslmode=verify-full`` (pgjdbc's meaning);
    ``currentSchema`` becomes ``options=-c search_path=...``.  Properties that only
    tune the Java driver are dropped; one with no libpq equivalent is refused.
    """
    m = re.match(r"jdbc:([A-Za-z0-9]+):", url, re.IGNORECASE)
    if not m or m.group(1).lower() != "postgresql":
        sub = f"jdbc:{m.group(1)}:" if m else "that JDBC URL"
        raise ConfigurationError(
            f"PostgresSink dsn is a JDBC URL for {sub}, not PostgreSQL; give a "
            f"jdbc:postgresql://host:port/db?user=...&password=... URL or {_LIBPQ_FORMS}"
        )
    rest = url[m.end() :]
    rest, _, query = rest.partition("?")
    hosts, ports, dbname = ["localhost"], ["5432"], rest.lstrip("/")
    if rest.startswith("//"):
        authority, _, dbname = rest[2:].partition("/")
        if "@" in authority:
            raise ConfigurationError(
                "PostgresSink dsn: a JDBC URL takes no user:password@ before the host (pgjdbc "
                "would not connect with it); pass them as ?user=...&password=... (URL-encoded). "
                "(The dsn is not shown: it may hold a password.)"
            )
        hosts, ports = [], []
        for hp in authority.split(",") if authority else [""]:
            host, port = _host_port(hp)
            hosts.append(host or "localhost")
            ports.append(port or "5432")
    params: dict[str, str] = {"host": ",".join(hosts), "port": ",".join(ports)}
    if dbname:
        params["dbname"] = unquote_plus(dbname)
    params.update(_jdbc_properties(query))
    return params


def _host_port(hp: str) -> tuple[str, str]:
    if hp.startswith("["):  # [IPv6]:port
        host, _, tail = hp[1:].partition("]")
        port = tail.removeprefix(":")
    else:
        host, _, port = hp.partition(":")
    if not re.fullmatch(r"[0-9]*", port):
        raise ConfigurationError(
            "PostgresSink dsn: the JDBC URL's port is not a number. (The dsn is not "
            "shown: it may hold a password.)"
        )
    return host, port


def _jdbc_properties(query: str) -> dict[str, str]:
    out: dict[str, str] = {}
    options: list[str] = []
    ssl: str | None = None
    dropped: list[str] = []
    after_password = False
    for token in filter(None, query.split("&")):
        name, _, raw = token.partition("=")
        value = unquote_plus(raw)
        key = name.lower()
        if key in _JDBC_SAME:
            if key == "options":
                options.insert(0, value)
            else:
                out[_JDBC_SAME[key]] = value
        elif key == "ssl":
            ssl = value
        elif key == "currentschema":
            # libpq's options split at spaces unless escaped; pgjdbc sets search_path the same way.
            options.append("-c search_path=" + value.replace("\\", "\\\\").replace(" ", "\\ "))
        elif key == "targetservertype":
            if value.lower() not in _JDBC_TARGET:
                raise ConfigurationError(
                    f"PostgresSink dsn: targetServerType must be one of "
                    f"{', '.join(sorted(_JDBC_TARGET))}"
                )
            out["target_session_attrs"] = _JDBC_TARGET[value.lower()]
        elif key in _JDBC_JAVA_ONLY:
            dropped.append(name)
        elif key in _JDBC_NO_LIBPQ:
            raise ConfigurationError(
                f"PostgresSink dsn: the JDBC property {name!r} configures the Java "
                f"driver and has no libpq equivalent; give {_LIBPQ_FORMS} instead"
            )
        elif after_password:
            # Maybe the tail of a password with an unencoded & in it: never name it.
            raise ConfigurationError(
                "PostgresSink dsn: the JDBC URL has, after password=, a property neither pgjdbc "
                "nor libpq knows. If the password holds & = + % or spaces, URL-encode it (%26 %3D "
                "%2B %25 %20). (The dsn is not shown: it may hold a password.)"
            )
        else:
            raise ConfigurationError(
                f"PostgresSink dsn: unknown JDBC property {name!r}; give "
                f"{_LIBPQ_FORMS} instead, or drop the property"
            )
        after_password = after_password or key == "password"
    if ssl is not None and "sslmode" not in out and ssl.lower() in ("", "true"):
        out["sslmode"] = (
            "verify-full"  # pgjdbc: ssl=true verifies the server's certificate and name
        )
    if options:
        out["options"] = " ".join(options)
    if dropped:
        log.info(
            "PostgresSink: JDBC properties %s only tune the Java driver; ignored",
            ", ".join(dropped),
        )
    return out
