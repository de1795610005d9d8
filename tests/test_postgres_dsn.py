"""PostgresSink connection strings against the real PostgreSQL server (issue 14 item 8, issue 19).

A password holding ``@ : / ' " \\`` and spaces, given in every form libpq accepts (key=value,
URI) and as a Spark user's ``jdbc:postgresql://`` URL: well-formed strings connect and write;
malformed ones are refused up front.  Neither the password nor any fragment of it ever shows
in ``repr``, ``where``, ``to_config()``, handles or error messages (construction, a failed
connect, ``open()``, an executor's begin, a driver's commit).
"""

from __future__ import annotations

import json
import pickle
import uuid
from urllib.parse import quote, quote_plus

import pytest

from tests.test_postgres_sink import _uid, ids_batch, prepare, prepared_gids, q, table
from twophase import ConfigurationError, TransactionContext, TwoPhaseError
from twophase.config import sink_from_config
from twophase.sink import CommitOutcome
from twophase.sinks.postgres import PostgresSink

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


def _frag() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def odd_role(db, postgres_service):
    """A role whose password has every character that breaks naive DSN handling.

    Each piece between two special characters is unique, so a leaked fragment is found.
    """
    from tests.services.postgres import SERVICE

    pieces = [
        f"Pw{_frag()}",
        f"At{_frag()}",
        f"Sp{_frag()}",
        f"Co{_frag()}",
        f"Sl{_frag()}",
        f"Qu{_frag()}",
        f"Dq{_frag()}",
        f"Bs{_frag()}",
        f"Am{_frag()}",
    ]
    pw = (
        f"{pieces[0]}@{pieces[1]} {pieces[2]}:{pieces[3]}/{pieces[4]}'{pieces[5]}\"{pieces[6]}\\"
        f"{pieces[7]}&{pieces[8]}"
    )
    role = f"tp_odd_{_uid()}"
    t = table(db, "id bigint")
    # The marker table (and its claims table) the GRANT below names exist from here on, whichever
    # test file ran first on this server.
    PostgresSink(postgres_service["dsn"], table=t).open()
    su = SERVICE._superuser_conn(timeout=10)
    su.autocommit = True
    with su.cursor() as cur:
        cur.execute(f"CREATE ROLE {role} LOGIN PASSWORD %s", (pw,))
    q(db, f'GRANT INSERT, SELECT ON "{t}" TO {role}')
    q(db, f"GRANT SELECT, INSERT, DELETE ON twophase_commits TO {role}")
    try:
        yield {"role": role, "password": pw, "pieces": pieces, "table": t}
    finally:
        with su.cursor() as cur:  # what a failing test left prepared
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE owner = %s", (role,))
            for (gid,) in cur.fetchall():
                cur.execute("ROLLBACK PREPARED %s", (gid,))
        q(db, f'DROP TABLE "{t}"')
        q(db, f"REVOKE ALL ON twophase_commits FROM {role}")
        with su.cursor() as cur:
            cur.execute(f"DROP ROLE {role}")
        su.close()


def assert_no_fragment(texts: list[str], odd: dict) -> None:
    for text in texts:
        for piece in odd["pieces"]:
            assert piece not in text, f"password fragment {piece!r} in: {text}"


