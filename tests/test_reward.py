"""Tests of reward.py: the GSM8K golds, a table of answer formats, hostile inputs, and properties.

Expected values come from outside the verifier: the dataset's own golds, hand-written cases, and
Python's own formatting of integers and fractions (`f"{g:,}"`, `Fraction`) in the property tests.
"""

import json
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tests")):  # run from anywhere, with or without a conftest
    if p not in sys.path:
        sys.path.insert(0, p)

from hostile import hostile_inputs  # noqa: E402
from reward import WINDOW, extract_answer, math_reward, parse_number  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


# ---------------------------------------------------------------- GSM8K golds


def _gsm8k_rows():
    path = DATA / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K data not found at {path}")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def test_gsm8k_every_gold_matches_and_near_misses_do_not():
    rows = _gsm8k_rows()
    assert len(rows) > 1000
    for row in rows:
        reasoning, raw_gold = row["answer"].rsplit("####", 1)
        gold = raw_gold.strip().replace(",", "")
        g = int(gold)  # every GSM8K test gold is an integer
        assert parse_number(gold) == g
        # The dataset's own solution text (with its <<calculator>> notes) is a correct completion,
        # and so is the reasoning followed by the comma-free gold, or the comma-formatted gold.
        assert math_reward(row["answer"], gold) == 1.0
        assert math_reward(reasoning + "\n#### " + gold, gold) == 1.0
        assert math_reward(reasoning + "\n#### " + f"{g:,}", gold) == 1.0
        # Perturbations: off by one, and a digit appended (x10 + 7, never equal to g).
        for wrong in (str(g + 1), gold + "7"):
            assert math_reward(reasoning + "\n#### " + wrong, gold) == 0.0, (gold, wrong)


