"""Where a member's records come from: CSV and Parquet files, SQL databases.

Every source is read in chunks (Arrow record batches), never whole, so the inventory
of a table larger than memory runs in bounded memory.  A source yields
:class:`Chunk`\\ s that carry the row number of their first row, so any later error
can name the row.

SQL sources are read through SQLAlchemy with the credentials the owner configures,
in the URL or in a ``password_file``.  Credentials never leave this module: a source's
:attr:`Source.name` and every error message show the URL without user or password
(:func:`redact_url`), and a driver message that quotes them is scrubbed.
"""

from __future__ import annotations

import csv
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from fedsec.data.limits import CHUNK_ROWS, CSV_BLOCK_BYTES, DB_CONNECT_TIMEOUT_S
from fedsec.data.settings import SourceSpec
from fedsec.errors import ConfigError


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of a source; ``first_row`` is the 1-based record number of
    the first (for CSV, the file's line number is ``first_row + 1``)."""

    first_row: int
    columns: dict[str, pa.Array]

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0


class Source(Protocol):
    name: str

    def chunks(self) -> Iterator[Chunk]:
        """The records, chunk by chunk; a fresh pass on every call.

        Raises:
            ConfigError: naming the source (and row, where one is at fault).
        """
        ...

    def fingerprint(self) -> str:
        """A short value that changes when the records may have changed."""
        ...


def open_source(spec: SourceSpec) -> Source:
    """The reader for ``spec``.

    Raises:
        ConfigError: a setting the kind needs is missing or does not fit the kind.
    """
    if spec.kind in ("csv", "parquet"):
        if not spec.path or spec.url or spec.query:
            raise ConfigError(f"a {spec.kind} source takes a path (and no url or query)")
        if spec.kind == "csv":
            return CsvSource(spec)
        return ParquetSource(spec)
    if not spec.url or not spec.query or spec.path:
        raise ConfigError("an sql source takes a url and a query (and no path)")
    return SqlSource(spec)


def _file_fingerprint(path: Path, label: str) -> str:
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {path}: {exc.strerror or exc}") from None
    return f"{st.st_size}:{st.st_mtime_ns}"


# -- CSV -------------------------------------------------------------------------------


class CsvSource:
    """A CSV file with a header row; every cell is read as text and typed later, so a
    mixed-type column is reported by the profile rather than failing the parse."""

    def __init__(self, spec: SourceSpec) -> None:
        self.path = Path(spec.path)
        self.name = spec.name or f"csv:{self.path.name}"
        self.delimiter = spec.delimiter
        self.encoding = spec.encoding
        if len(self.delimiter) != 1:
            raise ConfigError(f"{self.name}: delimiter must be one character")

    def fingerprint(self) -> str:
        return _file_fingerprint(self.path, self.name)

    def header(self) -> list[str]:
        """The column names.

        Raises:
            ConfigError: missing or empty file, undecodable or duplicate names.
        """
        try:
            with self.path.open("rb") as fh:
                first = fh.readline()
        except OSError as exc:
            raise ConfigError(
                f"{self.name}: cannot read {self.path}: {exc.strerror or exc}"
            ) from None
        try:
            text = first.decode(self.encoding).lstrip("\ufeff").rstrip("\r\n")
        except UnicodeDecodeError:
            raise ConfigError(
                f"{self.name}: line 1 (the header) is not {self.encoding} text"
            ) from None
        if not text.strip():
            raise ConfigError(f"{self.name}: the file is empty; a header row is required")
        names = [h.strip() for h in next(csv.reader([text], delimiter=self.delimiter))]
        dupes = sorted({h for h in names if names.count(h) > 1})
        if dupes:
            raise ConfigError(f"{self.name}: duplicate column names {dupes}")
        if any(not h for h in names):
            raise ConfigError(f"{self.name}: a column in the header has no name")
        return names

    def chunks(self) -> Iterator[Chunk]:
        import pyarrow.csv as pacsv

        names = self.header()
        read = pacsv.ReadOptions(
            column_names=names,
            skip_rows=1,
            block_size=CSV_BLOCK_BYTES,
            encoding=self.encoding,
        )
        parse = pacsv.ParseOptions(delimiter=self.delimiter)
        convert = pacsv.ConvertOptions(
            column_types={n: pa.string() for n in names}, strings_can_be_null=False
        )
        row = 1
        try:
            reader = pacsv.open_csv(
                self.path, read_options=read, parse_options=parse, convert_options=convert
            )
            for batch in reader:
                chunk = Chunk(row, {n: batch.column(i) for i, n in enumerate(names)})
                row += batch.num_rows
                yield chunk
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            raise ConfigError(self._explain(exc, names)) from None
        except OSError as exc:
            raise ConfigError(f"{self.name}: cannot read {self.path}: {exc}") from None

    def _explain(self, exc: Exception, names: list[str]) -> str:
        """Turn an Arrow parse error into the line and column at fault."""
        bad = _first_undecodable_line(self.path, self.encoding, self.delimiter)
        if bad is not None:
            line, field = bad
            column = names[field] if field < len(names) else f"#{field + 1}"
            return (
                f"{self.name}: line {line} column '{column}' is not {self.encoding} text; "
                "re-export the file as UTF-8 or set the source's encoding"
            )
        message = str(exc).splitlines()[0]
        fields = re.search(r"Expected (\d+) columns, got (\d+)", message)
        if fields:
            bad_line = _line_with_fields(self.path, self.delimiter, len(names))
            where = f"line {bad_line}" if bad_line else "a line"
            return (
                f"{self.name}: {where} has {fields.group(2)} fields, the header has "
                f"{fields.group(1)}"
            )
        return f"{self.name}: cannot parse the file: {message}"


def _first_undecodable_line(path: Path, encoding: str, delimiter: str) -> tuple[int, int] | None:
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                raw.decode(encoding)
            except UnicodeDecodeError as err:
                field = raw[: err.start].count(delimiter.encode(encoding, "replace"))
                return line_no, field
    return None


def _line_with_fields(path: Path, delimiter: str, expected: int) -> int | None:
    with path.open(newline="", encoding="utf-8", errors="replace") as fh:
        for line_no, record in enumerate(csv.reader(fh, delimiter=delimiter), start=1):
            if record and len(record) != expected:
                return line_no
    return None


# -- Parquet -------------------------------------------------------------------------------


class ParquetSource:
    """A Parquet file, read row group by row group in chunks of :data:`CHUNK_ROWS`."""

    def __init__(self, spec: SourceSpec) -> None:
        self.path = Path(spec.path)
        self.name = spec.name or f"parquet:{self.path.name}"

    def fingerprint(self) -> str:
        return _file_fingerprint(self.path, self.name)

    def chunks(self) -> Iterator[Chunk]:
        import pyarrow.parquet as pq

        try:
            reader = pq.ParquetFile(self.path)
        except FileNotFoundError:
            raise ConfigError(f"{self.name}: file {self.path} does not exist") from None
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"{self.name}: not a readable Parquet file: {exc}") from None
        row = 1
        try:
            for batch in reader.iter_batches(batch_size=CHUNK_ROWS):
                names = batch.schema.names
                yield Chunk(row, {n: batch.column(i) for i, n in enumerate(names)})
                row += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"{self.name}: cannot read row {row} onwards: {exc}") from None