def _kv_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def test_well_formed_dsns_with_an_odd_password_connect_and_never_echo_it(
    odd_role, postgres_service, db
):
    info, pw, role = postgres_service, odd_role["password"], odd_role["role"]
    hp = f"{info['host']}:{info['port']}"
    dsns = {
        "key=value": f"host={info['host']} port={info['port']} dbname={info['dbname']} user={role} "
        f"password={_kv_quote(pw)}",
        "uri": f"postgresql://{role}:{quote(pw, safe='')}@{hp}/{info['dbname']}",
        "uri query": f"postgres://{hp}/{info['dbname']}?user={role}&password={quote(pw, safe='')}",
        "jdbc": f"jdbc:postgresql://{hp}/{info['dbname']}?user={role}&password={quote_plus(pw)}",
    }
    texts: list[str] = []
    for label, dsn in dsns.items():
        sink = PostgresSink(dsn, table=odd_role["table"])
        sink.open()
        assert sink.where == f"{role}@{hp}/{info['dbname']}", label
        _, (h,) = prepare(sink, f"odd-{_uid()}", 0, [[ids_batch([1])]])
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED, label
        texts += [
            repr(sink),
            sink.where,
            sink.dsn,
            json.dumps(sink.to_config()),
            sink.describe_handle(h),
            json.dumps(sink.encode_handle(h)),
            repr(pickle.loads(pickle.dumps(sink))),
        ]
        # A failed connect: nothing listens on this port.
        down = PostgresSink(
            dsn.replace(str(info["port"]), "35438"), table=odd_role["table"], connect_timeout=2
        )
        with pytest.raises(ConfigurationError) as ei:
            down.open()
        texts.append(str(ei.value))
        with pytest.raises(TwoPhaseError) as ei:
            down.begin_transaction(TransactionContext("q", 0, 0, 0, down.plan_batch("q", 0, 1)))
        texts.append(str(ei.value))
        res = down.commit(h)
        assert res.outcome is CommitOutcome.RETRY_LATER
        texts.append(res.reason)
        # open() failing on the server side: a missing table.
        with pytest.raises(ConfigurationError) as ei:
            PostgresSink(dsn, table=f"missing_{_uid()}").open()
        texts.append(str(ei.value))
    # A wrong password: the server refuses it.
    wrong = PostgresSink(
        dsns["uri"].replace(quote(pw, safe=""), quote(pw + "x", safe="")), table="x"
    )
    with pytest.raises(ConfigurationError, match="password authentication failed") as ei:
        wrong.open()
    texts.append(str(ei.value))
    assert_no_fragment(texts, odd_role)
    # The config rebuilds a working sink, the password by reference (the operator tools' path).
    cfg = PostgresSink(dsns["jdbc"], table=odd_role["table"]).to_config()
    assert "password" not in cfg and f"user={role}" in cfg["dsn"]
    assert sum(r[0] for r in q(db, f'SELECT count(*) FROM "{odd_role["table"]}"')) == len(dsns)


def test_malformed_dsns_are_refused_without_a_fragment_of_the_password(odd_role, postgres_service):
    """Before the fix libpq's parse put pieces of the password into ``where`` (as host, port or
    database) or into the error message."""
    info, pw, role = postgres_service, odd_role["password"], odd_role["role"]
    p = odd_role["pieces"]
    hp, db = f"{info['host']}:{info['port']}", info["dbname"]
    malformed = [
        f"postgresql://{role}:{pw}@{hp}/{db}",  # nothing percent-encoded
        f"postgresql://{role}:{p[0]}@{p[1]}@{hp}/{db}",  # an @ in the password
        f"postgresql://{role}:{p[0]}/{p[1]}@{hp}/{db}",  # a / in the password
        f"postgresql://{role}:12/{p[1]}@{hp}/{db}",  # ... that starts with digits
        f"postgresql://{role}:{p[0]}?{p[1]}@{p[2]}@{hp}/{db}",  # ? then @
        f"postgresql://{role}:{p[0]}%zz{p[1]}@{hp}/{db}",  # a bad percent escape
        f"postgresql://{hp}/{db}?user={role}&password={p[0]}&{p[1]}",  # & in a query value
        f"postgresql://{hp}/{db}?user={role}&password={p[0]}&{p[1]}=x",
        f"host={info['host']} port={info['port']} dbname={db} user={role} password={pw}",
        f"host={info['host']} user={role} password={p[0]} {p[1]}=x",
        f"host={info['host']} user={role} password='{p[0]} {p[1]}",  # unterminated quote
        f"jdbc:postgresql://{role}:{p[0]}@{hp}/{db}",  # userinfo is not JDBC
        f"jdbc:postgresql://{hp}/{db}?user={role}&password={p[0]}&{p[1]}=x",
        f"jdbc:postgresql://{hp}/{db}?password={p[0]}&{p[1]}",
    ]
    texts = []
    for dsn in malformed:
        with pytest.raises(ConfigurationError) as ei:
            sink = PostgresSink(dsn, table=odd_role["table"], connect_timeout=2)
            texts += [repr(sink), json.dumps(sink.to_config())]  # shown if it was not refused
            sink.open()
        msg = str(ei.value)
        assert "dsn" in msg, msg
        texts.append(msg)
    assert_no_fragment(texts, odd_role)
    # The message says what to do.
    with pytest.raises(ConfigurationError, match="percent-encode") as ei:
        PostgresSink(malformed[1], table="t")
    with pytest.raises(ConfigurationError, match="quote") as ei:
        PostgresSink(malformed[8], table="t")


