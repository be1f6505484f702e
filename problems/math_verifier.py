"""The verifier's symbolic mode for MATH-style answers (`--task math`; docs/math-verifier.md has the probe and
its table): `symbolic_reward(completion, gold)`, 0.0 or 1.0, never raises. It extends reward.py's numeric rules
(whose extraction and numbers it reuses) and imports math-verify, the [math] extra, when it is first called.

For MATH-style golds (`\\left( 3, \\frac{\\pi}{2} \\right)`, `(-\\infty, 2] \\cup [5, \\infty)`, `\\text{(C)}`,
`2k+2`, `52_8`, `90^\\circ`). Without it (the default) nothing above changes, and math-verify is never
imported. Extraction reads the same tail: the boxes if there are any, else the last `#### X`, else a
bare number. With boxes, every distinct box is an answer and every one must equal the gold (the last
one, as `_last_boxed` picks it, first); `\\boxed{\\boxed{7}}` is 7; a `####` line is then ignored
(chat models write markdown headings such as `#### Final Answer` above their box).
Each answer is compared with the gold in these steps; the first that decides, decides:
  a. both plain numbers (`parse_number`): exact Fractions, as above;
  b. the same text, runs of whitespace counted as one space;
  c. the guards S1-S5 below, and the small normalisations math-verify lacks: `x = 5` for `5`; a tuple
     `(1, 2)` for a column vector `\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}`; a choice gold `\\text{(C)}` equals
     exactly `C`, `(C)`, `\\text{(C)}`, `\\textbf{C}` (any case); a base gold `52_8` equals `52_8`, `52_{8}`
     or `52` (the question names the base), not `52_7` and not 42; degree marks and a trailing unit
     (`\\text{ inches}`, `\\mbox{ cm}^2`, `10 feet`) are split off, and numbers are compared exactly
     again once they are off (`90^\\circ` and `90.0`);
  d. math-verify (H. Kydlicek, HuggingFace): `parse` of the answer string alone, wrapped in
     `\\boxed{}` so that it reads exactly that string and never picks a number out of the reasoning,
     then `verify(gold, answer)`, each under math-verify's own time limit of `MV_TIMEOUT_S` (`signal.alarm`,
     whole seconds: the main thread only; elsewhere a call that reaches math-verify raises RuntimeError).
     Parses and verdicts are cached (a GRPO group repeats its gold and often its answers).
Guards (S1-S3 are each a case where math-verify alone credits a wrong answer):
  S1. No decimal approximations: decimal literals become exact fractions before math-verify sees
      them (`0.5774` -> 2887/5000, `0.\\overline{3}` -> 1/3), so `0.5774` is not `\\frac{\\sqrt{3}}{3}`,
      `0.333` / `0.3333333` are not `\\frac13`, `3.14159` is not `\\pi`; `1.5` still equals `\\frac32`.
      (math-verify compares a float to 6 places.)
  S2. Units: when both sides state a unit, they must agree (`10 \\text{ feet}` is not `10\\text{ inches}`,
      `864 \\text{ inches}` is not `864 \\mbox{ inches}^2`; plurals, `square`/`^2`, `ft`/`feet` are
      one unit; a degree mark is the unit "degree", so `90 \\text{ radians}` is not `90^\\circ`). A unit
      on one side only is not checked, whichever side: the gold `10` does not say which unit is right
      (the question does), and `10` for `10\\text{ inches}` is the usual MATH answer. Words that are not
      units (`5 \\text{ or more}`, `\\text{ approximately}`) reject the answer. (math-verify drops units.)
  S3. No hedging: every box must be right (`\\boxed{5} ... \\boxed{6}` scores 0 whatever the gold); an
      answer with "or", "either", `\\lor`, `\\vee` or `\\approx` scores 0 unless the gold has one too
      (`5 \\text{ or } 6`, `n or n+1`), and so does one with a word that qualifies the value ("if",
      "not", "approximately", "at most", ...: `_NOT_UNIT_WORDS`) that the gold lacks; so does one with
      a comma, semicolon or `\\pm` (`+-`) when the gold has none (`5, 6` for `5`; thousands separators
      `58,500` are not commas here); a box that holds another box beside other text is 0; more than
      `MAX_ANSWERS` distinct boxes are 0.
  S4. `####` is read first only by the numeric rules: reward.math_reward (GSM8K) is unchanged.
  S5. Never raises, bounded: non-strings, answers over `MAX_SYMBOLIC_CHARS`, NUL bytes, non-ASCII other
      than a few LaTeX symbols (`−`, `°`, `π`, `∞`, `±`, ...), digits split by spaces (`5 6`, which
      math-verify reads as 11) and unevaluated `\\sum`/`\\int`/`\\lim` are 0 before math-verify;
      nesting deeper than `MAX_DEPTH`, a power in an exponent (`10^{10^{10}}`), an exponent over
      `MAX_EXPONENT_DIGITS` digits and big factorials are refused (sympy would work on them up to the
      time limit, or in C, where no limit reaches); math-verify's exceptions are caught broadly (it
      wraps latex2sympy, ANTLR and sympy, which raise many types). No new math-verify step starts after
      `SYMBOLIC_BUDGET_S` in one call, so one call takes at most about that plus three time limits.
Without math-verify installed, `symbolic_reward` raises ImportError at its first call, and outside the main
thread RuntimeError: set-up errors, not inputs (config.py checks for math-verify when `--task math` is chosen).
"""

