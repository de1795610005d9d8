"""The Spark formats come from the sinks' registry (issue 47, "Shape"): each sink owns the
translation of Spark's option names (``twophase.config.SparkFormat``, one per format), and
``twophase.datasource`` is generic, so a format registered in the registry is served without
editing it; ``twophase-jdbc`` picks its sink by the url."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twophase import config
from twophase.errors import ConfigurationError

TOY_ROOT = "/tmp/twophase-toy-unused"


def _toy_format() -> config.SparkFormat:
    """A format no module of twophase names: its option ``where`` is the folder, its files are
    JSON lines named ``toy-...``.  (Made in a function: Spark pickles it by value, so its workers
    need no registry entry of their own.)"""

    def build(options):
        from twophase.sinks.files import FileSink

        where = options.get("where")
        if not where:
            raise ConfigurationError("twophase-toy needs .option('where', folder)")
        return FileSink(where, format="jsonl", prefix="toy")

    return config.SparkFormat(kind="toy", build=build, known_options=frozenset({"where"}), default_max_partitions=3,
                              doc="A toy format of the tests.")


TOY = _toy_format()


@pytest.fixture
def toy(monkeypatch):
    """The toy format in the registry (and no class of it left behind in twophase.datasource)."""
    import twophase.datasource as ds

    monkeypatch.setitem(config.BUILTIN_FORMATS, "toy", f"{__name__}:TOY")
    monkeypatch.setitem(vars(ds), "ToyDataSource", None)
    return ds


class _Registrar:
    def __init__(self):
        self.registered = []
        self.dataSource = self  # noqa: N815 - SparkSession's name

    def register(self, cls):
        self.registered.append(cls)


def test_a_format_in_the_registry_gets_the_generic_data_source_and_its_checks(toy):
    cls = toy._source_of("twophase-toy")
    assert cls is not None and cls.__name__ == cls.__qualname__ == "ToyDataSource"
    assert cls.__module__ == "twophase.datasource" and toy.ToyDataSource is cls  # pickled by reference
    assert (cls.name(), cls.known_options, cls.default_max_partitions, cls.spec) == (
        "twophase-toy", frozenset({"where"}), 3, TOY)
    spark = _Registrar()
    toy.register(spark)
    assert [c.name() for c in spark.registered] == ["twophase-files", "twophase-jdbc", "twophase-kafka",
                                                     "twophase-toy"]
    # start()'s checks and the plan's: the format's own options, the common ones, its translation
    with pytest.raises(ConfigurationError, match=r"twophase-toy: unknown option\(s\) wher \(did you mean where\?\)"):
        toy._check_at_start(cls, {"wher": "/x", "checkpointlocation": "/ck"}, "append")
    with pytest.raises(ConfigurationError, match="twophase-toy writes in Append output mode only"):
        toy._check_at_start(cls, {"where": "/x", "checkpointlocation": "/ck"}, "complete")
    with pytest.raises(ConfigurationError, match=r"twophase-toy needs \.option\('where'"):
        toy._check_at_start(cls, {"checkpointlocation": "/ck"}, "append")
    sink = cls({"where": TOY_ROOT}).build_sink()
    assert (type(sink).__name__, sink.root, sink.prefix) == ("FileSink", TOY_ROOT, "toy")
    assert toy._coalesce_to(None, cls, {"twophase.coalesce": "3"}) == 3
    with pytest.raises(ConfigurationError, match="more than twophase.maxPartitions=3"):
        toy._coalesce_to(None, cls, {"twophase.coalesce": "4"})


def test_a_format_in_the_registry_writes_through_spark_by_the_generic_plan_tasks_and_commit(toy, spark, tmp_path):
    """A batch write by the toy's name: planned, written by the tasks and committed by the generic
    writer; the same batch id again writes nothing."""
    from twophase.datasource import TwoPhaseDataSource

    class ToyDataSource(TwoPhaseDataSource):  # a class of the test: Spark pickles it by value
        kind = "toy"

    assert ToyDataSource.spec is TOY and ToyDataSource.__doc__ == "A toy format of the tests."
    spark.dataSource.register(ToyDataSource)
    out, log = tmp_path / "out", str(tmp_path / "log")
    df = spark.range(0, 90, 1, 3).selectExpr("CAST(id AS STRING) AS id")
    for _ in range(2):
        (df.write.format("twophase-toy").mode("append").option("where", str(out))
         .option("twophase.logLocation", log).option("twophase.batchId", "0").save())
    files = sorted(p for p in out.rglob("*") if p.is_file() and not p.name.startswith((".", "_")))
    assert files and all(p.name.startswith("toy-") and p.suffix == ".jsonl" for p in files), files
    rows = [json.loads(line)["id"] for p in files for line in Path(p).read_text().splitlines()]
    assert sorted(rows, key=int) == [str(i) for i in range(90)]


# ----------------------------------------------------------------- twophase-jdbc routes by url

JDBC = {"dbtable": "events", "user": "writer", "password": "s3cret", "checkpointlocation": "/tmp/ck"}


@pytest.mark.parametrize("url", ["jdbc:mysql://db:3307/shop", "jdbc:mariadb://db:3307/shop", "JDBC:MySQL://db:3307/shop"])
def test_a_mysql_or_mariadb_url_gets_the_mysql_sink(url):
    pytest.importorskip("pymysql")
    from twophase.datasource import JdbcDataSource

    sink = JdbcDataSource(dict(JDBC, url=url, **{"twophase.mode": "upsert", "twophase.keycolumns": "id",
                                                 "driver": "org.mariadb.jdbc.Driver"})).build_sink()
    assert (type(sink).__name__, sink.host, sink.port, sink.database, sink.table, sink.user) == (
        "MySqlSink", "db", 3307, "shop", "events", "writer")
    assert (sink.mode, sink.key_columns, sink.gid_prefix) == ("upsert", ["id"], "tp")
    pg = JdbcDataSource(dict(JDBC, url="jdbc:postgresql://db/shop")).build_sink()
    assert type(pg).__name__ == "PostgresSink"


@pytest.mark.parametrize("option,value", [("isolationLevel", "READ_COMMITTED"), ("keytab", "/etc/k"),
                                          ("sessionInitStatement", "SET x=1"), ("queryTimeout", "30"),
                                          ("numPartitions", "4"), ("driver", "org.postgresql.Driver")])
def test_the_mysql_route_refuses_what_it_cannot_mean_by_name(option, value):
    from twophase.datasource import JdbcDataSource

    ds = JdbcDataSource(dict(JDBC, url="jdbc:mysql://db/shop", **{option.lower(): value}))
    ds._check_options()
    with pytest.raises(ConfigurationError, match=rf"^twophase-jdbc: .*{option}") as e:
        ds.build_sink()
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("url", ["jdbc:sqlserver://db;databaseName=shop", "jdbc:oracle:thin:@db:1521/shop",
                                 "postgresql://db/shop"])
def test_any_other_url_is_refused_naming_its_scheme(url):
    from twophase.datasource import JdbcDataSource

    with pytest.raises(ConfigurationError, match="url must start with jdbc:postgresql://, jdbc:mysql:// or "
                                                 "jdbc:mariadb://") as e:
        JdbcDataSource(dict(JDBC, url=url)).build_sink()
    assert f"got {':'.join(url.split(':')[:2])}:..." in str(e.value)


def test_twophase_jdbc_with_a_mariadb_url_writes_each_row_once_into_mariadb(spark, mariadb_service, mdb, tmp_path):
    """The by-name form on a ``jdbc:mariadb:`` url, on the real MariaDB: a batch write commits its
    rows by XA, the same batch id again writes nothing, and no branch is left prepared."""
    import uuid

    import twophase.datasource

    twophase.datasource.register(spark)
    s, table = mariadb_service, f"ds_{uuid.uuid4().hex[:8]}"
    with mdb.cursor() as cur:
        cur.execute(f"CREATE TABLE `{table}` (id BIGINT, v VARCHAR(20)) ENGINE=InnoDB")
    try:
        df = spark.range(0, 60, 1, 2).selectExpr("id", "CAST(id AS STRING) AS v")
        for _ in range(2):
            (df.write.format("twophase-jdbc").mode("append")
             .option("url", f"jdbc:mariadb://{s['host']}:{s['port']}/{s['database']}").option("dbtable", table)
             .option("user", s["user"]).option("password", s["password"]).option("twophase.gidPrefix", table)
             .option("twophase.logLocation", str(tmp_path / "log")).option("twophase.batchId", "0").save())
        with mdb.cursor() as cur:
            cur.execute(f"SELECT id FROM `{table}` ORDER BY id")
            assert [r[0] for r in cur.fetchall()] == list(range(60))
            cur.execute("XA RECOVER")
            assert [r for r in cur.fetchall() if table in str(r[3])] == []
    finally:
        with mdb.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS `{table}`")
