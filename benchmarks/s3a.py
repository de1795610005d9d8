"""Spark's own S3 writer (S3A) as the files section's S3 baseline: the jars and the settings.

What users would pick instead of FileSink on S3 is Spark writing ``s3a://`` itself: the
``hadoop-aws`` connector of the Hadoop version pyspark bundles (with the AWS SDK bundle it
depends on, from Maven Central through ``tests/services/maven.py``), and for a safe, fast
commit the S3A *magic* committer, which Spark reaches through ``PathOutputCommitProtocol``
from ``spark-hadoop-cloud`` (one jar, no dependencies taken: pyspark has them).  Both are
opt-in (``--file-targets s3a``): the SDK bundle alone is about 690 MB.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
SCALA = "2.13"
#: Spark SQL settings that route a write through Hadoop's PathOutputCommitter (S3A's magic
#: committer): runtime settings, set around the magic-committer writes only.
MAGIC_SQL_CONF = {
    "spark.sql.sources.commitProtocolClass": "org.apache.spark.internal.io.cloud.PathOutputCommitProtocol",
    "spark.sql.parquet.output.committer.class": "org.apache.spark.internal.io.cloud.BindingParquetOutputCommitter",
}


def hadoop_version() -> str:
    """The Hadoop version pyspark bundles (from its ``hadoop-client-api`` jar)."""
    from tests.services.kafka import pyspark_jars_dir

    for p in pyspark_jars_dir().glob("hadoop-client-api-*.jar"):
        m = re.match(r"hadoop-client-api-(.+)\.jar$", p.name)
        if m:
            return m.group(1)
    raise RuntimeError(f"no hadoop-client-api jar in {pyspark_jars_dir()}")


def _cloud_version(spark_version: str) -> str:
    """``spark-hadoop-cloud``: pyspark's version if published, else the newest release not newer."""
    url = f"{MAVEN_CENTRAL}/org/apache/spark/spark-hadoop-cloud_{SCALA}/maven-metadata.xml"
    with urllib.request.urlopen(url, timeout=60) as r:
        versions = re.findall(r"<version>([^<]+)</version>", r.read().decode())

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v)[:3])

    if spark_version in versions:
        return spark_version
    ok = [v for v in versions if re.fullmatch(r"[\d.]+", v) and key(v) <= key(spark_version)]
    if not ok:
        raise RuntimeError(f"no spark-hadoop-cloud_{SCALA} release usable with Spark {spark_version} in {url}")
    return max(ok, key=key)


def s3a_jars() -> list[str]:
    """hadoop-aws (pyspark's Hadoop version) with its runtime dependencies that pyspark lacks,
    and spark-hadoop-cloud; cached in the jar cache, so later calls need no network."""
    import pyspark

    from tests.services import JAR_CACHE
    from tests.services.kafka import jar_artifact, pyspark_jars_dir
    from tests.services.maven import resolve

    hv = hadoop_version()
    jars = resolve([f"org.apache.hadoop:hadoop-aws:{hv}"], f"hadoop-aws-{hv}")
    shipped = {jar_artifact(p.name) for p in pyspark_jars_dir().glob("*.jar")}
    out = [str(p) for p in jars if jar_artifact(p.name) not in shipped]
    cv = _cloud_version(pyspark.__version__)
    cloud = Path(JAR_CACHE) / f"spark-hadoop-cloud-{cv}" / f"spark-hadoop-cloud_{SCALA}-{cv}.jar"
    if not cloud.exists():
        cloud.parent.mkdir(parents=True, exist_ok=True)
        tmp = cloud.with_suffix(".part")
        urllib.request.urlretrieve(
            f"{MAVEN_CENTRAL}/org/apache/spark/spark-hadoop-cloud_{SCALA}/{cv}/{cloud.name}", tmp)
        tmp.rename(cloud)
    return [*out, str(cloud)]


def configure(spark, info: dict[str, Any]) -> None:
    """Point S3A at the test S3 server ``info`` (MinIO): endpoint, path-style, test keys, and
    the magic committer enabled for the writes that ask for it."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    settings = {
        "fs.s3a.endpoint": info["endpoint_url"],
        "fs.s3a.endpoint.region": info["region"],
        "fs.s3a.path.style.access": "true",
        "fs.s3a.connection.ssl.enabled": "false",
        "fs.s3a.access.key": info["key"],
        "fs.s3a.secret.key": info["secret"],
        "fs.s3a.aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
        "fs.s3a.committer.magic.enabled": "true",
    }
    for k, v in settings.items():
        conf.set(k, v)


def write(df, url: str, *, magic: bool) -> None:
    """``df.write.parquet(url)`` on S3A, with the magic committer or with Spark's default
    (FileOutputCommitter: task and job commits rename, which S3A does by copying)."""
    spark = df.sparkSession
    hconf = spark.sparkContext._jsc.hadoopConfiguration()
    if not magic:
        hconf.set("fs.s3a.committer.name", "file")
        df.write.mode("append").parquet(url)
        return
    hconf.set("fs.s3a.committer.name", "magic")
    before = {k: spark.conf.get(k, None) for k in MAGIC_SQL_CONF}
    try:
        for k, v in MAGIC_SQL_CONF.items():
            spark.conf.set(k, v)
        df.write.mode("append").parquet(url)
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)
