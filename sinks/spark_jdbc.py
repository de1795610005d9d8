"""``format("twophase-jdbc")``: Spark's JDBC sink options as a database sink's configuration, routed
by the url: ``jdbc:postgresql:`` to :class:`~twophase.sinks.postgres.PostgresSink` (prepared
transactions), ``jdbc:mysql:`` and ``jdbc:mariadb:`` to :class:`~twophase.sinks.mysql.MySqlSink`
(XA); any other url is refused by name.  (The data source machinery is ``twophase.datasource``;
the registry entry is ``twophase.config.BUILTIN_FORMATS``.)"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from twophase.config import SparkFormat
from twophase.errors import ConfigurationError
from twophase.sink import TwoPhaseCommitSink


def jdbc_url_for_sink(url: str, user: str | None) -> str:
    """Spark's ``url`` option as PostgresSink's dsn: the JDBC URL itself, which the sink reads as
    pgjdbc does (multi-host, ``ssl=true``, ``currentSchema``, ``ApplicationName``, ...; a property
    with no libpq meaning is refused by name), with the ``user`` option added.  A password in the
    URL is refused without showing it (it belongs in ``.option('password', ...)``)."""
    from urllib.parse import parse_qsl, quote_plus

    if not url.lower().startswith("jdbc:postgresql:"):
        raise ConfigurationError(
            "twophase-jdbc writes to PostgreSQL (prepared transactions): url must start with "
            f"jdbc:postgresql://, got {':'.join(url.split(':')[:2])}:...")
    query = url.partition("?")[2]
    keys = {k.lower() for k, _ in parse_qsl(query, keep_blank_values=True)}
    if "password" in keys:
        raise ConfigurationError("twophase-jdbc: give the password as .option('password', ...), not in the url "
                                 "(the url is not shown)")
    if user:
        if "user" in keys:
            raise ConfigurationError("twophase-jdbc: the role is given twice, as .option('user', ...) and in the "
                                     "url's user=: give it once")
        url += ("&" if query else "?") + "user=" + quote_plus(user)
    return url


def jdbc_table(dbtable: str) -> tuple[str | None, str]:
    """``dbtable`` as Spark's JDBC writer means it, which puts it into its SQL as written: an
    unquoted name is folded to lower case by PostgreSQL (``public.Events`` is ``public.events``),
    a double-quoted one is exact (``"Events"``).  (schema or None, table)."""
    parts = re.findall(r'"((?:[^"]|"")*)"|([^."]+)', dbtable.strip())
    names = [q.replace('""', '"') if q else u.strip().lower() for q, u in parts]
    if not 1 <= len(names) <= 2 or not all(names):
        raise ConfigurationError(f"twophase-jdbc: dbtable must be [schema.]table, got {dbtable!r}")
    return (names[0] if len(names) == 2 else None), names[-1]


#: Spark's JDBC writer options that change nothing here: ``truncate`` and ``cascadeTruncate`` act in
#: Overwrite mode only (refused: the formats append); ``createTable*`` only when Spark creates a
#: missing table (the sink never creates one: its open() refuses a missing table, naming it).
_JDBC_NO_EFFECT = frozenset({"truncate", "cascadetruncate", "createtableoptions", "createtablecolumntypes"})
_JDBC_SPELLING = {"refreshkrb5config": "refreshKrb5Config", "connectionprovider": "connectionProvider",
                  "sessioninitstatement": "sessionInitStatement", "isolationlevel": "isolationLevel"}
#: Spark's JDBC options for writing that have no meaning for the sink's libpq connections.
_JDBC_REFUSED = {
    "keytab": "Kerberos login from a keytab is the JVM's; libpq authenticates with GSSAPI from the ticket cache "
              "(kinit) where the tasks run: drop keytab and principal",
    "principal": "Kerberos login from a keytab is the JVM's; libpq authenticates with GSSAPI from the ticket "
                 "cache (kinit) where the tasks run: drop keytab and principal",
    "refreshkrb5config": "Kerberos configuration is the JVM's; libpq reads krb5.conf itself: drop it",
    "connectionprovider": "JDBC connection providers are JVM classes; the sink connects with libpq: drop it",
    "sessioninitstatement": "the sink runs no user SQL in its prepared transactions; set session defaults on "
                            "the role (ALTER ROLE ... SET) instead",
}


def _spark_writer_checks(options: Mapping[str, str]) -> None:
    """Spark's JDBC writer options no database sink here can mean."""
    if str(options.get("querytimeout") or "0").strip() != "0":
        raise ConfigurationError(
            "twophase-jdbc: queryTimeout is not supported (a statement cancelled mid-batch fails the "
            "batch, which then runs again); drop it")
    if options.get("numpartitions"):
        raise ConfigurationError(
            "twophase-jdbc: numPartitions is not supported: Spark's JDBC writer coalesces the rows to that "
            "many partitions, which a Python data source cannot do; give df.coalesce(N) before the write")


