"""The JSON-lines reader (``rhyme_jax.io.jsonl``): records and errors name ``<path>:<line>``."""

import pytest

from rhyme_jax.io.jsonl import JsonLine, JsonlError, parse_jsonl, read_jsonl


def test_reads_values_in_order_skipping_blank_lines(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"step": 1, "x": 0.5}\n\n   \n[1, "two"]\n"caf\u00e9"\n7', encoding="utf-8")
    got = list(read_jsonl(f))
    assert [(r.lineno, r.value) for r in got] == [(1, {"step": 1, "x": 0.5}), (4, [1, "two"]), (5, "café"),
                                                   (6, 7)]
    assert got[1].where == f"{f}:4" and got[1].path == f and isinstance(got[1], JsonLine)
    assert list(read_jsonl(str(f)))[0].where == f"{f}:1"  # a str path too
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert list(read_jsonl(tmp_path / "empty.jsonl")) == []


def test_malformed_line_names_file_and_line(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text('{"a": 1}\n\n{"a": \n{"a": 3}\n')
    records = read_jsonl(f)
    assert next(records).value == {"a": 1}  # lazy: the good lines before the bad one come first
    with pytest.raises(JsonlError) as info:
        next(records)
    exc = info.value
    assert str(exc) == f"{f}:3: not valid JSON (Expecting value at column 7)"
    assert (exc.path, exc.lineno, exc.where, exc.kind, exc.detail) == (f, 3, f"{f}:3", "json",
                                                                       "Expecting value at column 7")
    assert isinstance(exc, ValueError)


def test_not_utf8_names_the_line(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_bytes(b'{"a": "\xff"}\n')
    with pytest.raises(JsonlError, match=r"c.jsonl:1: not UTF-8 text \(invalid start byte\)") as info:
        list(read_jsonl(f))
    assert info.value.kind == "utf-8"


def test_missing_file_raises_on_the_call(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_jsonl(tmp_path / "nope.jsonl")  # before any iteration


def test_parse_lines_already_read():
    lines = '{"step": 0}\n\n{"step": 1}\n{"st'.split("\n")
    records = parse_jsonl(lines, "m.jsonl")
    assert [(r.where, r.value) for r in (next(records), next(records))] == [("m.jsonl:1", {"step": 0}),
                                                                           ("m.jsonl:3", {"step": 1})]
    with pytest.raises(JsonlError, match=r"^m.jsonl:4: not valid JSON \(Unterminated string"):
        next(records)
