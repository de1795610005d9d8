"""Resolve Maven artifacts (plus transitive runtime dependencies) into the jar cache.

``resolve(["org.apache.kafka:kafka_2.13:4.1.1"], "kafka-4.1.1")`` writes a tiny
``pom.xml`` into ``JAR_CACHE/<name>/``, runs the machine's ``mvn
dependency:copy-dependencies`` there and returns the jars.  A marker file keyed on
the exact coordinate list makes repeated calls free (no mvn run); a different
coordinate list for the same name wipes the old jars first.  Concurrent callers
for the same name are serialised with a file lock.

Coordinates: ``group:artifact:version``, ``group:artifact:type:version`` or
``group:artifact:type:classifier:version`` (Maven's own order).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from xml.sax.saxutils import escape

from tests.services import JAR_CACHE, ServiceError

#: Pinned so the result does not depend on Maven's (old) default plugin version.
DEPENDENCY_PLUGIN_VERSION = "3.6.1"
MVN_TIMEOUT = 1800.0
#: MariaDB Connector/J: Spark's JDBC writer to MariaDB in the MySQL benchmark (benchmarks/mysql.py).
MARIADB_CONNECTOR_J = "org.mariadb.jdbc:mariadb-java-client:3.5.7"


def _dependency_xml(coord: str) -> str:
    parts = coord.strip().split(":")
    if len(parts) == 3:
        g, a, v = parts
        typ, cls = "jar", ""
    elif len(parts) == 4:
        g, a, typ, v = parts
        cls = ""
    elif len(parts) == 5:
        g, a, typ, cls, v = parts
    else:
        raise ServiceError(f"bad Maven coordinate {coord!r}: want group:artifact[:type[:classifier]]:version")
    if not all((g, a, v, typ)):
        raise ServiceError(f"bad Maven coordinate {coord!r}")
    x = (
        f"    <dependency>\n"
        f"      <groupId>{escape(g)}</groupId>\n"
        f"      <artifactId>{escape(a)}</artifactId>\n"
        f"      <version>{escape(v)}</version>\n"
        f"      <type>{escape(typ)}</type>\n"
    )
    if cls:
        x += f"      <classifier>{escape(cls)}</classifier>\n"
    return x + "    </dependency>\n"


def _pom(coords: list[str], name: str) -> str:
    artifact = "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "deps"
    deps = "".join(_dependency_xml(c) for c in coords)
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0"
         xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
         xsi:schemaLocation="http://maven.apache.org/POM/4.0.0 http://maven.apache.org/xsd/maven-4.0.0.xsd">
  <modelVersion>4.0.0</modelVersion>
  <groupId>twophase.jarcache</groupId>
  <artifactId>{artifact}</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
{deps}  </dependencies>
  <build>
    <pluginManagement>
      <plugins>
        <plugin>
          <groupId>org.apache.maven.plugins</groupId>
          <artifactId>maven-dependency-plugin</artifactId>
          <version>{DEPENDENCY_PLUGIN_VERSION}</version>
        </plugin>
      </plugins>
    </pluginManagement>
  </build>
</project>
"""


def _mvn() -> str:
    mvn = shutil.which("mvn")
    if mvn:
        return mvn
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "maven"]):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
                raise ServiceError(f"`mvn` not found and `{' '.join(cmd)}` failed:\n{tail}")
        mvn = shutil.which("mvn")
        if mvn:
            return mvn
    raise ServiceError("`mvn` not found; install Maven (Debian: apt-get install maven)")


def _jars(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("*.jar") if p.is_file())


def resolve(coords: list[str], name: str) -> list[Path]:
    """Return absolute paths of the jars of ``coords`` and their transitive runtime deps.

    Jars land in ``JAR_CACHE/<name>/``.  Idempotent: skipped when the marker for
    exactly this coordinate list exists.  Raises :class:`ServiceError` with the tail
    of mvn's output when resolution fails.
    """
    coords = [c.strip() for c in coords if c.strip()]
    if not coords:
        raise ServiceError("resolve() needs at least one Maven coordinate")
    out = (JAR_CACHE / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256("\n".join(coords).encode()).hexdigest()[:16]
    marker = out / f".resolved-{key}"

    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            jars = _jars(out)
            if jars and all(p.exists() for p in jars):
                return jars
        # Different (or unfinished) coordinate list: start from a clean directory.
        for p in out.iterdir():
            if p.name != ".lock" and (p.suffix == ".jar" or p.name.startswith(".resolved-")):
                p.unlink()
        (out / "pom.xml").write_text(_pom(coords, name))
        cmd = [
            _mvn(), "-q", "-B", "-f", str(out / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={out}",
            "-DincludeScope=runtime",
        ]
        log = out / "mvn.log"
        try:
            with open(log, "w") as f:
                r = subprocess.run(cmd, cwd=out, stdout=f, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, timeout=MVN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise ServiceError(f"mvn timed out after {MVN_TIMEOUT:.0f}s resolving {coords}; log: {log}") from None
        jars = _jars(out)
        if r.returncode != 0 or not jars:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise ServiceError(
                f"mvn failed (exit {r.returncode}, {len(jars)} jars) resolving {coords} into {out}; "
                f"log: {log}\n--- mvn output tail ---\n{tail}"
            )
        marker.write_text("\n".join(coords) + "\n" + "\n".join(p.name for p in jars) + "\n")
        return jars