def _postgres(options: Mapping[str, str]) -> TwoPhaseCommitSink[Any, Any]:
    """A PostgresSink from Spark's JDBC options (``url`` is ``jdbc:postgresql:...``)."""
    from twophase.sinks.postgres import PostgresSink

    url, table = options["url"], options["dbtable"]
    for option, why in _JDBC_REFUSED.items():
        if option in options:
            raise ConfigurationError(f"twophase-jdbc: {_JDBC_SPELLING.get(option, option)} is not supported: "
                                     f"{why}; nothing was written")
    driver = options.get("driver")
    if driver and driver != "org.postgresql.Driver":
        raise ConfigurationError(f"twophase-jdbc writes to PostgreSQL only; driver {driver!r} is not its")
    level = str(options.get("isolationlevel") or "READ_UNCOMMITTED").upper()
    if level not in ("NONE", "READ_UNCOMMITTED", "READ_COMMITTED"):
        raise ConfigurationError(
            f"twophase-jdbc: isolationLevel={level} is not supported: the sink's transactions run at "
            "PostgreSQL's READ COMMITTED (what Spark's default READ_UNCOMMITTED means in PostgreSQL)")
    _spark_writer_checks(options)
    dsn = jdbc_url_for_sink(url, options.get("user"))
    schema, name = jdbc_table(table)
    keys = [k.strip() for k in (options.get("twophase.keycolumns") or "").split(",") if k.strip()]
    return PostgresSink(dsn, name, schema=schema, mode=options.get("twophase.mode", "insert"),
                        key_columns=keys or None, password=options.get("password"),
                        gid_prefix=options.get("twophase.gidprefix", "tp"))


_MYSQL_DRIVERS = frozenset({"com.mysql.cj.jdbc.Driver", "com.mysql.jdbc.Driver", "org.mariadb.jdbc.Driver"})
#: Spark's JDBC options for writing that have no meaning for MySqlSink's PyMySQL connections.
_MYSQL_REFUSED = {
    "keytab": "Kerberos login from a keytab is the JVM's: drop keytab and principal",
    "principal": "Kerberos login from a keytab is the JVM's: drop keytab and principal",
    "refreshkrb5config": "Kerberos configuration is the JVM's: drop it",
    "connectionprovider": "JDBC connection providers are JVM classes; the sink connects with PyMySQL: drop it",
    "sessioninitstatement": "the sink runs no user SQL in its XA transactions; set session defaults on the "
                            "account or server instead",
    "isolationlevel": "the sink's XA transactions run at READ COMMITTED, set on each of its connections: drop it",
}


def _mysql(options: Mapping[str, str]) -> TwoPhaseCommitSink[Any, Any]:
    """A MySqlSink from Spark's JDBC options (``url`` is ``jdbc:mysql:...`` or ``jdbc:mariadb:...``)."""
    from twophase.sinks.mysql import sink_from_jdbc_options

    for option, why in _MYSQL_REFUSED.items():
        if option in options:
            raise ConfigurationError(f"twophase-jdbc: {_JDBC_SPELLING.get(option, option)} is not supported with "
                                     f"MySQL/MariaDB: {why}; nothing was written")
    driver = options.get("driver")
    if driver and driver not in _MYSQL_DRIVERS:
        raise ConfigurationError(f"twophase-jdbc: driver {driver!r} is not a MySQL or MariaDB driver, which the "
                                 "url names")
    _spark_writer_checks(options)
    keys = [k.strip() for k in (options.get("twophase.keycolumns") or "").split(",") if k.strip()]
    try:
        return sink_from_jdbc_options(dict(options), mode=options.get("twophase.mode", "insert"),
                                      key_columns=keys or None, gid_prefix=options.get("twophase.gidprefix", "tp"))
    except ConfigurationError as e:
        raise ConfigurationError(f"twophase-jdbc: {e}") from None


#: The sink by the url's subprotocol (``jdbc:<subprotocol>:``).
_ROUTES: dict[str, Callable[[Mapping[str, str]], TwoPhaseCommitSink[Any, Any]]] = {
    "postgresql": _postgres, "mysql": _mysql, "mariadb": _mysql}


def build(options: Mapping[str, str]) -> TwoPhaseCommitSink[Any, Any]:
    """The sink the url names, from Spark's JDBC options; what it cannot mean is refused by name."""
    url, table = options.get("url"), options.get("dbtable")
    if options.get("twophase.partitionby"):
        raise ConfigurationError(
            f"twophase-jdbc: partitionBy({options['twophase.partitionby']}) has no meaning for a table "
            "(Spark's JDBC writer has no partitioned output either): drop it; nothing was written")
    if not url or not table:
        raise ConfigurationError("twophase-jdbc needs .option('url', 'jdbc:postgresql://host:port/db') (or "
                                 "jdbc:mysql://, jdbc:mariadb://) and .option('dbtable', 'schema.table')")
    scheme = url.split(":")[1].lower() if url.lower().startswith("jdbc:") and url.count(":") >= 2 else ""
    route = _ROUTES.get(scheme)
    if route is None:
        raise ConfigurationError(
            "twophase-jdbc writes to PostgreSQL (prepared transactions) and MySQL/MariaDB (XA): url must start "
            f"with jdbc:postgresql://, jdbc:mysql:// or jdbc:mariadb://, got {':'.join(url.split(':')[:2])}:...")
    return route(options)


FORMAT = SparkFormat(
    kind="jdbc",
    build=build,
    known_options=frozenset({"url", "dbtable", "user", "password", "driver", "twophase.mode",
                             "twophase.keycolumns", "twophase.gidprefix", "batchsize", "isolationlevel",
                             "querytimeout", "numpartitions", *_JDBC_NO_EFFECT, *_JDBC_REFUSED}),
    doc="""``format("twophase-jdbc")``: rows into a table by two-phase commit, with the options of
    Spark's JDBC sink: ``url`` (``jdbc:postgresql://...``: prepared transactions;
    ``jdbc:mysql://...``, ``jdbc:mariadb://...``: XA), ``dbtable``, ``user``, ``password``;
    ``twophase.mode`` insert (default) or upsert with ``twophase.keyColumns``.""",
)