# ---------------------------------------------------------------- formats, table-driven


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("#### 1,234", "1234", 1.0),
        ("#### 1234", "1,234", 1.0),
        ("#### 1,234,567", "1234567", 1.0),
        ("#### $18", "18", 1.0),
        ("#### \\$18", "18", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### \u22123", "-3", 1.0),  # U+2212 minus
        ("#### \u22123", "3", 0.0),
        ("#### 0.5", "1/2", 1.0),
        ("#### .5", "0.5", 1.0),
        ("#### \\frac{1}{2}", "0.5", 1.0),
        ("#### \\dfrac{1}{2}", "1/2", 1.0),
        ("#### \\tfrac12", "1/2", 1.0),
        ("so \\boxed{\\frac{3}{4}}.", "0.75", 1.0),
        ("so \\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
        ("#### 42.0", "42", 1.0),
        ("#### 42.", "42", 1.0),
        ("#### 42.5", "42", 0.0),
        ("#### 50%", "50", 1.0),  # deviation 2: % is a unit
        ("#### 50%", "0.5", 0.0),
        ("#### 1\\,234", "1234", 1.0),
        ("#### 1{,}234", "1234", 1.0),
        ("#### 1,23", "123", 0.0),  # bad grouping
        ("#### 1 234", "1234", 0.0),  # split digits
        ("#### 18 dollars", "18", 0.0),  # strict: no units
        ("#### 18 \\text{ dollars}", "18", 0.0),
        ("#### 7\n#### 8", "8", 1.0),  # last #### wins
        ("#### 7\n#### 8", "7", 0.0),
        ("\\boxed{7} then \\boxed{8}", "8", 1.0),  # last \boxed wins
        ("\\boxed{7} then \\boxed{8}", "7", 0.0),
        ("\\boxed{7}\n#### 8", "8", 1.0),  # #### beats \boxed
        ("#### 8\n\\boxed{7}", "7", 0.0),
        ("\\boxed{\\boxed{7}}", "7", 1.0),  # nested: the innermost
        ("\\boxed{7} \\boxed{8", "7", 1.0),  # unterminated \boxed{ ignored
        ("-48", "-48", 1.0),  # bare-number completion
        ("  -48\n", "-48", 1.0),
        ("-48", "48", 0.0),
        ("3/4", "0.75", 1.0),
        ("the answer is 48", "48", 0.0),  # no marker, not a bare number
        ("", "0", 0.0),
        ("no answer here", "5", 0.0),
        ("#### ", "0", 0.0),
        ("####", "0", 0.0),
        ("\\boxed{5}\n####", "5", 0.0),  # an empty last #### is final
        ("\\boxed{}", "0", 0.0),
        ("#### ٤٢", "42", 0.0),  # Arabic-Indic digits rejected
        ("#### ４２", "42", 0.0),  # fullwidth digits rejected
        ("٤٢", "42", 0.0),
        ("#### 1e3", "1000", 0.0),  # no exponent notation
        ("#### 2^10", "1024", 0.0),
        ("#### 10**3", "1000", 0.0),
        ("#### 4\x002", "42", 0.0),  # NUL inside
        ("#### 1/0", "0", 0.0),
        ("#### --3", "3", 0.0),
        ("#### (3, \\frac{\\pi}{2})", "(3,\\frac{\\pi}{2})", 1.0),  # non-numeric gold: string match
        ("#### (3, \\pi)", "(3,\\frac{\\pi}{2})", 0.0),
        ("#### 072", "72", 1.0),  # leading zero is the same number
    ],
)
def test_math_reward_formats(completion, gold, expected):
    assert math_reward(completion, gold) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Reasoning.\n#### 1,234\nDone.", "1,234"),
        ("#### 5\n#### 6", "6"),
        ("#### 5 apples", "5 apples"),
        ("##### 7", "7"),  # rfind: the last four #s
        ("a \\boxed{\\frac{3}{4}} b", "\\frac{3}{4}"),
        ("\\boxed{ 12 }", "12"),
        ("\\boxed{1} \\boxed{2}", "2"),
        ("\\boxed{a{b}c}", "a{b}c"),
        ("\\boxed{\\frac{1}{2}", None),  # unterminated: ignored
        ("\\boxed{7} \\boxed{\\frac{1}{2}", "7"),
        ("}} \\boxed{9} {{", "9"),  # stray braces around it
        ("\\boxed{5}\n#### 6", "6"),
        ("  -48 ", "-48"),
        ("1,234", "1,234"),
        ("3/4", "3/4"),
        ("48 apples", None),
        ("", None),
        ("####   ", None),
        ("\\boxed{  }", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "s, expected",
    [
        ("42", Fraction(42)),
        ("-42", Fraction(-42)),
        ("+42", Fraction(42)),
        ("\u221242", Fraction(-42)),
        ("1,234,567", Fraction(1234567)),
        ("$1,234.50", Fraction(2469, 2)),
        (" 7 ", Fraction(7)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("3.", Fraction(3)),
        ("42.0", Fraction(42)),
        ("- 3", Fraction(-3)),
        ("50%", Fraction(50)),
        ("50\\%", Fraction(50)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("\\tfrac34", Fraction(3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
        ("1\\!234", Fraction(1234)),
        ("1" * 100, Fraction(int("1" * 100))),
        ("1" * 101, None),
        ("1" * 5000, None),
        ("0." + "0" * 100 + "1", None),
        ("1e3", None),
        ("1E3", None),
        ("2^10", None),
        ("10**10**10", None),
        ("1e999999", None),
        ("٤٢", None),
        ("４２", None),
        ("4²", None),
        ("\x00", None),
        ("4\x002", None),
        ("1,23", None),
        ("12,34", None),
        (",123", None),
        ("1 234", None),
        ("3/0", None),
        ("\\frac{1}{0}", None),
        ("1/2/3", None),
        ("--3", None),
        ("+-3", None),
        ("", None),
        (".", None),
        ("-", None),
        ("18 dollars", None),
        ("18\\text{ dollars}", None),
        ("0x10", None),
        ("inf", None),
        ("nan", None),
        ("1_000", None),
        ("(5)", None),
    ],
)
def test_parse_number(s, expected):
    got = parse_number(s)
    assert got == expected
    assert got is None or type(got) is Fraction  # exact, never a float


def test_only_the_tail_is_read():
    filler = "x" * WINDOW
    assert math_reward(filler + "\n#### 72", "72") == 1.0
    assert extract_answer("#### 72\n" + filler) is None  # deviation 1: the answer left the window
    assert extract_answer(" " * WINDOW + "72") is None  # too long to be a bare number
    # The marker exactly at the window's first character is still seen.
    text = "junk #### 1\n" + "#### 72" + "y" * (WINDOW - 7)
    assert extract_answer(text) == "72" + "y" * (WINDOW - 7)


def test_bounded_work_on_huge_inputs():
    # A quadratic scan or an unbounded int() would take seconds to minutes on these.
    mb = 1 << 20
    for text in (
        "\\boxed{" * mb,
        "9" * mb,
        "#### " + "9" * mb,
        "{" * mb + "}" * mb,
        "\\boxed{" * 600 + "7" + "}" * 600,
        "#### " + "1" * 250,
    ):
        t0 = time.perf_counter()
        assert math_reward(text, "7") in (0.0, 1.0)
        assert time.perf_counter() - t0 < 0.5
    assert math_reward("\\boxed{" * 500 + "7" + "}" * 500, "7") == 1.0


def test_never_raises_on_non_strings():
    assert extract_answer(None) is None
    assert parse_number(None) is None
    assert math_reward(None, "1") == 0.0
    assert math_reward("#### 1", None) == 0.0


# ---------------------------------------------------------------- hostile inputs


def test_hostile_inputs_are_never_credited():
    pairs = hostile_inputs(20000)
    assert len(pairs) == 20000
    assert pairs[:50] == hostile_inputs(50)  # deterministic in the seed
    credited = [(c[-80:], g) for c, g in pairs if math_reward(c, g) != 0.0]
    assert credited == []


# ---------------------------------------------------------------- properties

# Text that is likely to contain the verifier's own markers, plus arbitrary Unicode text.
_TRICKY = st.text(alphabet=st.sampled_from(list("#\\boxed{}0123456789 \n\r\t\x00\u2212$%,./-+e^")))
_TEXT = st.one_of(st.text(), _TRICKY)
_INTS = st.integers(-(10**40), 10**40)


@settings(max_examples=300, deadline=None)
@given(t=_TEXT, g=_INTS)
def test_appended_final_answer_always_wins(t, g):
    # Whatever precedes it (markers, boxes, NULs), a final `#### g` line is the answer.
    assert math_reward(t + "\n#### " + str(g), str(g)) == 1.0
    assert math_reward(t + "\n#### " + f"{g:,}", str(g)) == 1.0
    assert math_reward(t + "\n#### " + str(g + 1), str(g)) == 0.0


@settings(max_examples=300, deadline=None)
@given(t=_TEXT, g=st.integers())
def test_reward_is_total_and_binary(t, g):
    assert math_reward(t, str(g)) in (0.0, 1.0)
    assert math_reward(t, t) in (0.0, 1.0)


@settings(max_examples=300, deadline=None)
@given(q=st.fractions(max_denominator=10**6).filter(lambda q: abs(q.numerator) < 10**30))
def test_parse_number_agrees_with_python(q):
    p, d = q.numerator, q.denominator
    assert parse_number(f"{p}/{d}") == q
    assert parse_number(f"\\frac{{{p}}}{{{d}}}") == q
    if d == 1:
        assert parse_number(str(p)) == q
        assert parse_number(f"{p:,}") == q
        assert parse_number(f"{p}.0") == q
