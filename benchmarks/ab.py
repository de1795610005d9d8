"""``python -m benchmarks.ab``: this checkout against an earlier commit, on the same machine, in turns.

"No loss of throughput" is a claim about two commits, and on a shared 2-core machine one run of
each says little: the same variant moves 10-20 % between runs.  This runs ``python -m benchmarks``
with the given arguments for this checkout and for ``--base`` alternately, ``--rounds`` times
each, then pools every timed repetition of each variant per commit and reports the pooled medians
side by side (``<out>/summary.md``, ``<out>/summary.json``).  A variant's own time, new against
base, is the comparison that matters; the baselines' (Spark's writers, raw clients) show how much
the machine itself drifted between the two.

The base commit is checked out with ``git worktree`` into a temporary folder and imported from
there (``PYTHONPATH``, also for Spark's Python workers; ``sinks/`` and ``coordinator/`` linked
under ``twophase/`` as the installed package has them); the venv, the services and the Spark
install are this checkout's.  The runs share the services (``TWOPHASE_KEEP_SERVICES=1`` unless
set otherwise): they stay up afterwards, ``python -m tests.services stop`` stops them.  Example::

    python -m benchmarks.ab --base a406f01 --rounds 3 --out benchmarks/results/ab-200k -- \\
        --only kafka,postgres,files --file-targets local,hdfs --rows 200000 --reps 9 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _worktree(base: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(into), base],
                   check=True, capture_output=True, text=True)
    for pkg in ("sinks", "coordinator"):
        link = into / "twophase" / pkg
        if not link.exists():
            link.symlink_to(Path("..") / pkg)
    return into


def _check_imports(checkout: Path, pythonpath: str) -> None:
    """Fail unless ``twophase`` and its sink and coordinator packages import from ``checkout``."""
    code = ("import twophase, twophase.sinks, twophase.coordinator as c; "
            "print(twophase.__file__); print(twophase.sinks.__file__); print(c.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=dict(env, PYTHONPATH=pythonpath),
                         capture_output=True, text=True)
    files = got.stdout.split()
    if got.returncode != 0 or len(files) != 3 or not all(Path(f).resolve().is_relative_to(checkout.resolve())
                                                          for f in files):
        raise SystemExit(f"[ab] the base checkout at {checkout} does not import as twophase: "
                         f"{(got.stderr.strip().splitlines() or files or ['no output'])[-1]}")


def _run(checkout: Path, pythonpath: str | None, args: list[str], out: Path) -> int:
    env = dict(os.environ, TWOPHASE_KEEP_SERVICES=os.environ.get("TWOPHASE_KEEP_SERVICES", "1"),
               PYSPARK_PYTHON=os.environ.get("PYSPARK_PYTHON", sys.executable))
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "benchmarks", *args, "--out", str(out)]
    return subprocess.run(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL).returncode


def samples(results: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    """Every timed repetition per (target, variant) of one ``results.json``."""
    out: dict[tuple[str, str], list[float]] = {}
    for name, section in results.get("sections", {}).items():
        groups = section["targets"].items() if isinstance(section.get("targets"), dict) else [(name, section)]
        for target, group in groups:
            for variant, v in (group.get("variants") or {}).items():
                if isinstance(v, dict) and v.get("seconds"):
                    out.setdefault((target, variant), []).extend(float(s) for s in v["seconds"])
    return out


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Pooled medians per (target, variant) for each side of ``runs`` ({"new": [...], "base": [...]})."""
    pooled: dict[str, dict[tuple[str, str], list[float]]] = {}
    for side, results in runs.items():
        acc: dict[tuple[str, str], list[float]] = {}
        for r in results:
            for key, xs in samples(r).items():
                acc.setdefault(key, []).extend(xs)
        pooled[side] = acc
    rows = []
    for key in sorted(set(pooled.get("new", {})) & set(pooled.get("base", {}))):
        new, base = pooled["new"][key], pooled["base"][key]
        mn, mb = statistics.median(new), statistics.median(base)
        rows.append({"target": key[0], "variant": key[1], "new_median_s": round(mn, 4), "new_n": len(new),
                     "base_median_s": round(mb, 4), "base_n": len(base), "new_over_base": round(mn / mb, 3)})
    return rows


