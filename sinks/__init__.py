"""Shipped sinks, one package each: ``files`` (local disk, HDFS, S3), ``kafka``, ``postgres`` and
``mysql`` (MySQL and MariaDB).  ``spark_files``, ``spark_kafka`` and ``spark_jdbc`` turn Spark's
writer options into each sink's (the ``twophase-*`` data sources); ``_sql2pc`` holds the naming
and marker rules the two SQL sinks share."""
