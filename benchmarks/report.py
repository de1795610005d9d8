"""Write the results of one run: ``results.json``, ``results.md`` (the tables) and ``results.png`` (the plot)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _load(res: dict[str, Any]) -> str:
    la = res.get("load_average")
    return f"{la['start_1min']:.1f} at the start, {la['end_1min']:.1f} at the end" if la else "not recorded"


def hardware() -> dict[str, Any]:
    """This machine: its CPUs (``os.cpu_count()``) and physical memory in bytes (None where unknown)."""
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    return {"cpus": os.cpu_count(), "memory_bytes": memory}


def _hardware(res: dict[str, Any]) -> str:
    """The machine the run recorded (``res["hardware"]``; this one for results without it)."""
    hw = res.get("hardware") or hardware()
    cpus = f"{hw['cpus']} CPUs" if hw.get("cpus") else "an unknown number of CPUs"
    mem = f"{hw['memory_bytes'] / 2**30:.1f} GiB of memory" if hw.get("memory_bytes") else "unknown memory"
    return f"{cpus} and {mem}"


def markdown(res: dict[str, Any]) -> str:
    p = res["params"]
    lines = [f"# twophase benchmark results ({'quick' if p['quick'] else 'full'} run)", "",
             f"Run at {res['started_at']} UTC, {res['duration_s']:.0f} s, on {res['machine']}. "
             f"rows={p['rows']}, row_size={p['row_size']} B, partitions={p['partitions']}, "
             f"reps={p['reps']} (+{p['warmup']} warm-up), trigger={p['trigger_interval']} s.", "",
             "Ratios are throughput ratios (baseline time / candidate time, medians of this run): "
             "> 1 means the exactly-once sink is faster. The machine has "
             f"{_hardware(res)} (load average {_load(res)}, which counts other work on it too): absolute "
             "numbers are noisy, the ratios are the point.", ""]
    sec = res["sections"]
    for key in ("kafka", "postgres"):
        if key in sec:
            s = sec[key]
            lines += [f"## {s['title']}", "", "| variant | median s | rows/s | MB/s |", "|---|---:|---:|---:|"]
            for name, v in s["variants"].items():
                lines.append(f"| {name} | {v['median_s']:.3f} | {_fmt(v['rows_per_s'])} | {v['mb_per_s']:.2f} |")
            lines.append("")
            for k, r in s["ratios"].items():
                lines.append(f"- **{k}: {r:.2f}x**")
            c = s["commit_latency_ms"]
            lines += [f"- commit latency per batch: p50 {c['p50']:.1f} ms, p99 {c['p99']:.1f} ms "
                      f"({c['samples']} batches)", ""]
    if "files" in sec:
        s = sec["files"]
        lines += ["## Files (Parquet)", "", "| target | variant | median s | rows/s | MB/s | server CPU s |",
                  "|---|---|---:|---:|---:|---:|"]
        for t, d in s["targets"].items():
            for name, v in d["variants"].items():
                cpu = f"{v['server_cpu_median_s']:.2f}" if "server_cpu_median_s" in v else "-"
                lines.append(f"| {t} | {name} | {v['median_s']:.3f} | {_fmt(v['rows_per_s'])} | "
                             f"{v['mb_per_s']:.2f} | {cpu} |")
        lines += ["", "Server CPU s: CPU time the server's processes (the HDFS minicluster JVM, the moto "
                  "S3 server) spent during the run (median), on the same CPUs as the writers.", ""]
        for k, r in s["ratios"].items():
            lines.append(f"- **{k}: {r:.2f}x**")
        for t, c in s["commit_latency_ms"].items():
            lines.append(f"- {t} commit latency per batch: p50 {c['p50']:.1f} ms, p99 {c['p99']:.1f} ms")
        lines.append("")
    if "coordinator" in sec:
        b, st = sec["coordinator"]["batch"], sec["coordinator"]["streaming"]
        lines += ["## Coordinator overhead", "",
                  f"- overhead per batch (median coordinator total - median plain mapInArrow collect): "
                  f"**{b['overhead_ms']:.1f} ms**",
                  f"- protocol time (intent + log + commit, NullSink): p50 {b['protocol_ms']['p50']:.1f} ms, "
                  f"p99 {b['protocol_ms']['p99']:.1f} ms",
                  f"- streaming ({st['sink']}, {st['batches']} batches, trigger {st['trigger_interval_s']} s): "
                  f"commit p50 {st['commit_ms']['p50']:.1f} ms / p99 {st['commit_ms']['p99']:.1f} ms; "
                  f"protocol p50 {st['protocol_ms']['p50']:.1f} ms / p99 {st['protocol_ms']['p99']:.1f} ms; "
                  f"whole batch p50 {st['total_ms']['p50']:.0f} ms / p99 {st['total_ms']['p99']:.0f} ms", ""]
    if "recovery" in sec:
        s = sec["recovery"]
        lines += ["## Recovery (`twophase recover`)", "", "| sink | pending handles | recover s | ms/handle |",
                  "|---|---:|---:|---:|"]
        for kind in ("files", "postgres"):
            for r in s.get(kind, []):
                lines.append(f"| {kind} | {r['handles']} | {r['recover_s']:.3f} | {r['per_handle_ms']:.2f} |")
        if s.get("postgres_note"):
            lines += ["", s["postgres_note"]]
        lines.append("")
    if "partitions" in sec:
        s = sec["partitions"]
        lines += ["## By input partitions", "",
                  "| target | input partitions | exactly-once rows/s | Spark rows/s | ratio | transactions per batch "
                  "| Python floor ratio | machine CPU s: ours / Spark's / floor |",
                  "|---|---:|---:|---:|---:|---|---:|---|"]
        for pt in s["points"]:
            v = list(pt["variants"].values())
            floor = f"{pt['floor_ratio']:.2f}" if "floor_ratio" in pt else "-"
            cpu = " / ".join(f"{x['machine_cpu_median_s']:.2f}" for x in v if "machine_cpu_median_s" in x) or "-"
            lines.append(f"| {pt['target']} | {pt['partitions']} | {_fmt(v[0]['rows_per_s'])} | "
                         f"{_fmt(v[1]['rows_per_s'])} | {pt['ratio']:.2f} | "
                         f"{', '.join(str(h) for h in pt['transactions_per_batch'])} | {floor} | {cpu} |")
        lines += ["", s["note"], ""]
        if any("floor_ratio" in pt for pt in s["points"]):
            lines += ["Python floor ratio: Spark's writer against the same rows moved into Spark's Python workers "
                      "and turned into Python objects, with nothing sent (`mapInArrow`, no producer, no "
                      "transaction): the best ratio any Python executor path can reach in this run.", ""]
        lines += ["Machine CPU s: median seconds the machine's cores were busy during one batch (writer, Spark "
                  "and servers alike). Near the core count times the wall time, a run is CPU-bound and its "
                  "ratio is the ratio of CPU spent.", ""]
        if s.get("streaming"):
            st = s["streaming"]
            lines += ["| target (streaming) | source partitions | ours addBatch ms (median) | "
                      "Spark addBatch ms (median) | ratio |", "|---|---:|---:|---:|---:|"]
            for pt in st["points"]:
                lines.append(f"| {pt['target']} | {pt['partitions']} | "
                             f"{statistics.median(pt['ours_add_batch_ms']):.0f} | "
                             f"{statistics.median(pt['spark_add_batch_ms']):.0f} | {pt['ratio']:.2f} |")
            lines += ["", st["note"], ""]
    if "connect" in sec:
        s = sec["connect"]
        lines += ["## Spark Connect vs classic", "",
                  "| target | variant | median s | rows/s | MB/s |", "|---|---|---:|---:|---:|"]
        for pt in s["points"]:
            for name, v in pt["variants"].items():
                lines.append(f"| {pt['target']} | {name} | {v['median_s']:.3f} | {_fmt(v['rows_per_s'])} | "
                             f"{v['mb_per_s']:.2f} |")
        names = list(s["points"][0]["ratios"]) if s["points"] else []
        lines += ["", "| target | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for pt in s["points"]:
            lines.append(f"| {pt['target']} | " + " | ".join(f"{pt['ratios'][n]:.2f}" for n in names) + " |")
        lines += ["", s["note"], ""]
        if s.get("streaming"):
            st = s["streaming"]
            lines += ["| target (streaming) | session | query s (median) | addBatch ms (median) |",
                      "|---|---|---:|---:|"]
            for pt in st["points"]:
                for name, v in pt["variants"].items():
                    lines.append(f"| {pt['target']} | {name} | {v['query_median_s']:.2f} | "
                                 f"{v['add_batch_median_ms']:.0f} |")
            lines += ["", "| target (streaming) | query Connect / classic | addBatch Connect / classic |",
                      "|---|---:|---:|"]
            for pt in st["points"]:
                r = pt["ratios"]
                lines.append(f"| {pt['target']} | {r['query Connect / classic']:.2f} | "
                             f"{r['addBatch Connect / classic']:.2f} |")
            lines += ["", st["note"], ""]
    if "latency" in sec:
        lines += latency_markdown(sec["latency"])
    if "datasource" in sec:
        lines += datasource_markdown(sec["datasource"])
    if res["goals"]:
        lines += ["## Goals", "", "| goal | measured | target | met |", "|---|---:|---:|---|"]
    for g in res["goals"]:
        lines.append(f"| {g['goal']} | {g['value']:.3g} | {g['op']} {g['target']:g} | "
                     f"{'yes' if g['met'] else '**NO**'} |")
    lines.append("")
    return "\n".join(lines)


def latency_markdown(s: dict[str, Any]) -> list[str]:
    """The latency section: per (target, rows per batch), every variant's median micro-batch times."""
    c = s["config"]
    lines = ["## Latency per micro-batch", "",
             f"Streaming, `rate-micro-batch` source (2 partitions), default trigger; {c['batches']} micro-batches "
             f"per query, the first {c['warmup']} discarded; {c['reps']} interleaved round(s) per variant. "
             "Medians over every kept batch (p10-p90 in brackets). Ratio: Spark's median triggerExecution "
             "/ this variant's (> 1: faster than Spark's own sink). Coordinator columns: its own per-batch "
             "figures (`Coordinator.recent_progress`, medians). Log requests: HTTP requests to the log's "
             "server per steady-state batch (median), counted by a pass-through proxy: on the critical path "
             "+ while the tasks ran (background).", "",
             "| target | rows/batch | variant | triggerExecution ms | addBatch ms | ratio | coordinator "
             "intent / prepare / log / commit / total ms | log requests |",
             "|---|---:|---|---:|---:|---:|---|---|"]
    for g in s["groups"]:
        for name, v in g["variants"].items():
            cm = v.get("coordinator_ms_median")
            coord = " / ".join(f"{cm[k]:.0f}" for k in ("intent_ms", "prepare_ms", "log_ms", "commit_ms",
                                                         "total_ms")) if cm else "-"
            lr = v.get("log_requests")
            req = f"{lr['critical_median']:g} + {lr['background_median']:g}" if lr else "-"
            lo, hi = v["trigger_ms_p10_p90"]
            lines.append(f"| {g['target']} | {g['rows']:,} | {name} | {v['trigger_ms_median']:.0f} "
                         f"({lo:.0f}-{hi:.0f}) | {v['add_batch_ms_median']:.0f} | {v['ratio']:.2f} | {coord} | "
                         f"{req} |")
    lines.append("")
    for g in s["groups"]:
        for d, n in (g.get("round_trips_added") or {}).items():
            over = g["round_trips_over_spark"][d]
            proto = (g.get("round_trips_added_protocol") or {}).get(d)
            lines.append(f"- {g['target']}, {g['rows']:,} rows: +{d} ms per S3 request adds {n:.1f} round trips "
                         "to the median triggerExecution (against the same log at +0 ms)"
                         + (f", {proto:.1f} to the coordinator's protocol time" if proto is not None else "")
                         + f"; the whole difference to {g['baseline']} is {over:.1f} round trips' worth")
        for name, v in g["variants"].items():
            lr = v.get("log_requests")
            if lr:
                seq = ", ".join(f"{k} {ms:.0f} ms" for k, ms in lr["example_batch"])
                lines.append(f"- {g['target']}, {g['rows']:,} rows, {name}: a steady-state batch's log "
                             f"requests: {seq}")
    lines.append("")
    return lines