def test_jdbc_url_is_translated_to_libpq(db, postgres_service, monkeypatch):
    """Issue 19: a Spark user's JDBC URL works as the dsn (before: a raw libpq parse error)."""
    info = postgres_service
    hp = f"{info['host']}:{info['port']}"
    uid = _uid()
    schema, name = f"jdbc_{uid}", f"jdbc-{uid}"
    q(db, f'CREATE SCHEMA "{schema}"')
    q(db, f'CREATE TABLE "{schema}".events (id bigint)')
    try:
        url = (
            f"jdbc:postgresql://{hp}/{info['dbname']}?user={info['user']}&password={info['password']}"
            f"&currentSchema={schema}&ApplicationName=jdbc-test&reWriteBatchedInserts=true"
            f"&sslmode=disable"
        )
        sink = PostgresSink(url, table="events", marker_schema=schema)
        assert sink.where == f"{info['user']}@{hp}/{info['dbname']}"
        assert "password" not in sink.dsn and "jdbc:" not in sink.dsn
        sink.open()
        _, (h,) = prepare(sink, name, 0, [[ids_batch([1, 2])]])
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        # currentSchema became the search_path: the unqualified table resolved into the schema.
        assert q(db, f'SELECT count(*) FROM "{schema}".events')[0][0] == 2
        with sink._driver_cursor() as cur:
            cur.execute("SELECT current_setting('application_name'), current_schema()")
            assert cur.fetchone() == ("jdbc-test", schema)
        # Rebuilt from its config by an operator tool (password from the environment).
        monkeypatch.setenv("PGPASSWORD", info["password"])
        rebuilt = sink_from_config(sink.to_config())
        assert rebuilt.commit(h).outcome is CommitOutcome.ALREADY_COMMITTED
        sink.close()
        rebuilt.close()
    finally:
        for gid in prepared_gids(db, f"tp:{name}:"):  # what a failing test left prepared
            q(db, "ROLLBACK PREPARED %s", (gid,))
        q(db, f'DROP SCHEMA "{schema}" CASCADE')


def test_jdbc_url_forms_and_refusals():
    """Offline twin of the JDBC test: what each JDBC form becomes, and what is refused."""

    def params(url: str) -> dict:
        return PostgresSink(url, table="t").params

    assert params("jdbc:postgresql://db1:5433,[::1],db3/shop?user=u&ssl=true") == {
        "host": "db1,::1,db3",
        "port": "5433,5432,5432",
        "dbname": "shop",
        "user": "u",
        "sslmode": "verify-full",
    }
    assert params("jdbc:postgresql:shop") == {"host": "localhost", "port": "5432", "dbname": "shop"}
    assert params(
        "jdbc:postgresql://h/my%20db?sslmode=require&ssl=true&connectTimeout=3"
        "&targetServerType=primary&currentSchema=a%20b,c"
    ) == {
        "host": "h",
        "port": "5432",
        "dbname": "my db",
        "sslmode": "require",
        "connect_timeout": "3",
        "target_session_attrs": "primary",
        "options": "-c search_path=a\\ b,c",
    }
    s = PostgresSink("jdbc:postgresql://h/db?user=u&password=a%2Bb+c", table="t")
    assert s._password_inline == "a+b c"  # decoded as pgjdbc does (URLDecoder: + is a space)
    with pytest.raises(ConfigurationError, match="sslfactory") as ei:
        PostgresSink(
            "jdbc:postgresql://h/db?sslfactory=org.postgresql.ssl.NonValidatingFactory", table="t"
        )
    assert "libpq" in str(ei.value)
    with pytest.raises(ConfigurationError, match="bogusProperty"):
        PostgresSink("jdbc:postgresql://h/db?bogusProperty=1", table="t")
    with pytest.raises(ConfigurationError, match="PostgreSQL") as ei:
        PostgresSink("jdbc:mysql://h/db?user=u&password=secretpw", table="t")
    assert "secretpw" not in str(ei.value)
    with pytest.raises(ConfigurationError, match="port"):
        PostgresSink("jdbc:postgresql://h:abc/db", table="t")
