"""``format("twophase-jdbc")`` without registration: Spark imports every top-level module named
``pyspark_*`` on its Python path and registers its ``DefaultSource`` (once per JVM, a Spark Connect
server's too), so wherever twophase is installed this sink is there by name.  Importing this module
must never fail where pyspark is installed: an error here would break every Python data source
lookup of that Spark."""

from twophase.datasource import JdbcDataSource as DefaultSource

__all__ = ["DefaultSource"]
