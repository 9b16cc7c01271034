"""Detect columns that hold personal data, by their name and by their values.

Names are split into tokens (``pt_nm`` → ``pt``, ``nm``; ``DateOfBirth`` → ``date``,
``of``, ``birth``) and matched against the abbreviations exports use, so a disguised
name is still caught.  Values are matched on a sample (:data:`VALUE_SAMPLE`): a column
is flagged when at least :data:`VALUE_MATCH_SHARE` of its sampled values look like
e-mail addresses, phone numbers, national ids, dates, street addresses, person names or
free text, so a neutrally named column of e-mail addresses is caught too.

Detection is advice for the owner writing column rules, not a guarantee: the data map
lists what was found and why, and the rules decide.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from fedsec.data.limits import VALUE_MATCH_SHARE
from fedsec.data.profile import NUMBER_PATTERN

Category = Literal[
    "name", "email", "phone", "national_id", "birth_date", "date", "address", "free_text"
]

# Tokens (after splitting a column name) that mark a category.  Abbreviations are those
# hospital, bank and registry exports use.
_NAME_TOKENS: dict[Category, frozenset[str]] = {
    "name": frozenset(
        [
            "name",
            "names",
            "nm",
            "nme",
            "fname",
            "lname",
            "firstname",
            "lastname",
            "surname",
            "forename",
            "given",
            "family",
            "fullname",
            "patient",
            "pt",
            "pat",
            "initials",
            "maiden",
            "middle",
        ]
    ),
    "email": frozenset(["email", "mail", "emailaddress"]),
    "phone": frozenset(["phone", "tel", "telephone", "mobile", "cell", "fax", "msisdn", "phoneno"]),
    "national_id": frozenset(
        [
            "ssn",
            "sin",
            "nin",
            "nino",
            "nhs",
            "insee",
            "passport",
            "nationalid",
            "taxid",
            "tin",
            "npi",
            "mrn",
            "medicare",
            "medicaid",
            "idno",
            "pesel",
            "bsn",
            "personnummer",
            "aadhaar",
            "cpr",
        ]
    ),
    "birth_date": frozenset(
        ["dob", "birth", "birthdate", "bday", "birthday", "born", "dateofbirth"]
    ),
    "address": frozenset(
        [
            "address",
            "addr",
            "street",
            "str",
            "zip",
            "zipcode",
            "postcode",
            "postal",
            "city",
            "town",
            "residence",
            "housenumber",
        ]
    ),
    "free_text": frozenset(
        [
            "note",
            "notes",
            "comment",
            "comments",
            "remark",
            "remarks",
            "narrative",
            "freetext",
            "text",
            "memo",
            "description",
            "desc",
            "observation",
            "observations",
        ]
    ),
}
# Token pairs that mark a category together but not alone ("pt" + "id" is an id, and
# "pt" alone is a patient's name column only with "nm"/"name").
_NAME_PAIRS: tuple[tuple[Category, frozenset[str]], ...] = (
    ("national_id", frozenset({"social", "security"})),
    ("national_id", frozenset({"national", "id"})),
    ("national_id", frozenset({"record", "medical"})),
    ("birth_date", frozenset({"date", "birth"})),
)
# Tokens that alone would be too eager: "pt" and "patient" name a person only next to a
# name-ish token; "patient_id" is an identifier, "str" a street only as a whole name.
_WEAK_TOKENS = frozenset({"pt", "pat", "patient", "str", "given", "family", "middle", "desc"})

_NUMBER = re.compile(NUMBER_PATTERN)
_PHONE_SHAPE = re.compile(r"^\+?[0-9 ().-]+$")
# Checked in this order: a date or an SSN also has a phone number's shape.
_VALUE_PATTERNS: tuple[tuple[Category, re.Pattern[str]], ...] = (
    ("email", re.compile(r"^[\w.+-]+@[\w-]+(\.[\w-]+)+$")),
    ("national_id", re.compile(r"^(\d{3}-\d{2}-\d{4}|[A-Z]{2}\d{6}[A-D]|\d{3} \d{3} \d{4})$")),
    ("date", re.compile(r"^(\d{4}-\d{2}-\d{2}|\d{1,2}[/.]\d{1,2}[/.]\d{2,4})([ T].*)?$")),
    (
        "address",
        re.compile(
            r"^\d+[A-Za-z]?,? .*\b(street|st|road|rd|avenue|ave|lane|ln|boulevard|blvd|drive|"
            r"dr|way|place|pl|court|ct|square|sq|rue|strasse|straße|weg|via|calle)\b",
            re.IGNORECASE,
        ),
    ),
    # Capitalised words, Latin-1 letters included (Müller, Łukasz is missed: a sample of
    # mostly such names still passes the share)
    ("name", re.compile(r"^[A-ZÀ-Þ][a-zß-ÿ'\-]+( [A-Z]\.?)?( [A-ZÀ-Þ][a-zß-ÿ'\-]+){1,2}$")),
)


def _is_phone(value: str) -> bool:
    """7 to 15 digits with phone punctuation, and not a plain number."""
    if _NUMBER.match(value) or not _PHONE_SHAPE.match(value):
        return False
    return 7 <= sum(c.isdigit() for c in value) <= 15


_TOKEN_SPLIT = re.compile(r"[^0-9a-zA-Z]+|(?<=[a-z])(?=[A-Z])")
#: A free-text cell: several words and long enough to be a sentence.
_FREE_TEXT_MIN_CHARS = 30
_FREE_TEXT_MIN_WORDS = 5


@dataclass(frozen=True)
class Finding:
    """A column flagged as sensitive: the category, and what gave it away."""

    column: str
    category: Category
    by: Literal["name", "values"]
    evidence: str  # the matching name tokens, or the share of sampled values matching


def name_tokens(column: str) -> list[str]:
    """``pt_nm`` → ``["pt", "nm"]``; ``DateOfBirth`` → ``["date", "of", "birth"]``."""
    return [t.lower() for t in _TOKEN_SPLIT.split(column) if t]


def by_name(column: str) -> Finding | None:
    """The category a column's name points to, if any."""
    tokens = name_tokens(column)
    joined = "".join(tokens)
    token_set = set(tokens) | {joined}
    for category, pair in _NAME_PAIRS:
        if pair <= token_set:
            return Finding(column, category, "name", "+".join(sorted(pair)))
    strong = token_set - _WEAK_TOKENS
    for category, words in _NAME_TOKENS.items():
        hit = sorted(strong & words)
        if hit:
            return Finding(column, category, "name", ",".join(hit))
    weak = token_set & _WEAK_TOKENS
    if weak and ("nm" in token_set or "name" in token_set):
        return Finding(column, "name", "name", ",".join(sorted(weak)))
    return None


