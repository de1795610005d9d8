"""Executor tasks: the rows of each Arrow batch written into the partition's open XA branch
(``write``): insert mode by ``LOAD DATA LOCAL INFILE`` of the batch as CSV made in memory, else
(upsert mode, column types the CSV cannot carry, a server without LOCAL) by multi-row INSERTs;
a warning of the server fails the write."""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa

from twophase.sinks import _sql2pc as names
from twophase.sinks.mysql.branches import _Branches
from twophase.sinks.mysql.common import (
    _DEPRECATED_SYNTAX,
    _INSERT_TABLES,
    _INTEGER_TYPES,
    _LOAD_CHARSETS,
    _MAX_LISTED,
    _MAX_STATEMENT,
    _TEXT_TYPES,
    ER_LOCK_WAIT_TIMEOUT,
    MySqlTransaction,
    MySqlWriteError,
    _close_quietly,
    _Column,
    _errno,
    _my,
    log,
    quote_ident,
)
from twophase.sinks.mysql.values import (
    _csv_options,
    _csv_table,
    _py_value,
    _rows_per_statement,
    _time_text,
)

#: Server errors that mean "LOAD DATA LOCAL is not allowed here": MariaDB 4166, MySQL 3948, older 1148.
_LOCAL_INFILE_OFF = frozenset({1148, 3948, 4166})
#: (host, port) of servers that refused LOAD DATA LOCAL in this process: INSERT from then on.
_NO_LOCAL_INFILE: set[tuple[str, int]] = set()


