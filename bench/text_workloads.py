"""Repetition-rich prompts for speculative decoding: a model asked to edit code or quote text it
was given copies long runs of its prompt, which n-gram lookup proposes.

The text comes from the running Python's standard library (functions' source and modules'
docstrings), so the prompts need no download and are the same on every machine with the same
Python; the chosen sources are listed by name, not sampled.

    edit:  "Add type hints to this function", with one function's source (code)
    quote: "Repeat this passage", with one module's docstring (prose)
    rep:   edit and quote alternating
"""

from __future__ import annotations

import importlib
import inspect
import random

# (module, function) whose source the edit prompts carry: 15-60 lines each
EDIT_SOURCES = [
    ("textwrap", "dedent"),
    ("textwrap", "indent"),
    ("textwrap", "shorten"),
    ("statistics", "median_grouped"),
    ("statistics", "mode"),
    ("statistics", "quantiles"),
    ("json.encoder", "py_encode_basestring_ascii"),
    ("shlex", "split"),
    ("shlex", "quote"),
    ("fnmatch", "translate"),
    ("difflib", "get_close_matches"),
    ("difflib", "unified_diff"),
    ("heapq", "merge"),
    ("heapq", "nsmallest"),
    ("functools", "total_ordering"),
    ("glob", "_iglob"),
    ("shutil", "copyfileobj"),
    ("shutil", "which"),
    ("base64", "b64decode"),
    ("colorsys", "rgb_to_hls"),
    ("calendar", "monthrange"),
    ("string", "capwords"),
    ("textwrap", "wrap"),
    ("csv", "Sniffer"),
]
# modules whose docstrings the quote prompts carry
QUOTE_SOURCES = [
    "difflib", "heapq", "statistics", "csv", "argparse", "json", "sched", "tokenize", "typing",
    "collections", "configparser", "copy", "doctest", "hashlib", "inspect", "os", "pydoc", "random",
    "re", "shelve", "socket", "subprocess", "timeit", "unittest",
]  # fmt: skip
WORKLOADS = ("edit", "quote", "rep")


def _function_source(module: str, name: str, max_lines: int = 60) -> str:
    obj = getattr(importlib.import_module(module), name)
    lines = inspect.getsource(obj).splitlines()
    return "\n".join(lines[:max_lines])


def _docstring(module: str, max_chars: int = 1600) -> str:
    doc = inspect.getdoc(importlib.import_module(module)) or module
    return doc[:max_chars].rsplit("\n", 1)[0] if len(doc) > max_chars else doc


def prompts(kind: str, n: int) -> list[str]:
    """``n`` user messages of the workload ``kind`` (cycling through its sources)."""
    if kind == "rep":
        edit, quote = prompts("edit", (n + 1) // 2), prompts("quote", n // 2)
        return [p for pair in zip(edit, quote + [None], strict=False) for p in pair if p][:n]
    out = []
    for i in range(n):
        if kind == "edit":
            module, name = EDIT_SOURCES[i % len(EDIT_SOURCES)]
            code = _function_source(module, name)
            out.append(
                f"Add type hints to this Python function. Reply with the whole function.\n```python\n{code}\n```"
            )
        elif kind == "quote":
            text = _docstring(QUOTE_SOURCES[i % len(QUOTE_SOURCES)])
            out.append(f"Repeat the following passage word for word.\n\n{text}")
        else:
            raise ValueError(f"unknown workload {kind!r}; choose from {WORKLOADS}")
    return out


def workload(kind: str, n: int, tokenizer, out_lo: int = 64, out_hi: int = 192, seed: int = 0):
    """``n`` (prompt token ids, output length) pairs: chat-templated prompts of ``kind``, output
    lengths drawn uniformly from [out_lo, out_hi] (seeded)."""
    rng = random.Random(seed)
    reqs = []
    for text in prompts(kind, n):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # a BatchEncoding in newer transformers
            ids = list(ids["input_ids"])
        reqs.append((list(ids), rng.randint(out_lo, out_hi)))
    return reqs