def run_ratios(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each section's ratios against its own run's baseline (``sections.*.ratios``: the
    baseline's time over the variant's, > 1 faster), per run and side, with their medians.  Two
    commits' ratios cancel what moved the whole machine between runs, which pooled seconds do not."""
    per: dict[str, dict[str, list[float]]] = {}
    for side, results in runs.items():
        for r in results:
            for section in r.get("sections", {}).values():
                for name, value in (section.get("ratios") or {}).items():
                    if isinstance(value, (int, float)):
                        per.setdefault(name, {}).setdefault(side, []).append(float(value))
    rows = []
    for name in sorted(per):
        new, base = per[name].get("new"), per[name].get("base")
        if not new or not base:
            continue
        rows.append({"ratio": name, "new": new, "base": base, "new_median": round(statistics.median(new), 3),
                     "base_median": round(statistics.median(base), 3)})
    return rows


def markdown(rows: list[dict[str, Any]], base: str, args: list[str], rounds: int,
             ratios: list[dict[str, Any]] | None = None) -> str:
    lines = [f"# This checkout against {base}",
             "",
             f"`python -m benchmarks {' '.join(args)}`, {rounds} run(s) per commit in turns; every timed "
             "repetition of a variant pooled per commit. new/base > 1: this checkout took longer.",
             "",
             "| target | variant | new median s (n) | base median s (n) | new / base |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['variant']} | {r['new_median_s']:.3f} ({r['new_n']}) | "
                     f"{r['base_median_s']:.3f} ({r['base_n']}) | {r['new_over_base']:.3f} |")
    if ratios:
        lines += ["", "Against the same run's baseline (its time over the variant's: > 1 faster), each run's "
                  "ratio in run order, and their median:", "",
                  "| ratio | new: per run | median | base: per run | median |", "|---|---|---:|---|---:|"]
        for r in ratios:
            lines.append(f"| {r['ratio']} | {', '.join(f'{x:.2f}' for x in r['new'])} | {r['new_median']:.2f} | "
                         f"{', '.join(f'{x:.2f}' for x in r['base'])} | {r['base_median']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against (anything git rev-parse takes)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per commit, in turns (default 2)")
    ap.add_argument("--out", type=Path, required=True, help="folder for each run's results and the summary")
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: write the summary again from the runs already in --out (new-N, base-N)")
    opts = ap.parse_args(argv)
    if any(a == "--out" or a.startswith("--out=") for a in bench_args):
        ap.error("give --out before '--' only: each run's results go under it")
    if opts.rounds < 1:
        ap.error("--rounds must be at least 1")
    opts.out = opts.out.resolve()
    opts.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "base": []}
    if opts.summarize_only:
        for side in runs:
            found = sorted(opts.out.glob(f"{side}-*/results.json"), key=lambda p: int(p.parent.name.split("-")[1]))
            runs[side] = [json.loads(p.read_text()) for p in found]
        if not runs["new"] or not runs["base"]:
            ap.error(f"--summarize-only: no new-N/results.json and base-N/results.json under {opts.out}")
        opts.rounds = max(len(runs["new"]), len(runs["base"]))
        earlier = opts.out / "summary.json"
        if not bench_args and earlier.is_file():  # the runs' arguments, as the earlier summary has them
            bench_args = list(json.loads(earlier.read_text()).get("args") or [])
        return _write_summary(opts, bench_args, runs)
    with tempfile.TemporaryDirectory(prefix="twophase-ab-") as tmp:
        wt = _worktree(opts.base, Path(tmp) / "base")
        try:
            _check_imports(wt, str(wt))
            for r in range(1, opts.rounds + 1):
                for side, checkout, pp in (("new", REPO, None), ("base", wt, str(wt))):
                    out = opts.out / f"{side}-{r}"
                    print(f"[ab] round {r}/{opts.rounds}: {side}", file=sys.stderr, flush=True)
                    code = _run(checkout, pp, bench_args, out)
                    if code != 0:
                        print(f"[ab] {side} run {r} exited {code}: see its output above", file=sys.stderr)
                        return code
                    runs[side].append(json.loads((out / "results.json").read_text()))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(wt)], capture_output=True)
    return _write_summary(opts, bench_args, runs)


def _write_summary(opts: argparse.Namespace, bench_args: list[str], runs: dict[str, list[dict[str, Any]]]) -> int:
    rows, ratios = summarize(runs), run_ratios(runs)
    (opts.out / "summary.json").write_text(json.dumps({"base": opts.base, "args": bench_args,
                                                       "rounds": opts.rounds, "rows": rows, "ratios": ratios},
                                                      indent=1))
    (opts.out / "summary.md").write_text(markdown(rows, opts.base, bench_args, opts.rounds, ratios))
    print(opts.out / "summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
