"""Both: where KafkaSink's broker-protocol client was before the sink became a package (now
:mod:`twophase.sinks.kafka.protocol`, its settings translation :mod:`twophase.sinks.kafka.protocol_config`).
Kept for code that still imports it here: older revisions of the sink, which tests may load from git
(tests/harness_reach.py ``load_old_sink``).  Every name of both, private ones too, as the old module had.
"""

from twophase.sinks.kafka import protocol as _protocol
from twophase.sinks.kafka import protocol_config as _protocol_config

globals().update({k: v for m in (_protocol_config, _protocol) for k, v in vars(m).items() if not k.startswith("__")})