import re
import threading
import time
from fractions import Fraction
from functools import lru_cache

from reward import _BOX_TOKENS, MAX_DIGITS, WINDOW, extract_answer, parse_number

MAX_SYMBOLIC_CHARS = 512  # an answer (or gold) longer than this is not compared symbolically (rule S5)
MAX_ANSWERS = 4  # distinct \boxed answers in one completion; more -> 0 (rule S3)
MAX_DEPTH = 10  # bracket nesting; latex2sympy's parse time grows exponentially with it (rule S5)
MAX_EXPONENT_DIGITS = 4  # digits of a number in an exponent (rule S5): 2^{2010} passes, 10^{10000000} not
MV_TIMEOUT_S = 1  # math-verify's limit per parse and per comparison; signal.alarm takes whole seconds
SYMBOLIC_BUDGET_S = 2.0  # no math-verify step starts after this long in one call (several boxes)

# "or", "either", `\lor`, `\vee`, `\approx`: an answer that offers two values (rule S3). A word "or"
# must stand alone: `\text{ or }` and "5 or 6" match, "color" and `\operatorname` do not.
_HEDGE = re.compile(r"(?<![A-Za-z\\])(?:or|either)(?![A-Za-z])|\\(?:lor|vee|approx)(?![A-Za-z])", re.I)
# Unevaluated calculus is not a final answer, and sympy may work on it without bound (rule S5).
_CALCULUS = re.compile(r"\\(?:i*int|oint|lim|sum|prod|partial)(?![A-Za-z])")
# A thousands separator: `58,500`, `10,\!080` (not `5, 600` or `(6,31)`). Other commas and semicolons
# separate answers, so an answer with one, against a gold with none, offers several values (rule S3).
_THOUSANDS = re.compile(r"(?<=[0-9]),(?:\\!)?(?=[0-9]{3}(?![0-9]))")
# `x = 5` for the gold `5`: the value of the variable (math-verify reads the prefix, but not together
# with a thousands separator, `x = 58,500`, so a number is taken out here).
_ASSIGNMENT = re.compile(r"[A-Za-z]\s*=\s*(.+)", re.S)
# A column vector (`\begin{pmatrix} -2 \\ -14 \end{pmatrix}`, no `&`), and a tuple that may stand for
# one: `(-2, -14)`, `\left(-2, -14\right)`, `\langle -2, -14 \rangle`. math-verify never equates the two.
_COLUMN = re.compile(r"\\begin\{([pbvB]?matrix)\}([^&]*)\\end\{\1\}", re.S)
_TUPLE = re.compile(r"(?:\\left\s*)?\((.*?)(?:\\right\s*)?\)|\\langle(.*?)\\rangle", re.S)
# Two digits separated only by spacing: "5 6" (math-verify reads it as 5 + 6 = 11), "5 \quad 6".
_SPLIT_DIGITS_TEX = re.compile(r"[0-9](?:\s|\\q?quad(?![A-Za-z])|\\[;: ]|~)+[0-9]")
# A power tower with unbraced exponents, `10^10^10`; braced ones are found by `_unsafe`'s scan.
_CHAINED_POWER = re.compile(r"\^\s*\\?[A-Za-z0-9.]*\s*\^")
# Unicode (and ASCII) spellings that answers use, rewritten to the LaTeX that math-verify reads; any
# other non-ASCII character rejects the answer (Unicode digits `٤٢` must not count as 42, as in the
# numeric rules).
_UNICODE_TEX = (
    ("\u2212", "-"),
    ("\u00b0", "^\\circ"),
    ("\u03c0", "\\pi"),
    ("\u221e", "\\infty"),
    ("\u2248", "\\approx"),
    ("\u00d7", "\\times"),
    ("\u22c5", "\\cdot"),
    ("\u00b7", "\\cdot"),
    ("\u2264", "\\le"),
    ("\u2265", "\\ge"),
    ("\u00b1", "\\pm "),
    ("\u2213", "\\mp "),
    ("+-", "\\pm "),  # ASCII for ±: `+-3` offers 3 and -3 (the numeric rules reject it as `--3`)
    ("-+", "\\mp "),
)
# Degree marks at the end of an answer: `90^\circ`, `90^{\circ}`, `90\circ`, `90\degree`. Only at the
# end: inside an expression (`\sin 30^\circ`) removing the mark would change the value.
_DEGREE_MARK = re.compile(r"\s*(?:\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree)\s*$")
# A unit: the trailing `\text{...}` (or \mbox, \textrm, \mathrm) after a non-empty value, optionally
# squared or cubed: `864 \mbox{ inches}^2`, `5.4 \text{ cents}`, `\frac{270}7\text{ degrees}`.
_TEXT_UNIT = re.compile(
    r"(?P<head>.*?\S)\s*\\(?:text|mbox|textrm|mathrm)\s*\{(?P<unit>[A-Za-z .^0-9-]*)\}"
    r"(?P<pow>\s*\^\s*\{?\s*[23]\s*\}?)?\s*",
    re.S,
)
# ...or one to three plain words after a space that follows a digit or a brace: `10 feet`, `15 cm^2`.
# Single letters are variables (`2 k`), and a backslash before the word makes it a command (`2 \pi`).
_WORD_UNIT = re.compile(
    r"(?P<head>.*?[0-9}])\s+(?P<unit>[A-Za-z]{2,}(?:\s+[A-Za-z]{2,}){0,2})(?P<pow>\s*\^\s*\{?\s*[23]\s*\}?)?\s*",
    re.S,
)
# Words that say something about the value rather than name a unit: `5 \text{ or more}`,
# `5 \text{ (approximately)}`, `5 \text{ not }`. An answer ending in one is rejected, not trimmed.
_NOT_UNIT_WORDS = frozenset(
    "or and not no nor either neither approx approximately about around roughly nearly almost maybe "
    "possibly perhaps plus minus than more less least most at over under between except but if else "
    "otherwise wrong incorrect false true".split()
)
# A word of two or more letters that is not a command's name (`if` in `5 \text{ if } n` but not `\lim`).
_WORD = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}(?![A-Za-z])")
# Unit spellings that the plural rule below does not reach.
_UNIT_ALIASES = {"feet": "foot", "ft": "foot", "in": "inch", "hr": "hour", "hrs": "hour", "min": "minute"}
_UNIT_ALIASES |= {"mins": "minute", "sec": "second", "secs": "second", "deg": "degree", "circ": "degree"}
# A multiple-choice letter: `\text{(C)}`, `\textbf{(C)}`, `(C)`, `C`, optionally in one wrapper.
_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm|mbox)\s*\{(.*)\}", re.S)
_CHOICE = re.compile(r"\(\s*([A-Ja-j])\s*\)|([A-Ja-j])")
# A number in a base: `52_8`, `4210_{5}`, `A3_{16}`.
_BASE = re.compile(r"([0-9A-Za-z]*[0-9][0-9A-Za-z]*)\s*_\s*(?:\{\s*([0-9]{1,2})\s*\}|([0-9]))")
# Decimal literals, rewritten as exact fractions before math-verify sees them (rule S1): a repeating
# decimal `0.1\overline{6}` (whole, fixed digits, repeating digits) or a plain one `12.5` (whole,
# digits). The look-arounds keep `1.2.3` from matching inside.
_DECIMAL_LITERAL = re.compile(r"(?<![0-9.])([0-9]*)\.(?:([0-9]*)\\overline\s*\{([0-9]+)\}|([0-9]+)(?![0-9.]))")
_DIGIT_RUN = re.compile(r"[0-9]+")