class _Rows(_Branches):
    """Executor tasks: ``write``, each Arrow batch into the open branch, by LOAD DATA LOCAL of CSV
    or by multi-row INSERTs, every warning refused."""

    def _map_columns(self, txn: MySqlTransaction, schema: pa.Schema) -> list[str]:
        label = f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}, table {self.table})"
        lower = {c.lower(): c for c in txn.columns}
        out: list[str] = []
        for f in schema:
            # MySQL column names are case-insensitive, as Spark's JDBC writer matches them.
            name = f.name if f.name in txn.columns else lower.get(f.name.lower())
            if name is None:
                raise MySqlWriteError(f"{label}: the DataFrame column {f.name!r} is not a column of the table; "
                                      f"table columns: {', '.join(txn.columns)}", column=f.name)
            if txn.columns[name].generated:
                raise MySqlWriteError(f"{label}: column {name!r} is a generated column and cannot be written; "
                                      "drop it from the DataFrame", column=name)
            if name in out:
                # Both would be written to one column: INSERT refuses it (1110), LOAD DATA kept the last.
                raise MySqlWriteError(f"{label}: DataFrame columns {schema.names[out.index(name)]!r} and {f.name!r} "
                                      f"both map to the table's column {name!r} (names match case-insensitively); "
                                      "drop or rename one", column=name)
            out.append(name)
        present = set(out)
        for c in txn.columns.values():
            if c.name not in present and not c.nullable and not c.has_default and not c.generated:
                raise MySqlWriteError(f"{label}: the table's column {c.name!r} is NOT NULL without a default "
                                      "but the DataFrame has no such column", column=c.name)
        if self.mode == "upsert":
            auto = [n for n in out if txn.columns[n].auto_increment and n not in self.key_columns]
            if auto:
                # open() let a unique index on this AUTO_INCREMENT column pass because new rows take fresh
                # values; a written value could match another key's row (see _check_keys).
                raise MySqlWriteError(f"{label}: column {auto[0]!r} is AUTO_INCREMENT and not an upsert key "
                                      "column: a value written to it could make ON DUPLICATE KEY UPDATE overwrite "
                                      "the row of another key; drop it from the DataFrame (the server numbers "
                                      "new rows)", column=auto[0])
            missing = [k for k in self.key_columns if k not in present]
            if missing:
                raise MySqlWriteError(f"{label}: upsert key columns {missing} are missing from the DataFrame",
                                      column=missing[0])
        return out

    def _insert_sql(self, columns: list[str]) -> tuple[str, str, str]:
        """The multi-row INSERT as (head, one row's placeholders, tail).  Only the row is formatted
        with values (``cursor.mogrify``): the quoted names in head and tail reach the server as they
        are, a ``%`` in one included (PyMySQL's ``executemany`` %-formats the statement's head)."""
        cols = ", ".join(quote_ident(c) for c in columns)
        head = f"INSERT INTO {quote_ident(self.table)} ({cols}) VALUES "
        tail = ""
        if self.mode == "upsert":
            upd = names.update_columns(columns, self.key_columns)
            # No other column: a key already there keeps its row (a no-op update of the first key).
            upd = upd or [self.key_columns[0]]
            tail = " ON DUPLICATE KEY UPDATE " + ", ".join(f"{quote_ident(c)} = VALUES({quote_ident(c)})"
                                                           for c in upd)
        return head, f"({', '.join(['%s'] * len(columns))})", tail

    def write(self, txn: MySqlTransaction, batch: pa.RecordBatch) -> None:
        """Write one Arrow batch into the branch (executor): in insert mode by ``LOAD DATA LOCAL INFILE``
        of the batch as CSV made in memory by ``pyarrow.csv`` (see :meth:`_load`), else, and for column
        types the CSV cannot carry (nested, durations), by multi-row INSERTs."""
        my = _my()
        if batch.num_rows == 0:
            return
        if txn.insert_columns is None:
            txn.insert_columns = self._map_columns(txn, batch.schema)
            txn.extra["names"] = list(batch.schema.names)
            txn.extra["sql"] = self._insert_sql(txn.insert_columns)
        elif list(batch.schema.names) != txn.extra["names"]:
            raise MySqlWriteError(f"{txn.ctx.label}: Arrow batches of one partition changed columns "
                                  f"({txn.extra['names']} then {batch.schema.names})")
        if self.mode == "upsert":
            for k in self.key_columns:
                col = batch.column(txn.insert_columns.index(k))
                if col.null_count:
                    raise MySqlWriteError(
                        f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): upsert key column {k!r} is NULL in this "
                        "partition; a NULL key matches no row, so it cannot be upserted. Nothing of this batch "
                        "became visible; filter or fill NULL keys in Spark and restart the query.", column=k)
        self._refuse_non_finite(txn, batch)
        if self.mode == "insert" and (self.host, self.port) not in _NO_LOCAL_INFILE and self._loadable(txn, batch.schema):
            csv = _csv_table(batch)
            if csv is not None:
                step = _rows_per_statement(batch.num_columns)
                for off in range(0, batch.num_rows, step):
                    if not self._load(txn, csv.slice(off, step), min(step, batch.num_rows - off)):
                        if off:  # LOCAL refused after a part was loaded: INSERT would write it twice
                            raise MySqlWriteError(f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): the server "
                                                  "stopped allowing LOAD DATA LOCAL in the middle of a batch. The "
                                                  "branch is rolled back; nothing of this batch became visible.")
                        break
                else:
                    txn.rows += batch.num_rows
                    return
        cols = [[_py_value(v) for v in batch.column(i).to_pylist()] if not (
                    pa.types.is_duration(f.type) and txn.columns[name].data_type == "time")
                else [None if v is None else _time_text(v) for v in batch.column(i).to_pylist()]
                for i, (f, name) in enumerate(zip(batch.schema, txn.insert_columns))]
        rows = list(zip(*cols))
        head, row_sql, tail = txn.extra["sql"]
        label = f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual})"
        try:
            with txn.conn.cursor() as cur:
                self._list_every_note(txn, cur)

                def insert(values: list[str]) -> None:
                    # A server without strict mode stores a bad value with a warning (a string cut to
                    # the column's length): refused as the LOAD path refuses it.
                    cur.execute(head + ", ".join(values) + tail)
                    self._refuse_warnings(cur, label, "INSERT")

                step = min(self.insert_rows, _rows_per_statement(batch.num_columns))
                for i in range(0, len(rows), step):
                    values: list[str] = []
                    size = 0
                    for row in rows[i:i + step]:
                        v = cur.mogrify(row_sql, row)
                        if values and size + len(v) > _MAX_STATEMENT:  # as executemany splits
                            insert(values)
                            values, size = [], 0
                        values.append(v)
                        size += len(v) + 2
                    insert(values)
        except my.Error as e:
            raise MySqlWriteError(
                f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): INSERT into table {self.table} failed: "
                f"{self._describe(e)}.{self._lock_wait_hint(txn, e)} The branch is rolled back; nothing of this "
                "batch became visible.",
                errno=_errno(e)) from None
        txn.rows += batch.num_rows

    def _lock_wait_hint(self, txn: MySqlTransaction, e: BaseException) -> str:
        """For a write that gave up waiting on a row lock (1205), what holds it and what to do, else "".

        A prepared branch keeps its row locks until the driver commits the batch, after every partition
        prepared: a key written by two partitions of one batch makes the second wait on the first on
        every attempt and every run (a stall, not a loss).  ``XA RECOVER`` (on a connection of its own:
        this one is inside the branch) says whether a branch of this same ballot holds it: then it is
        that, by name; otherwise it names the other candidates."""
        if _errno(e) != ER_LOCK_WAIT_TIMEOUT:
            return ""
        table = quote_ident(self.table)
        keys = ", ".join(self.key_columns) if self.key_columns else "a unique index's columns"
        ballot = txn.gtrid[:txn.gtrid.rfind(":") + 1]
        mates: list[str] = []
        try:
            conn = self._connect()
            try:
                mates = sorted(f"partition {g[len(ballot):]} ({g}/{b})" for g, b in self._recover(conn)
                               if g.startswith(ballot) and g != txn.gtrid)
            finally:
                _close_quietly(conn)
        except Exception:  # noqa: BLE001 - only a hint: the advice below stands without it
            pass
        if mates:
            found = (f" A prepared XA branch of this same batch holds rows of table {table}: "
                     f"{', '.join(mates[:5])}{', ...' if len(mates) > 5 else ''}; so a key is written by two "
                     "partitions of this batch.")
        else:
            found = (f" A row lock on table {table} was held for lock_wait_timeout={self.lock_wait_timeout}s: by a "
                     "prepared XA branch of this batch (a key written by two partitions of one batch), of a late "
                     "attempt of an earlier batch, or another writer.")
        return (f"{found} Each partition's branch keeps its row locks until the driver commits the batch, after "
                "every partition prepared, so a key in two partitions of one batch fails the second one on every "
                f"attempt and every run: repartition the DataFrame by the key columns ({keys}), "
                "df.repartition(*keys), so that each key is written by one partition.")

    def _loadable(self, txn: MySqlTransaction, schema: pa.Schema) -> bool:
        """Whether LOAD DATA stores what the INSERT path stores in the mapped columns (asked once per
        transaction).  The CSV is UTF-8 and loaded ``CHARACTER SET binary`` (binary columns get their
        bytes as they are): a text column of another character set (latin1, utf16, ...) would get the
        UTF-8 bytes unconverted, without a warning; a BIT column reads "1" as a byte string (1264).
        LOAD reads every field as text, where INSERT sends numbers: a YEAR column reads "0" as 2000
        (INSERT's 0 is 0000), an integer column rounds a float's text "2.5" half up (INSERT's double
        half to even), and a text or JSON column keeps a number's, time's or timestamp's CSV spelling
        ("1e+20", "12:00:00.000000") where INSERT stores the server's ("1e20", "12:00:00").  Those
        tables are written by INSERT."""
        ok = txn.extra.get("loadable")
        if ok is None:
            def odd_one(c: _Column, t: pa.DataType) -> bool:
                if c.data_type in ("bit", "year"):
                    return True
                if c.charset is not None and c.charset not in _LOAD_CHARSETS:
                    return True
                if c.data_type in _INTEGER_TYPES and pa.types.is_floating(t):
                    return True
                return c.data_type in _TEXT_TYPES and not (
                    pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                    or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or pa.types.is_null(t)
                    or pa.types.is_dictionary(t))
            odd = [txn.columns[n] for n, f in zip(txn.insert_columns or [], schema) if odd_one(txn.columns[n], f.type)]
            ok = not odd
            txn.extra["loadable"] = ok
            if odd and self.table not in _INSERT_TABLES:
                _INSERT_TABLES.add(self.table)
                log.info("%s: table %s has columns LOAD DATA cannot write as INSERT does (%s): multi-row INSERT",
                         txn.ctx.label, quote_ident(self.table),
                         ", ".join(f"{c.name} {c.data_type}{' ' + c.charset if c.charset else ''}" for c in odd[:5]))
        return bool(ok)

    def _refuse_non_finite(self, txn: MySqlTransaction, batch: pa.RecordBatch) -> None:
        """NaN and infinities have no MySQL value: refused by name, whichever way the batch goes in
        (PyMySQL's INSERT escaping refuses them too; LOAD DATA would store 0 with a warning)."""
        import pyarrow.compute as pc

        assert txn.insert_columns is not None
        for i, f in enumerate(batch.schema):
            if (pa.types.is_float32(f.type) or pa.types.is_float64(f.type)) \
                    and batch.column(i).null_count < batch.num_rows:
                col = batch.column(i)
                if pc.any(pc.invert(pc.is_finite(col))).as_py():
                    raise MySqlWriteError(
                        f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): column {txn.insert_columns[i]!r} holds "
                        "NaN or an infinity, which MySQL cannot store. Nothing of this batch became visible; "
                        "replace them in Spark (e.g. with NULL) and restart the query.", column=txn.insert_columns[i])

    def _load(self, txn: MySqlTransaction, csv: pa.Table, num_rows: int) -> bool:
        """``LOAD DATA LOCAL INFILE`` of ``csv`` into the branch; False if the server does not allow it
        (``local_infile=OFF``: logged once per server and process, then INSERT is used).

        The file name is a fresh random one; the connection sends this buffer only to a request for
        exactly that name and refuses any other (:func:`_load_connection_class`).  With LOCAL the server
        turns a bad value, a NULL in a NOT NULL column or a duplicate key into a warning, even in strict
        mode: any warning, or a row count other than the batch's, fails the write."""
        import pyarrow.csv as pcsv

        my = _my()
        out = pa.BufferOutputStream()
        pcsv.write_csv(csv, out, _csv_options())
        name = f"twophase-{uuid.uuid4().hex}.csv"  # letters, digits, '-' and '.': a literal as it is
        cols = ", ".join(quote_ident(c) for c in txn.insert_columns or [])
        sql = (f"LOAD DATA LOCAL INFILE '{name}' INTO TABLE {quote_ident(self.table)} CHARACTER SET binary "
               "FIELDS TERMINATED BY ',' OPTIONALLY ENCLOSED BY '\"' ESCAPED BY '' LINES TERMINATED BY '\\n' "
               f"({cols})")
        label = f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual})"
        conn = txn.conn
        conn._twophase_infile = (name.encode(), out.getvalue())
        try:
            with conn.cursor() as cur:
                self._list_every_note(txn, cur)
                loaded = cur.execute(sql)  # no arguments: no %-formatting of the names
                self._refuse_warnings(cur, label, "LOAD DATA")
        except my.Error as e:
            if _errno(e) in _LOCAL_INFILE_OFF:
                if (self.host, self.port) not in _NO_LOCAL_INFILE:
                    _NO_LOCAL_INFILE.add((self.host, self.port))
                    log.warning("%s: the server at %s refuses LOAD DATA LOCAL INFILE (%s); writing by multi-row "
                                "INSERT instead (slower; SET GLOBAL local_infile = ON to load)", txn.ctx.label,
                                self.where, self._describe(e))
                return False
            raise MySqlWriteError(f"{label}: LOAD DATA into table {self.table} failed: {self._describe(e)}."
                                  f"{self._lock_wait_hint(txn, e)} The "
                                  "branch is rolled back; nothing of this batch became visible.",
                                  errno=_errno(e)) from None
        finally:
            conn._twophase_infile = None
        return self._loaded(label, loaded, num_rows)

    @staticmethod
    def _list_every_note(txn: MySqlTransaction, cur: Any) -> None:
        """Once per branch: every note listed by SHOW WARNINGS (a decimal rounded to the column's scale
        gives one per row), up to the server's maximum, so that notes can be told from warnings."""
        if not txn.extra.get("max_error_count"):
            cur.execute(f"SET SESSION max_error_count = {_MAX_LISTED}")
            txn.extra["max_error_count"] = True

    def _refuse_warnings(self, cur: Any, label: str, statement: str) -> None:
        """Fail the write if the statement just run left a warning (notes pass).

        Notes (1265: a value rounded to the column's scale, a timestamp stored as a DATE) are what
        INSERT does silently in strict mode; warnings are what strict mode refuses, and what a server
        without STRICT_TRANS_TABLES (or LOAD DATA in any mode) stores anyway: a string cut to the
        column's length, a NULL made 0, an out-of-range number clamped."""
        warnings = cur.warning_count
        if not warnings:
            return
        if warnings >= _MAX_LISTED:
            # The protocol's count stops at 65,535 (and so does the list): the true count, before
            # SHOW WARNINGS (which does not clear it).
            cur.execute("SHOW COUNT(*) WARNINGS")
            warnings = int(cur.fetchone()[0])
        cur.execute("SHOW WARNINGS")
        listed = cur.fetchall()
        # Notes, and 1287 (MySQL 8.0.20+ on every upsert: "'VALUES function' is deprecated"), which is
        # about the statement's syntax, not a value.
        bad = [w for w in listed if str(w[0]).lower() != "note" and w[1] != _DEPRECATED_SYNTAX]
        if not bad and len(listed) >= warnings:
            return
        if not bad:
            raise MySqlWriteError(
                f"{label}: {statement} into table {self.table} gave {warnings} notes or warnings, more than the "
                f"server lists ({len(listed)}): whether one is a warning cannot be told. The branch is rolled back; "
                "nothing of this batch became visible.")
        shown = "; ".join(f"{w[2]} [{str(w[0]).lower()} {w[1]}]" for w in (bad or listed)[:3])
        raise MySqlWriteError(
            f"{label}: {statement} into table {self.table} gave {warnings} warning(s): {self._redact(shown)}. "
            "The branch is rolled back; nothing of this batch became visible.")

    def _loaded(self, label: str, loaded: int, num_rows: int) -> bool:
        if loaded != num_rows:
            raise MySqlWriteError(f"{label}: LOAD DATA into table {self.table} stored {loaded} of {num_rows} rows. "
                                  "The branch is rolled back; nothing of this batch became visible.")
        return True