def by_values(column: str, sample: Sequence[str]) -> Finding | None:
    """The category most of a column's sampled values match, if any."""
    values = [v for v in sample if v]
    if not values:
        return None
    tests: list[tuple[Category, Callable[[str], object]]] = [
        (category, pattern.match) for category, pattern in _VALUE_PATTERNS
    ]
    tests.insert(3, ("phone", _is_phone))
    for category, test in tests:
        share = sum(1 for v in values if test(v)) / len(values)
        if share >= VALUE_MATCH_SHARE:
            if category == "date" and _looks_like_birth_dates(values):
                category = "birth_date"
            return Finding(column, category, "values", f"{share:.0%} of sampled values")
    words = sum(
        1
        for v in values
        if len(v) >= _FREE_TEXT_MIN_CHARS and len(v.split()) >= _FREE_TEXT_MIN_WORDS
    )
    share = words / len(values)
    if share >= VALUE_MATCH_SHARE:
        return Finding(column, "free_text", "values", f"{share:.0%} of sampled values")
    return None


def _looks_like_birth_dates(values: Sequence[str]) -> bool:
    """Dates spread over decades before now are birth dates, not visit dates."""
    years = [int(m.group(0)) for v in values if (m := re.search(r"(19|20)\d{2}", v))]
    return len(years) >= 10 and max(years) - min(years) >= 30


def detect(column: str, sample: Sequence[str]) -> Finding | None:
    """A column's finding: by name first (cheap, explains itself), else by values."""
    return by_name(column) or by_values(column, sample)