def _boxes(tail: str) -> list[tuple[int, int, int, int]]:
    """Every complete `\\boxed{...}` in `tail`: (start of `\\boxed`, content start, content end, end).

    The scan of `_last_boxed` (one pass, an explicit stack, unterminated boxes never recorded), keeping
    all boxes instead of the last one.
    """
    stack: list[tuple[int, int] | None] = []
    found = []
    for m in _BOX_TOKENS.finditer(tail):
        tok = m.group()
        if tok != "}":
            stack.append((m.start(), m.end()) if tok != "{" else None)
        elif stack:
            top = stack.pop()
            if top is not None:
                found.append((top[0], top[1], m.start(), m.end()))
    return found


def _final_answers(text: str) -> list[str]:
    """The final answers of a completion under the symbolic rules: [] when it gives none (or hedges).

    With boxes: every distinct non-empty box content, the last-opened box first; [] when that last box is
    empty (no answer, as in `extract_answer`) or when a box holds another box with something beside it
    (`\\boxed{5 \\text{ or } \\boxed{6}}`). `\\boxed{\\boxed{7}}` is 7 given twice. Without boxes: the
    `####` line or the bare number of `extract_answer`.
    """
    if not isinstance(text, str):
        return []
    tail = text[-WINDOW:]  # deviation 1: bounded work for any length
    boxes = _boxes(tail)
    if not boxes:
        answer = extract_answer(text)
        return [answer] if answer is not None else []
    boxes.sort(key=lambda b: -b[1])  # the box that opens last first: the answer of `_last_boxed`
    if not tail[boxes[0][1] : boxes[0][2]].strip():
        return []
    whole = {(b[0], b[3]) for b in boxes}
    seen, answers = set(), []
    for _, start, end, _ in boxes:
        content = tail[start:end]
        answer = content.strip()
        if not answer:
            continue
        if "\\boxed" in answer:
            lead = start + len(content) - len(content.lstrip())
            if (lead, lead + len(answer)) in whole:  # only a box inside: the inner box is the answer
                continue
            return []
        key = "".join(answer.split())
        if key not in seen:
            seen.add(key)
            answers.append(answer)
    return answers


