"""Profile of twophase-kafka's two per-batch steps in one process (issue 28).

The plan (``streamWriter()`` of a new ``KafkaDataSource``), then the commit step (``commit()`` on
an unpickled one) with no transactions, over a fake checkpoint: six pairs under cProfile after two
warm-up pairs; prints the 28 costliest calls by cumulative time.  Run from the repository root with
Kafka up (``python -m tests.services start kafka``)::

    .venv/bin/python benchmarks/tools/datasource_kafka_steps_profile.py > benchmarks/results/datasource/profile_kafka_steps.txt

Its figures: docs/datasource.md, "What it costs" (``KafkaSink.open()`` twice per batch).
"""

import cProfile
import json
import os
import pickle
import pstats
import sys
import tempfile
import uuid
from dataclasses import asdict

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")))
os.environ["TWOPHASE_KEEP_SERVICES"] = "1"

from confluent_kafka.admin import AdminClient  # noqa: E402
from pyspark.sql.types import LongType, StringType, StructField, StructType  # noqa: E402

from benchmarks.kafka import _create_topic  # noqa: E402
from tests import services as svc  # noqa: E402
from twophase.datasource import KafkaDataSource, TaskMessage  # noqa: E402

schema = StructType([StructField("id", LongType()), StructField("payload", StringType())])
k = svc.ensure("kafka")["kafka"]["bootstrap_servers"]
t = "bench-ds-prof-" + uuid.uuid4().hex[:6]
_create_topic(k, t, 4)
ck = tempfile.mkdtemp(prefix="twophase-bench-prof-")
os.makedirs(f"{ck}/offsets")
with open(f"{ck}/metadata", "w") as f:
    f.write(json.dumps({"id": "q"}))
opts = {"kafka.bootstrap.servers": k, "topic": t, "checkpointlocation": ck}
committer = pickle.loads(pickle.dumps(KafkaDataSource(opts)))


def one(b: int) -> None:
    with open(f"{ck}/offsets/{b}", "w") as f:
        f.write('v1\n{}\n{"0":1}\n')
    w = KafkaDataSource(opts).streamWriter(schema, False)
    committer.streamWriter(schema, False).commit([TaskMessage(asdict(w.plan), 0, 0, 0, None)], b)


for b in range(2):
    one(b)
pr = cProfile.Profile()
pr.enable()
for b in range(2, 8):
    one(b)
pr.disable()
a = AdminClient({"bootstrap.servers": k})
a.delete_topics([t])[t].result(30)
pstats.Stats(pr).sort_stats("cumulative").print_stats(28)
