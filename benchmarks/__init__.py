"""Benchmarks: twophase's exactly-once sinks side by side with Spark's own writers and raw clients.

Run ``python -m benchmarks [--quick] [--only kafka,postgres,files,coordinator,recovery,partitions]``
from the repository root.  Every comparison is measured in the same run, on the
same cached DataFrame, with the variants interleaved (A/B/A/B, order rotated per
repetition); results are medians and ratios to a baseline.  See docs/benchmarks.md.
"""