def _clean(s: str) -> str | None:
    """The answer with its LaTeX decoration normalised, or None if it is rejected outright (rule S5)."""
    if not isinstance(s, str) or len(s) > MAX_SYMBOLIC_CHARS or "\x00" in s:
        return None
    for old, new in _UNICODE_TEX:
        s = s.replace(old, new)
    if not s.isascii():
        return None
    # `\!` is a negative thin space (`10,\!080`); `$` and `\$` are math delimiters and currency, which
    # the numeric rules drop as well; `\displaystyle` only sets the size.
    s = s.replace("\\!", "").replace("\\$", "").replace("$", "").replace("\\displaystyle", "")
    s = s.strip()
    if s.endswith(".") and not s[-2:-1].isdigit():  # a sentence's full stop, not the `3.` of a number
        s = s[:-1].rstrip()
    return s


def _choice(s: str) -> str | None:
    """The letter of a multiple-choice answer (`\\text{(C)}`, `(C)`, `C`), upper case; else None."""
    m = _WRAPPER.fullmatch(s)
    inner = m.group(1).strip() if m else s
    c = _CHOICE.fullmatch(inner)
    return None if c is None else (c.group(1) or c.group(2)).upper()


def _base_number(s: str) -> tuple[str, int] | None:
    """(digits, base) of a number written in a base, `52_8` -> ("52", 8); else None."""
    m = _BASE.fullmatch(s)
    return None if m is None else (m.group(1).upper(), int(m.group(2) or m.group(3)))