def datasource_markdown(s: dict[str, Any]) -> list[str]:
    """The datasource section: per (target, input partitions), Spark's own sink, the coordinator and
    the data source form per batch and per row, and the data source's cost over the coordinator."""
    c = s["config"]
    lines = ["## The data source form (`format(\"twophase-...\")`)", "",
             f"Streaming, `rate-micro-batch` source, {c['rows']:,} rows per micro-batch in P partitions, default "
             f"trigger; {c['batches']} micro-batches per query, the first {c['warmup']} discarded; {c['reps']} "
             "interleaved round(s) per variant. Medians over every kept batch (p10-p90 in brackets) of Spark's "
             "`durationMs`: triggerExecution (the whole batch), addBatch (the sink's part: the tasks, and both of a "
             "data source's planner calls, its plan and its commit), queryPlanning (Spark's planning of the "
             "batch). Ratio: Spark's median "
             "triggerExecution / this variant's (> 1: faster than Spark's own sink). µs/row: triggerExecution "
             "per row. Every query's output was read back (see results.json, `output_checked`).", "",
             "| target | P | variant | triggerExecution ms | addBatch ms | queryPlanning ms | µs/row | rows/s "
             "| ratio |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for g in s["groups"]:
        for name, v in g["variants"].items():
            lo, hi = v["trigger_ms_p10_p90"]
            alo, ahi = v["add_batch_ms_p10_p90"]
            qp = v.get("query_planning_ms_median")
            lines.append(f"| {g['target']} | {g['partitions']} | {name} | {v['trigger_ms_median']:.0f} ({lo:.0f}-{hi:.0f}) "
                         f"| {v['add_batch_ms_median']:.0f} ({alo:.0f}-{ahi:.0f}) | "
                         f"{'-' if qp is None else f'{qp:.0f}'} | {v['us_per_row']:.1f} | {_fmt(v['rows_per_s'])} "
                         f"| {v['ratio']:.2f} |")
    lines += ["", "The data source form against the coordinator (differences of the medians above; "
              "ratio: coordinator's triggerExecution / the data source's):", "",
              "| target | P | + ms per batch | + addBatch ms | + queryPlanning ms | + other ms | + µs/row | ratio |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for g in s["groups"]:
        o = g["datasource_over_coordinator"]
        lines.append(f"| {g['target']} | {g['partitions']} | {o['trigger_ms']:+.0f} | {o['add_batch_ms']:+.0f} | "
                     f"{o['query_planning_ms']:+.0f} | {o['rest_ms']:+.0f} | {o['us_per_row']:+.1f} | "
                     f"{o['ratio']:.2f} |")
    for g in s["groups"]:
        for name, v in g["variants"].items():
            if "coalesce(" in name:
                lines.append(f"| {g['target']} | {g['partitions']} | ({name}) {v['over_coordinator_ms']:+.0f} | "
                             f"- | - | - | {v['over_coordinator_ms'] * 1000 / s['config']['rows']:+.1f} | "
                             f"{g['variants'][g['coordinator']]['trigger_ms_median'] / v['trigger_ms_median']:.2f} |")
    left = [(g, n, v["recovered_after_stop"]) for g in s["groups"] for n, v in g["variants"].items()
            if any(r["aborted"] or r["committed_batches"] for r in v.get("recovered_after_stop", []))]
    if left:
        lines += ["", "After each query's `stop()` (which interrupts the micro-batch in flight), `twophase recover` "
                  "ran on its log, as a restart would: transactions it found left and aborted, per query (the "
                  "others: none):", ""]
        for g, n, rs in left:
            lines.append(f"- {g['target']}, P={g['partitions']}, {n}: aborted {[r['aborted'] for r in rs]}"
                         + (f", committed batches {[r['committed_batches'] for r in rs]}"
                            if any(r["committed_batches"] for r in rs) else ""))
    ip = s.get("in_process") or {}
    if ip:
        lines += ["", "The data source's own work per micro-batch, in one process without Spark (the plan: "
                  "`streamWriter()` of a new `DataSource`; the commit step: `commit()` on a writer of an unpickled "
                  "one, with one message of no rows), medians (p10-p90) over a fake checkpoint; beside it the "
                  "coordinator's own per-batch figures from the streaming runs at the smallest P of the run "
                  "(`recent_progress`):", "",
                  "| target | plan ms | commit step ms | coordinator intent / log / commit ms |", "|---|---:|---:|---|"]
        for t, x in ip.items():
            cm = next((g["variants"][g["coordinator"]].get("coordinator_ms_median") for g in s["groups"]
                       if g["target"] == t and g["partitions"] == min(c["partitions"])), None)
            coord = " / ".join(f"{cm[k]:.0f}" for k in ("intent_ms", "log_ms", "commit_ms")) if cm else "-"
            lines.append(f"| {t} | {x['plan_ms_median']:.0f} ({x['plan_ms_p10_p90'][0]:.0f}-{x['plan_ms_p10_p90'][1]:.0f}) "
                         f"| {x['commit_ms_median']:.0f} ({x['commit_ms_p10_p90'][0]:.0f}-"
                         f"{x['commit_ms_p10_p90'][1]:.0f}) | {coord} |")
    floors = [g for g in s["groups"] if "datasource_over_floor" in g]
    if floors:
        lines += ["", "The no-op Python data source (`floor`): Spark's Python Data Source API with nothing in "
                  "plan, `write()` or `commit()` but reading the rows.", ""]
        for g in floors:
            f, d = g["floor_over_spark"], g["datasource_over_floor"]
            lines.append(f"- {g['target']}, P={g['partitions']}: the floor is {f['trigger_ms']:+.0f} ms per batch over "
                         f"Spark's own sink (queryPlanning {f['query_planning_ms']:+.0f} ms); the data source form "
                         f"is {d['trigger_ms']:+.0f} ms over the floor (addBatch {d['add_batch_ms']:+.0f} ms, "
                         f"queryPlanning {d['query_planning_ms']:+.0f} ms)")
    lines.append("")
    return lines


def plot_datasource(res: dict[str, Any], path: Path) -> None:
    """Median batch time by input partitions, one panel per target: a bar per variant
    (triggerExecution, p10-p90), its addBatch part darker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = res["sections"]["datasource"]["groups"]
    targets = list(dict.fromkeys(g["target"] for g in groups))
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 5), squeeze=False)
    for ax, t in zip(axes[0], targets):
        mine = sorted((g for g in groups if g["target"] == t), key=lambda g: g["partitions"])
        names = list(dict.fromkeys(n for g in mine for n in g["variants"]))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j, g in enumerate(mine) if n in g["variants"]]
            vs = [g["variants"][n] for g in mine if n in g["variants"]]
            err = [[v["trigger_ms_median"] - v["trigger_ms_p10_p90"][0] for v in vs],
                   [v["trigger_ms_p10_p90"][1] - v["trigger_ms_median"] for v in vs]]
            bars = ax.bar(xs, [v["trigger_ms_median"] for v in vs], width, yerr=err, capsize=3, label=n, alpha=0.55)
            ax.bar(xs, [v["add_batch_ms_median"] for v in vs], width * 0.5, color=bars.patches[0].get_facecolor(),
                   alpha=1.0)
        ax.set_xticks(range(len(mine)), [f"P={g['partitions']}" for g in mine])
        ax.set_ylabel("median triggerExecution ms (p10-p90); narrow bar: addBatch")
        ax.set_title(f"{t}: {mine[0]['rows']:,} rows per micro-batch")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(res: dict[str, Any], path: Path) -> None:
    """Median batch time (triggerExecution) by rows per batch, one panel per target: Spark's own
    sink against each Coordinator variant (and the floors, dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = res["sections"]["latency"]["groups"]
    targets = list(dict.fromkeys(g["target"] for g in groups))
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 5), squeeze=False)
    for ax, t in zip(axes[0], targets):
        mine = sorted((g for g in groups if g["target"] == t), key=lambda g: g["rows"])
        names = list(dict.fromkeys(n for g in mine for n in g["variants"]))
        for n in names:
            pts = [(g["rows"], g["variants"][n]) for g in mine if n in g["variants"]]
            xs = [r for r, _ in pts]
            ys = [v["trigger_ms_median"] for _, v in pts]
            err = [[v["trigger_ms_median"] - v["trigger_ms_p10_p90"][0] for _, v in pts],
                   [v["trigger_ms_p10_p90"][1] - v["trigger_ms_median"] for _, v in pts]]
            base = n == mine[0]["baseline"]
            style = dict(color="k", lw=2.2) if base else (dict(ls=":") if n.startswith(("floor", "Coordinator(Null"))
                                                          else {})
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=n, **style)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("rows per micro-batch")
        ax.set_ylabel("median triggerExecution ms (p10-p90)")
        ax.set_title(f"{t}: batch time by batch size")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sec = res["sections"]
    ratios: list[tuple[str, float]] = []
    for key in ("kafka", "postgres", "files"):
        if key in sec:
            ratios += list(sec[key]["ratios"].items())
    for pt in sec.get("connect", {}).get("points", []):
        ratios += [(f"{pt['target']}: {k}", pt["ratios"][k])
                   for k in ("ours Connect / classic", "Spark Connect / classic")]
    ncols = 1 + ("partitions" in sec) + ("recovery" in sec)
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 5), squeeze=False)
    ax = axes[0][0]
    if ratios:
        names = [n.replace(" / ", "\n/ ") for n, _ in ratios]
        ax.barh(range(len(ratios)), [r for _, r in ratios], color="tab:blue")
        ax.set_yticks(range(len(ratios)), names, fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
    ax.set_xlabel("throughput ratio (exactly-once / baseline)")
    ax.set_title("Same data, same run")
    i = 1
    if "partitions" in sec:
        ax = axes[0][i]
        i += 1
        pts = sec["partitions"]["points"]
        for target in sorted({p["target"] for p in pts}):
            mine = [p for p in pts if p["target"] == target]
            ax.plot([p["partitions"] for p in mine], [p["ratio"] for p in mine], marker="o", label=target)
        ax.set_xscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("input partitions")
        ax.set_ylabel("throughput ratio vs Spark's writer")
        ax.set_title("By input partitions")
        ax.legend()
    if "recovery" in sec:
        ax = axes[0][i]
        for kind in ("files", "postgres"):
            rs = sec["recovery"].get(kind) or []
            if rs:
                ax.plot([r["handles"] for r in rs], [r["recover_s"] for r in rs], marker="o", label=kind)
        ax.set_xscale("log")
        ax.set_xlabel("pending handles")
        ax.set_ylabel("recover seconds")
        ax.axhline(5.0, color="r", lw=0.8, ls="--", label="goal (1,000 handles)")
        ax.set_title("Recovery time")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict[str, Any], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    res.setdefault("hardware", hardware())  # the machine this run measured on
    paths["json"].write_text(json.dumps(res, indent=1, sort_keys=False) + "\n")
    paths["md"].write_text(markdown(res))
    streaming = {"latency": plot_latency, "datasource": plot_datasource}  # sections with plots of their own
    mine = [k for k in streaming if k in res["sections"]]
    if set(res["sections"]) == set(mine) and len(mine) == 1:
        streaming[mine[0]](res, paths["png"])  # nothing else to draw
    else:
        plot(res, paths["png"])
        for k in mine:
            paths[f"{k}_png"] = out / f"{k}.png"
            streaming[k](res, paths[f"{k}_png"])
    return paths
