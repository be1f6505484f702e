"""The math-answer verifier: does a completion's final answer equal the gold answer?

In GRPO the reward is the only signal the policy gets, and the policy is optimised to collect it, so
any gap in the verifier becomes a learned behaviour. This file is therefore strict (a well-formed
number or nothing), bounded (the same small amount of work for any completion, however long or
nested) and total (0.0 or 1.0 for any input; it never raises, by construction rather than by a broad
`except`). Standard library only, so it can be copied on its own; the symbolic mode for MATH answers,
which uses math-verify, is math_verifier.py.

Rules
-----
Extraction (`extract_answer`) reads only the last `WINDOW` = 4,096 characters of the completion:
  1. the LAST `#### X` wins (the GSM8K convention, Cobbe et al. 2021); X is the rest of that line,
     stripped. An empty X means "no answer";
  2. else the LAST complete `\\boxed{X}` (the MATH convention, Hendrycks et al. 2021), braces balanced,
     so `\\boxed{\\frac{3}{4}}` gives `\\frac{3}{4}`; an unterminated `\\boxed{` is ignored. "Last" is
     the box that opens last, so for nested boxes the innermost one;
  3. else, if the whole stripped completion is one number (`-48`, `1,234`, `3/4`), it is its own
     answer: the built-in arithmetic task's completions are bare numbers;
  4. else there is no answer (None), which scores 0.
Numbers (`parse_number`) are exact `Fraction`s, never floats. Accepted: ASCII digits only; a leading
`+`/`-` (U+2212 `−` counts as `-`, LaTeX renders minus with it); decimals `0.5`, `.5`, `3.`;
thousands commas in groups of three (`1,234,567`, also LaTeX `1{,}234` and `1\\,234`); `a/b`,
`\\frac{a}{b}`, `\\dfrac`, `\\tfrac` and the shorthand `\\frac34`; `$`, `\\$`, `\\!` and whitespace are
dropped; one trailing `.` (end of sentence) and one trailing `%` are dropped.
Comparison (`math_reward`): 1.0 iff the answer and the gold parse to equal Fractions. A gold that is
not a number (a MATH answer such as `(3, \\frac{\\pi}{2})`) is compared as a string, whitespace removed.

Deviations from the usual lenient graders, numbered
---------------------------------------------------
  1. Only the tail (4,096 characters) is read, so that a megabyte completion costs what a short one
     does. An answer followed by more than 4,096 characters of text is not seen; completions are
     bounded by `max_new_tokens`, which keeps this from biting in practice.
  2. `50%` equals `50`, not `1/2`: GSM8K golds are written without the sign (`#### 50` for "50%"),
     so the `%` is read as a unit, not as division by 100.
  3. Strict: units or words (`18 dollars`, `\\text{...}`), exponents (`1e3`, `2^10`, `10**10`),
     non-ASCII digits (`٤٢`, `４２`, `²`), NUL bytes, more than 100 digits, badly grouped commas
     (`1,23`) and a space between two digits (`1 234`, which may be two numbers) are all "not a
     number". Lenient graders credit some of these; a policy optimised against the grader would
     learn to emit whichever form is wrongly credited.
  4. `1/0` and `\\frac{1}{0}` are not numbers (no division by zero, no error).
"""

import re
from fractions import Fraction

WINDOW = 4096  # characters of the completion's tail that are read (deviation 1)
MAX_DIGITS = 100  # digits in one number; more -> not a number (deviation 3)
MAX_NUMBER_CHARS = 256  # an answer string longer than this cannot be a <=100-digit number

# Tokens of the \boxed scan: an opening `\boxed{`, or any other brace. An alternation of fixed
# strings and a one-character class: finditer is linear in the window, nothing can backtrack.
_BOX_TOKENS = re.compile(r"\\boxed\{|[{}]")
# Two ASCII digits separated only by whitespace ("1 234", "3 4"): ambiguous, rejected. `[0-9]`
# (not `\d`, which matches every Unicode digit) keeps the check to ASCII digits.
_SPLIT_DIGITS = re.compile(r"[0-9]\s+[0-9]")
# An unsigned decimal: an integer part (plain digits, or 1-3 digits then comma groups of three),
# then an optional `.fraction`. Either part may be empty ("3." and ".5"); "at least one digit" is
# checked after the match. Run on <= 256 characters, so even its backtracking is trivially bounded.
_DECIMAL = re.compile(r"([0-9]{1,3}(?:,[0-9]{3})+|[0-9]*)(?:\.([0-9]*))?")
# \frac, \dfrac, \tfrac with two arguments, each `{...}` without nested braces or one digit (\frac34).
_FRAC = re.compile(r"\\[dt]?frac(\{[^{}]*\}|[0-9])(\{[^{}]*\}|[0-9])")
# LaTeX spellings rewritten before parsing, in this order: `\!` (negative thin space) goes,
# `\,` and `{,}` are LaTeX's thousands separators, `\$` and `$` are currency, `\%` is `%`.
_LATEX_MARKS = (("\\!", ""), ("\\,", ","), ("{,}", ","), ("\\$", ""), ("$", ""), ("\\%", "%"))


