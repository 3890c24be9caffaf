"""Structured-output requests for tests and benchmarks: 20 varied JSON schemas (nested objects,
enums, arrays, bounded numbers, required fields), regexes and choices, each with a chat prompt."""

from __future__ import annotations

_FIELDS = {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number", "minimum": 0, "maximum": 10},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "active": {"type": "boolean"},
    "address": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["city", "zip"],
        "additionalProperties": False,
    },
    "ratings": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    "size": {"enum": ["small", "medium", "large"]},
    "price": {"type": "integer", "minimum": 1, "maximum": 999},
}
_NAMES = list(_FIELDS)
_TOPICS = ["person", "city", "product", "pet", "book", "car", "planet", "movie", "song", "tree"]


def json_schema_cases(count: int = 20) -> list[tuple[str, dict]]:
    """(question, schema) pairs; every schema differs in its fields or which are required."""
    cases = []
    for i in range(count):
        names = [_NAMES[(i + k * 3) % len(_NAMES)] for k in range(2 + i % 3)]
        names = list(dict.fromkeys(names))
        required = names if i % 2 == 0 else names[:1]
        schema = {
            "type": "object",
            "properties": {n: _FIELDS[n] for n in names},
            "required": required,
            "additionalProperties": False,
        }
        topic = _TOPICS[i % len(_TOPICS)]
        cases.append((f"Describe a {topic} as a JSON object with the fields {', '.join(names)}.", schema))
    return cases


REGEX_CASES = [
    ("Give me a phone number.", r"\d{3}-\d{3}-\d{4}"),
    ("What is today's date?", r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("Name a colour in lower case.", r"[a-z]{3,10}"),
    ("Give an IPv4 address.", r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"),
    ("Write a time of day.", r"([01]\d|2[0-3]):[0-5]\d"),
    ("Say yes or no, then why, briefly.", r"(Yes|No), [a-z ]{1,30}\."),
]

CHOICE_CASES = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Is the sky blue?", ["yes", "no"]),
    ("How do you feel today?", ["happy", "sad", "neutral"]),
    ("Which is a fruit?", ["apple", "carrot", "potato"]),
    ("Pick a number.", ["one", "two", "three", "four"]),
    ("Which animal barks?", ["cat", "dog", "cow"]),
]