def _unit_name(words: str, power: str) -> str | None:
    """A unit's canonical name: `" inches"` and `"^2"` -> `"inch^2"`; None for none (`\\text{ }`, "units")."""
    name, exp = [], "".join(c for c in power if c in "23")
    for w in re.findall(r"[a-z]+|\^\s*\{?\s*[23]", words.lower()):
        if w[0] == "^":
            exp = w[-1]
        elif w in ("square", "sq"):
            exp = "2"
        elif w == "cubic":
            exp = "3"
        else:
            w = _UNIT_ALIASES.get(w, w)
            # Plurals: inches -> inch, cents -> cent, degrees -> degree (not "ss": "class").
            if w.endswith(("ches", "shes", "sses", "xes")):
                w = w[:-2]
            elif w.endswith("s") and not w.endswith("ss") and len(w) > 2:
                w = w[:-1]
            name.append(w)
    if not name or name == ["unit"]:  # "square units" names no unit
        return None
    return " ".join(name) + (f"^{exp}" if exp else "")


def _split_unit(s: str) -> tuple[str, str | None] | None:
    """(value, unit) of an answer: degree marks and a trailing unit removed (rule S2); None if rejected.

    `90^\\circ` -> ("90", "degree"), `864 \\mbox{ inches}^2` -> ("864", "inch^2"), `\\pi` -> ("\\pi", None).
    A trailing text that is not a unit (`5 \\text{ or more}`) rejects the answer.
    """
    m = _DEGREE_MARK.search(s)
    if m is not None and m.start() > 0:
        return s[: m.start()], "degree"
    for pattern in (_TEXT_UNIT, _WORD_UNIT):
        m = pattern.fullmatch(s)
        if m is not None:
            if re.search(r"\\(?:text|mbox|textrm|mathrm)", m.group("head")):
                return None  # two annotations (`5.4 \text{ cents}, 6.4 \text{ cents}`) are not one value
            if _NOT_UNIT_WORDS.intersection(re.findall(r"[a-z]+", m.group("unit").lower())):
                return None
            return m.group("head").strip(), _unit_name(m.group("unit"), m.group("pow") or "")
    return s, None


def _exact_decimals(s: str) -> str | None:
    """`s` with every decimal literal written as an exact fraction (rule S1); None for one too long.

    `0.5774` -> `\\frac{2887}{5000}`, `1.5` -> `\\frac{3}{2}`, `2.0` -> `2`, `0.1\\overline{6}` -> `\\frac{1}{6}`.
    After `^` or `_` the fraction is braced: latex2sympy reads `2^\\frac{3}{2}` as 1/2, not 2^(3/2).
    """
    too_long = False

    def exact(m: re.Match) -> str:
        nonlocal too_long
        whole, fixed, repeat, plain = m.groups()
        fixed = plain if repeat is None else fixed
        if len(whole + fixed + (repeat or "")) > MAX_DIGITS:  # also keeps 10**k small
            too_long = True
            return m.group()
        q = Fraction(int(whole + fixed or "0"), 10 ** len(fixed))
        if repeat is not None:  # 0.1(6) = 0.1 + 6 / (10 * 9)
            q += Fraction(int(repeat), 10 ** len(fixed) * (10 ** len(repeat) - 1))
        text = str(q.numerator) if q.denominator == 1 else f"\\frac{{{q.numerator}}}{{{q.denominator}}}"
        return "{" + text + "}" if s[: m.start()].rstrip().endswith(("^", "_")) else text

    s = _DECIMAL_LITERAL.sub(exact, s)
    return None if too_long else s


