"""Limits of the data layer, each with the reason for its value."""

from __future__ import annotations

#: Rows per chunk read from Parquet and SQL.  64 Ki rows of 50 columns is a few MiB of
#: Arrow memory: large enough that per-chunk Python work is noise next to the C++
#: kernels, small enough that memory stays flat whatever the table's size.
CHUNK_ROWS = 65_536

#: Bytes per CSV block handed to the Arrow reader; its rows per chunk follow from it.
#: The reader parses several blocks ahead on its threads, so memory grows with the block:
#: measured on a 545 MB, 1,000,000 x 50 CSV, peak RSS 315 MB at 4 MiB against 763 MB at
#: 16 MiB, for the same scan time within the noise.
CSV_BLOCK_BYTES = 4 * 1024 * 1024

#: Distinct values counted exactly per column.  A column above it is an identifier,
#: a measurement or free text, not a category, and its distinct count is reported as
#: "more than"; tracking stops so memory stays bounded on a million unique values.
MAX_DISTINCT = 1_000

#: Non-missing values per column kept for sensitive-value detection.  500 values give a
#: match share within a few points of the column's, and regexes over them cost
#: milliseconds.
VALUE_SAMPLE = 500

#: Share of sampled values that must match a value pattern (e-mail, phone, ...) for the
#: column to be flagged.  Below 1 so a few malformed entries do not hide a column of
#: e-mail addresses; well above what a free-text column matches by chance.
VALUE_MATCH_SHARE = 0.6

#: Categories listed per column in the data map; the rest are counted.
CATEGORIES_SHOWN = 20

#: Seconds to wait for a database connection before saying it is down.
DB_CONNECT_TIMEOUT_S = 10

#: Cells spelt this way count as missing, in any case; the spellings spreadsheet and
#: statistics exports (Excel, R, pandas, SAS) write for "no value".
MISSING_TOKENS = ("", "na", "n/a", "nan", "null", "none", "?", ".", "-", "#n/a")

#: Unreadable files named in an image folder's inventory; the rest are counted.  A
#: folder with more is broken as a whole (a wrong export), and a few names show how.
UNREADABLE_SHOWN = 20

#: Distinct image sizes listed in an image folder's inventory (the most frequent); an
#: export has one or a few, a folder of photos many, and the top ones tell them apart.
IMAGE_SIZES_SHOWN = 10