def _decimal(s: str, signed: bool = False) -> Fraction | None:
    """Parse an unsigned (or, inside a \\frac argument, signed) decimal exactly; None if it is not one."""
    sign = 1
    if signed and s and s[0] in "+-":
        sign, s = (-1 if s[0] == "-" else 1), s[1:]
    m = _DECIMAL.fullmatch(s)
    if m is None:
        return None
    whole, frac = m.group(1).replace(",", ""), m.group(2) or ""
    digits = whole + frac
    # The digit cap comes before int(): it keeps the work small and stays far below CPython's
    # 4,300-digit int() limit, which raises ValueError instead of returning.
    if not digits or len(digits) > MAX_DIGITS:
        return None
    # "12.345" -> 12345 / 10**3, exact; the regex guarantees `digits` is ASCII 0-9 only.
    return sign * Fraction(int(digits), 10 ** len(frac))


def parse_number(s: str) -> Fraction | None:
    """Normalise `s` and parse it as one exact number; None if it is anything else.

    Args:
        s: an answer string, e.g. `"$1,234"`, `"−3"`, `"0.5"`, `"\\frac{3}{4}"`, `"50%"`.
    Returns:
        the value as a `Fraction` (never a float, so `0.1 + 0.2` questions compare exactly), or None
        for anything that is not a single well-formed number (see the module docstring).
    """
    if not isinstance(s, str) or len(s) > MAX_NUMBER_CHARS:
        return None
    s = s.replace("\u2212", "-")  # U+2212 MINUS SIGN, as LaTeX renders it
    if _SPLIT_DIGITS.search(s):
        return None
    s = "".join(s.split())  # all whitespace, Unicode spaces included
    for old, new in _LATEX_MARKS:
        s = s.replace(old, new)
    if s.endswith("."):  # "#### 42." ends a sentence
        s = s[:-1]
    if s.endswith("%"):  # deviation 2: 50% == 50
        s = s[:-1]
    sign = 1
    if s and s[0] in "+-":  # one sign only: "--3" and "+-3" fail below
        sign, s = (-1 if s[0] == "-" else 1), s[1:]
    m = _FRAC.fullmatch(s)
    if m is not None:
        # An argument is "{...}" or one digit; inside braces a sign is allowed (\frac{-3}{4}).
        num, den = (_decimal(g[1:-1] if g[0] == "{" else g, signed=True) for g in m.groups())
    elif "/" in s:
        parts = s.split("/")
        if len(parts) != 2:  # "1/2/3" is not a simple fraction
            return None
        num, den = _decimal(parts[0]), _decimal(parts[1])
    else:
        num, den = _decimal(s), Fraction(1)
    if num is None or den is None or den == 0:  # den == 0: 1/0 is not a number, no error
        return None
    return sign * num / den


def _last_boxed(tail: str) -> str | None:
    """Content of the complete `\\boxed{...}` that opens last in `tail`, or None if there is none.

    One left-to-right pass with an explicit stack (no recursion, so `\\boxed{` nested thousands deep
    costs one push each, never a RecursionError). Each open brace pushes where its content starts
    for `\\boxed{`, or -1 for a plain `{`; a `}` pops its partner. Boxes still open at the end
    (unterminated) are simply never recorded; a stray `}` with nothing open is ignored.
    """
    stack: list[int] = []
    best: tuple[int, int] | None = None  # (content start, content end)
    for m in _BOX_TOKENS.finditer(tail):
        tok = m.group()
        if tok != "}":
            stack.append(m.end() if tok != "{" else -1)
        elif stack:
            start = stack.pop()
            # Largest start = the box that opens last: the later of two boxes, the inner of nested.
            if start >= 0 and (best is None or start > best[0]):
                best = (start, m.start())
    return None if best is None else tail[best[0] : best[1]]


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, as text; None if it gives none.

    Rules, in order (module docstring): the last `#### X` line, else the last complete `\\boxed{X}`,
    else the whole completion if it is a bare number. Only the last `WINDOW` characters are read.

    Args:
        text: a completion.
    Returns:
        the answer, stripped (e.g. `"1,234"` or `"\\frac{3}{4}"`), or None. The answer is not yet
        checked to be a number, except under the bare-number rule; `parse_number` does that.
    """
    if not isinstance(text, str):
        return None
    tail = text[-WINDOW:]  # deviation 1: bounded work for any length
    i = tail.rfind("####")
    if i >= 0:
        # Rest of that line. rfind gives the last occurrence, so "##### 5" reads "5" as well.
        # An empty last `####` is final too: it does not fall back to an earlier answer.
        rest = tail[i + 4 :].split("\n", 1)[0].split("\r", 1)[0]
        return rest.strip() or None
    boxed = _last_boxed(tail)
    if boxed is not None:
        return boxed.strip() or None
    # Bare number. Only when the whole completion fits in the window: a number at the end of a long
    # text is not "the whole completion". parse_number bounds its own work (256 characters).
    if len(text) <= WINDOW:
        candidate = tail.strip()
        if parse_number(candidate) is not None:
            return candidate
    return None


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold answer, else 0.0. Never raises.

    Args:
        completion: model output, any string (any length, any characters).
        gold: the reference answer, e.g. `"72"`, `"1,234"`, `"-3"`, `"\\frac{14}{3}"`.
    Returns:
        1.0 iff `extract_answer(completion)` and `gold` parse to the same Fraction; if `gold` is not a
        number, iff the two strings agree with all whitespace removed.
    """
    answer = extract_answer(completion)
    if answer is None or not isinstance(gold, str):
        return 0.0
    target = parse_number(gold)
    if target is None:
        # Non-numeric gold: exact match without whitespace. An empty gold credits nothing.
        g = "".join(gold.split())
        return 1.0 if g and "".join(answer.split()) == g else 0.0
    return 1.0 if parse_number(answer) == target else 0.0