def _unsafe(s: str) -> bool:
    """True if sympy could be made to work without bound on `s` (rule S5).

    Rejected: nesting deeper than `MAX_DEPTH`; a power inside an exponent (`10^{10^{10}}`, `10^10^10`);
    a number of more than `MAX_EXPONENT_DIGITS` digits in an exponent (verify takes 11 s on
    `10^{10000000}` without a time limit); a factorial or binomial next to a power, a number of more
    than 3 digits or another factorial (`(10^{100})!`, `(99!)!`); any number longer than `MAX_DIGITS`.
    One pass over at most `MAX_SYMBOLIC_CHARS` characters.
    """
    if _CHAINED_POWER.search(s):
        return True
    if any(len(r) > MAX_DIGITS for r in _DIGIT_RUN.findall(s)):
        return True
    factorials = s.replace("\\!", "").count("!") + s.count("binom") + s.count("choose")
    if factorials and (factorials > 1 or "^" in s or any(len(r) > 3 for r in _DIGIT_RUN.findall(s))):
        return True
    depth, run = 0, 0
    exponents: list[int] = []  # depths at which an open exponent group began
    after_caret = bare_exponent = False  # just after `^` (skipping spaces and command names)
    for ch in s:
        run = run + 1 if ch.isdigit() else 0
        if ch.isdigit() and after_caret:
            bare_exponent = True  # `10^12345`: digits straight after the caret
        if not ch.isdigit():
            bare_exponent = False
        if run > MAX_EXPONENT_DIGITS and (exponents or bare_exponent):
            return True
        if ch in "{([":
            depth += 1
            if depth > MAX_DEPTH:
                return True
            if after_caret:
                exponents.append(depth)
        elif ch in "})]":
            if exponents and exponents[-1] == depth:
                exponents.pop()
            depth = max(depth - 1, 0)
        elif ch == "^" and exponents:
            return True
        if ch == "^":
            after_caret = True
        elif not (ch.isspace() or ch.isalpha() or ch == "\\"):
            after_caret = False
    return False


def _math_verify():
    """(parse, verify, TimeoutException) of math-verify, imported here and only here: on the first
    symbolic call, never by `import math_verifier` or by reward.math_reward (ImportError without the package)."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    return parse, verify, TimeoutException


def _limited(call, default):
    """`call(MV_TIMEOUT_S)`, a math-verify step under its own time limit (`signal.alarm`, whole seconds); `default`
    if it raises or runs out of time. Called in the main thread only (`_symbolic_equal` checks)."""
    _, _, TimeoutException = _math_verify()
    try:
        return call(MV_TIMEOUT_S)
    except (Exception, TimeoutException):
        # Broad on purpose: math-verify wraps latex2sympy, ANTLR and sympy, which raise many types
        # (ValueError, TypeError, RecursionError, sympy's own, ...); any of them means "no", never a
        # crash. TimeoutException derives from BaseException, so it is named as well.
        return default


@lru_cache(maxsize=4096)
def _mv_parse(latex: str) -> tuple:
    """math-verify's parse of one answer string (a tuple, empty when it cannot parse it). Cached: the
    gold of a group is parsed once for its G completions."""
    parse, _, _ = _math_verify()
    # Wrapped in \boxed{} so that math-verify reads exactly this string, never a number of its choice
    # from elsewhere; no fallback, so a string that does not parse yields nothing, not itself.
    text = "\\boxed{" + latex + "}"
    return _limited(lambda limit: tuple(parse(text, fallback_mode="no_fallback", parsing_timeout=limit)), ())


@lru_cache(maxsize=4096)
def _mv_equal(answer: str, gold: str) -> bool:
    """math-verify's verdict on two cleaned strings. Cached: a group repeats its answers."""
    _, verify, _ = _math_verify()
    g, a = _mv_parse(gold), _mv_parse(answer)
    if not g or not a:
        # One side does not parse: equal only as the same text (whitespace runs count as one space).
        return " ".join(answer.split()) == " ".join(gold.split())
    return _limited(lambda limit: verify(list(g), list(a), timeout_seconds=limit) is True, False)


