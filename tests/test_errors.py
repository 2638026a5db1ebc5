"""``persia_planner.errors``: every error is one line of readable length, whatever value it shows."""

from __future__ import annotations

import time

from persia_planner.errors import MAX_LINE_CHARS, PlannerError, SpecError, abbreviate, clip, one_line


def test_a_long_message_is_cut_in_its_middle_and_keeps_its_fix():
    err = SpecError("model.yaml", "tables[0].rows", f"{10**1000} is too large", fixes=("use at most 2**44",))
    line = str(err)
    assert len(line) <= MAX_LINE_CHARS
    assert line.startswith("model.yaml: tables[0].rows: 1000") and line.endswith(
        " is too large; fix: use at most 2**44"
    )
    assert "..." in line


def test_long_fixes_are_cut_too():
    line = str(PlannerError("short", fixes=("x" * 1000,)))
    assert len(line) <= MAX_LINE_CHARS and line.startswith("short; fix: xxx")


def test_one_line_joins_lines_and_caps_the_length():
    assert one_line("a\n  b\tc") == "a b c"
    assert len(one_line("y" * 10_000)) == MAX_LINE_CHARS
    assert clip("abcdef", 10) == "abcdef"


def test_abbreviate_is_cheap_for_an_alias_bomb():
    value: list = ["x"] * 9
    for _ in range(30):  # 9**30 leaves, shared: repr() would never end
        value = [value] * 9
    start = time.perf_counter()
    shown = abbreviate(value)
    assert time.perf_counter() - start < 0.5 and len(shown) <= 80
    assert abbreviate("fp8") == "'fp8'" and abbreviate(-5) == "-5"


def test_printable_escapes_what_a_terminal_would_act_on_and_nothing_else():
    from persia_planner.errors import printable, unprintable

    assert printable("dlrm[v2] é 中 [/]") == "dlrm[v2] é 中 [/]" and unprintable("dlrm[v2]") is None
    assert printable("a\x1b[2Jb\x07") == "a\\x1b[2Jb\\x07" and unprintable("a\x1b[2Jb") == "\\x1b"
    assert printable("x\u202ey\ud800") == "x\\u202ey\\ud800" and unprintable("\x9b") == "\\x9b"
    assert str(PlannerError("bad name a\x1b]0;t\x07", fixes=("rename a\x1b",))) == (
        "bad name a\\x1b]0;t\\x07; fix: rename a\\x1b"
    )