# -- SQL ----------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """``driver://host:port/database`` without user, password or query parameters."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return "sql:<unparsable url>"
    host = parsed.host or ""
    port = f":{parsed.port}" if parsed.port else ""
    database = parsed.database or ""
    if parsed.get_backend_name() == "sqlite":
        database = Path(database).name if database else ":memory:"
    return f"{parsed.drivername}://{host}{port}/{database}"


def check_private_file(path: Path, what: str) -> None:
    """Refuse a file holding credentials that others than its owner may read.

    Raises:
        ConfigError: the file is missing, or group or others have any access to it.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if stat.S_IMODE(mode) & 0o077:
        raise ConfigError(
            f"{what} {path} holds secrets but others may read it (mode "
            f"{stat.S_IMODE(mode):04o}); run chmod 600 {path}"
        )


def url_has_password(url: str) -> bool:
    """Whether a SQLAlchemy URL carries a password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).password is not None
    except ArgumentError:
        return False


class SqlSource:
    """The rows of a query, streamed from the server with a server-side cursor."""

    def __init__(self, spec: SourceSpec) -> None:
        self.url = spec.url
        self.query = spec.query
        self.password_file = Path(spec.password_file) if spec.password_file else None
        self.name = spec.name or f"sql:{redact_url(spec.url)}"
        self._secrets: tuple[str, ...] = ()

    def fingerprint(self) -> str:
        # A database has no cheap content hash; the training pass re-checks the counts.
        return "sql"

    def _engine(self) -> Any:
        import sqlalchemy
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(self.url)
        except ArgumentError:
            raise ConfigError(f"{self.name}: the url is not an SQLAlchemy URL") from None
        if self.password_file is not None:
            check_private_file(self.password_file, f"{self.name}: password_file")
            password = self.password_file.read_text(encoding="utf-8").strip()
            url = url.set(password=password)
        self._secrets = tuple(s for s in (url.password, url.username) if s)
        connect_args: dict[str, Any] = {}
        if url.get_backend_name() == "postgresql":
            connect_args["connect_timeout"] = DB_CONNECT_TIMEOUT_S
        try:
            return sqlalchemy.create_engine(url, connect_args=connect_args)
        except (ArgumentError, ModuleNotFoundError) as exc:
            raise ConfigError(f"{self.name}: cannot use this database: {exc}") from None

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(str(secret), "***")
        return text

    def chunks(self) -> Iterator[Chunk]:
        import sqlalchemy
        from sqlalchemy.exc import DBAPIError, SQLAlchemyError

        engine = self._engine()
        try:
            try:
                conn = engine.connect()
            except SQLAlchemyError as exc:
                raise ConfigError(
                    f"{self.name}: cannot connect to the database: {self._detail(exc)}"
                ) from None
            row = 1
            with conn:
                try:
                    result = conn.execution_options(stream_results=True).execute(
                        sqlalchemy.text(self.query)
                    )
                    if not result.returns_rows:
                        raise ConfigError(f"{self.name}: the query returns no result set")
                    names = list(result.keys())
                    for rows in result.partitions(CHUNK_ROWS):
                        chunk = Chunk(row, _columns(names, rows))
                        row += len(rows)
                        yield chunk
                except DBAPIError as exc:
                    where = "the query failed" if row == 1 else f"reading row {row} failed"
                    raise ConfigError(f"{self.name}: {where}: {self._detail(exc)}") from None
                except SQLAlchemyError as exc:
                    raise ConfigError(f"{self.name}: {self._detail(exc)}") from None
        finally:
            engine.dispose()
        if row == 1:
            raise ConfigError(f"{self.name}: the query returned no rows")

    def _detail(self, exc: Exception) -> str:
        orig = getattr(exc, "orig", None)
        text = str(orig if orig is not None else exc).strip()
        return self._scrub(text.splitlines()[0] if text else type(exc).__name__)


def _columns(names: list[str], rows: Any) -> dict[str, pa.Array]:
    out: dict[str, pa.Array] = {}
    for i, name in enumerate(names):
        values = [r[i] for r in rows]
        try:
            arr = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            arr = pa.array([None if v is None else str(v) for v in values], type=pa.string())
        if pa.types.is_decimal(arr.type):
            arr = arr.cast(pa.float64())
        out[name] = arr
    return out