def _split_top(s: str) -> list[str] | None:
    """`s` split at the commas outside every bracket: `1, (2, 3)` -> ["1", " (2, 3)"]; None if the
    brackets do not balance (`-2), (1` is not one tuple's inside)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]] if depth == 0 else None


def _separators(s: str) -> int:
    """Separators of values in `s`: commas and semicolons (not thousands separators), and `\\pm`, `\\mp`."""
    return s.count(",") + s.count(";") + s.count("\\pm") + s.count("\\mp") - len(_THOUSANDS.findall(s))


def _qualifiers(s: str) -> set[str]:
    """The words of `s` that qualify a value rather than state one (`or`, `if`, `approximately`, ...)."""
    return _NOT_UNIT_WORDS.intersection(w.lower() for w in _WORD.findall(s))


def _symbolic_equal(answer: str, gold: str, deadline: float) -> bool:
    """Does one final answer equal the gold under the symbolic rules (module docstring)?"""
    a_num, g_num = parse_number(answer), parse_number(gold)
    if a_num is not None and g_num is not None:  # two plain numbers: exact, as in the numeric rules
        return a_num == g_num
    a, g = _clean(answer), _clean(gold)
    if a is None or g is None:
        return a is not None and isinstance(gold, str) and " ".join(a.split()) == " ".join(gold.split())
    # The same text up to the amount of whitespace. Not with all whitespace removed: "1 7" is not 17.
    if " ".join(a.split()) == " ".join(g.split()):
        return True
    column, row = _COLUMN.fullmatch(g), _TUPLE.fullmatch(a)
    entries = None if row is None else _split_top(row.group(1) if row.group(1) is not None else row.group(2))
    if column is not None and entries is not None:  # a column vector given as a tuple: the same entries
        a = "\\begin{pmatrix}" + " \\\\ ".join(e.strip() for e in entries) + "\\end{pmatrix}"
    if _HEDGE.search(a) and not _HEDGE.search(g):  # rule S3
        return False
    if _qualifiers(a) - _qualifiers(g):  # rule S3: `5 \text{ if } n \text{ is even}`, `5 \text{ at most}`
        return False
    if _separators(a) and not _separators(g):  # rule S3: `5, 6` for the single value `5`
        return False
    m = _ASSIGNMENT.fullmatch(a)
    if m is not None and "=" not in g and parse_number(m.group(1)) is not None:
        a = m.group(1)
        if g_num is not None:
            return parse_number(a) == g_num
    if _SPLIT_DIGITS_TEX.search(a) or (_CALCULUS.search(a) and not _CALCULUS.search(g)):
        return False
    letter = _choice(g)
    if letter is not None and ("(" in g or _WRAPPER.fullmatch(g)):  # a choice gold: `\text{(C)}`, `(C)`
        return _choice(a) == letter
    base = _base_number(g)
    if base is not None:  # `52_8`: the same digits, in the same base or with the base left implicit
        return _base_number(a) == base or a.upper() == base[0]
    a_split, g_split = _split_unit(a), _split_unit(g)
    if a_split is None or g_split is None:
        return False
    (a, a_unit), (g, g_unit) = a_split, g_split
    if a_unit is not None and g_unit is not None and a_unit != g_unit:  # rule S2: a wrong unit
        return False
    a_num, g_num = parse_number(a), parse_number(g)
    if a_num is not None and g_num is not None:  # numbers once the units are off: `90^\circ` vs `90.0`
        return a_num == g_num
    a, g = _exact_decimals(a), _exact_decimals(g)
    if not a or not g or _unsafe(a) or _unsafe(g) or time.monotonic() > deadline:
        return False
    if threading.current_thread() is not threading.main_thread():
        # math-verify's time limit is a signal, which only the main thread can set; without a limit one answer
        # ((x+1)^{9999}) keeps sympy busy for minutes. A set-up error, like a missing math-verify: not a 0.
        raise RuntimeError("math_verifier.symbolic_reward needs the main thread (math-verify's time limit)")
    return _mv_equal(a, g)


def symbolic_reward(completion: str, gold: str) -> float:
    """1.0 iff every final answer equals the gold (rules S1-S5)."""
    _math_verify()  # the first call imports it: without math-verify, ImportError whatever the input
    if not isinstance(gold, str):
        return 0.0
    answers = _final_answers(completion)
    if not answers or len(answers) > MAX_ANSWERS:
        return 0.0
    deadline = time.monotonic() + SYMBOLIC_BUDGET_S
    return 1.0 if all(_symbolic_equal(a, gold, deadline) for a in answers) else 0.0
