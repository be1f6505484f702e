"""Probe the verifier: what does `reward.math_reward` credit on MATH-500 and GSM8K golds?

    python -m studies.verifier_probe --data DATA              # writes results/verifier_probe.md and prints it
    python -m studies.verifier_probe --limit 20 --data DATA   # only the first 20 golds of each data set

Built deterministically from DATA/math500/test.jsonl (`answer`) and DATA/gsm8k/test.jsonl (the gold after `####`):
local JSONL copies of HuggingFaceH4/MATH-500 and openai/gsm8k. Each answer is wrapped in a short completion with
`\\boxed{}`. For each MATH-500 gold:
  equal    the gold as written, then rewritings a model would write for the same answer (`\\dfrac`, no `\\left`,
           other whitespace, `x = 5` for `5`, `C` for `\\text{(C)}`, `2 + 2k` for `2k+2`, `\\frac{9}{5}` for
           `1\\frac{4}{5}`, a terminating decimal for a fraction, a set in another order, ...). Each rule is a
           generic rewriting that keeps the value (the rules are listed in `equal_rewritings`); none is shaped to
           suit the verifier, and one that is not credited is listed under the table;
  wrong    a different answer: the first integer in it plus one, negated, doubled, a tuple reversed, an interval's
           bracket flipped, the next choice letter, another text answer;
  approx   a decimal approximation (3, 4, 6 and 10 places) of a gold that is not a terminating decimal;
  unit     the gold's own unit replaced by another (only golds that state a unit: see docs/math-verifier.md);
  hedge    the gold and a wrong answer together: two boxes (either order), "a or b" (both orders, `\\text{ or }`
           and plain), "a, b" for a single-valued gold.
Every call is timed with time.perf_counter and wrapped, so an exception escaping math_reward is counted, not fatal.
GSM8K: each gold after the test set's own reasoning, as `#### x` and as `\\boxed{x}`, scored with symbolic=False and
symbolic=True, with a wrong answer (the gold plus one) for each.
"""

import argparse
import json
import math
import platform
import re
import sys
import time
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

from problems.math_verifier import symbolic_reward
from reward import math_reward, parse_number

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "results" / "verifier_probe.md"
TYPES = (
    "integer",
    "decimal",
    "fraction",
    "radical",
    "pi",
    "interval",
    "tuple/set",
    "text/choice",
    "expression",
    "other",
)

# ---------------------------------------------------------------- small LaTeX helpers (the probe's, not the verifier's)

_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}")
_UNIT_TAIL = re.compile(r"(?P<head>.*?\S)\s*\\(?:text|mbox)\s*\{(?P<unit>[^{}]*)\}(?P<pow>\^\{?[23]\}?)?\s*$")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?\s*$")
_BASE = re.compile(r"([0-9]+)_\{?([0-9]+)\}?")
_CHOICE = re.compile(r"\\text\{\(([A-E])\)\}")
_FRAC_NUM = re.compile(r"\\[dt]?frac\s*(?:\{(-?[0-9]+)\}|([0-9]))\s*(?:\{([0-9]+)\}|([0-9]))")
_MIXED = re.compile(r"([0-9]+)\s*\\frac\{([0-9]+)\}\{([0-9]+)\}")


def distinct(items: list[tuple[str, str]], gold: str) -> list[tuple[str, str]]:
    """(rule, text) items, the first of each text kept, none equal to the gold as written."""
    seen, unique = {gold}, []
    for rule, text in items:
        if text not in seen:
            seen.add(text)
            unique.append((rule, text))
    return unique


def depth_split(s: str, seps: str) -> list[str]:
    """`s` split at the characters of `seps` that are outside every bracket ({, (, [). Written here, not imported
    from reward.py (`_split_top`): the probe builds its items without the code it tests."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
        elif ch in seps and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


def sum_terms(s: str) -> list[tuple[str, str]] | None:
    """[(sign, term)] of a top-level sum (`6 - 5i` -> [("+", "6"), ("-", "5i")]); None if it is not one."""
    if any(t in s for t in ("\\pm", "\\mp", "=", ",", "\\cup", "<", ">", "\\le", "\\ge", "\\begin")):
        return None
    terms, depth, cur, sign = [], 0, "", "+"
    prev = ""  # the previous non-space character at depth 0
    for ch in s:
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
        if depth == 0 and ch in "+-" and (prev.isalnum() or prev in "})]"):
            terms.append((sign, cur.strip()))
            cur, sign = "", ch
        elif depth == 0 and ch == "-" and not cur.strip() and not terms:
            sign = "-" if sign == "+" else "+"  # a leading minus
        else:
            cur += ch
        if not ch.isspace() and depth == 0:
            prev = ch
    terms.append((sign, cur.strip()))
    return terms if len(terms) > 1 and all(t for _, t in terms) else None


def join_terms(terms: list[tuple[str, str]]) -> str:
    first_sign, first = terms[0]
    out = ("-" if first_sign == "-" else "") + first
    return out + "".join(f" {sign} {t}" for sign, t in terms[1:])


def strip_spaces(s: str) -> str:
    """All whitespace out, except where it ends a command name before a letter (`\\cot x` stays)."""
    out = []
    for i, ch in enumerate(s):
        if ch.isspace():
            before = re.search(r"\\[A-Za-z]+$", "".join(out))
            after = s[i + 1 : i + 2]
            if before and after.isalpha() and (not out or out[-1] != " "):
                out.append(" ")
            continue
        out.append(ch)
    return "".join(out)


def add_spaces(s: str) -> str:
    """A space after each comma and around binary + - = (`x^3+3x-6` -> `x^3 + 3x - 6`); not in `58,500`."""
    s = re.sub(r"(?<![0-9]),(?=\S)|,(?=\S)(?![0-9]{3}(?![0-9])|\\!)", ", ", s)
    s = re.sub(r"(?<=[0-9A-Za-z}\)])\s*([+=]|-(?![0-9]*\}))\s*(?=[0-9A-Za-z\\({])", r" \1 ", s)
    return s


def decimal_text(q: Fraction) -> str | None:
    """The terminating decimal of q (`3/2` -> `1.5`), or None if it does not terminate."""
    d, twos, fives = q.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    if d != 1:
        return None
    k = max(twos, fives)  # 1/8 = 125/1000: three places
    sign = "-" if q < 0 else ""
    n = abs(q.numerator) * 10**k // q.denominator
    if k == 0:
        return sign + str(n)
    digits = str(n).rjust(k + 1, "0")
    return f"{sign}{digits[:-k]}.{digits[-k:]}"


def brace_fracs(s: str) -> str:
    """One-digit `\\frac` arguments braced: `\\frac9{19}` -> `\\frac{9}{19}`, `\\frac 34` -> `\\frac{3}{4}`."""
    arg = r"(\{[^{}]*\}|[0-9])"
    return re.sub(
        r"\\([dt]?frac)\s*" + arg + r"\s*" + arg,
        lambda m: "\\" + m.group(1) + "".join(a if a.startswith("{") else "{" + a + "}" for a in m.group(2, 3)),
        s,
    )


def frac_text(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


# ---------------------------------------------------------------- answer types


def answer_type(gold: str, problem: str) -> str:
    """The gold's answer type (one of TYPES), from its text (and, for `(a, b)`, the problem's wording)."""
    g = gold.strip()
    if _CHOICE.fullmatch(g) or re.fullmatch(r"\\text\{[^{}]*\}", g):
        return "text/choice"
    if "\\infty" in g or "\\cup" in g or "\\in" in g:
        return "interval"
    inner = g.replace("\\left", "").replace("\\right", "").replace(" ", "")
    if re.fullmatch(r"[(\[].*,.*[)\]]", inner) and "pmatrix" not in g and ")(" not in inner:
        mixed = inner[0] + inner[-1] in ("(]", "[)", "[]")
        if mixed or "interval" in problem.lower():
            return "interval"
        return "tuple/set"
    if "\\pm" in g or inner.startswith("\\{") or len(depth_split(g, ",")) > 1 and not parse_number(g):
        return "tuple/set"
    if "pmatrix" in g or _BASE.fullmatch(g) or re.search(r"[0-9]i$|^i$|[+-]\s*i\b", g):
        return "other"
    core = _DEGREES.sub("", g)
    m = _UNIT_TAIL.match(core)
    core = m.group("head") if m else core
    q = parse_number(core)
    if q is not None:
        if q.denominator == 1 and "." not in core:
            return "integer"
        return "decimal" if "." in core and "frac" not in core else "fraction"
    if _MIXED.fullmatch(core):
        return "fraction"
    if "\\sqrt" in g:
        return "radical"
    if "\\pi" in g:
        return "pi"
    if re.search(r"(?<!\\)[a-zA-Z]", re.sub(r"\\[A-Za-z]+", "", g)):
        return "expression"
    return "other"


# ---------------------------------------------------------------- equal rewritings


def equal_rewritings(gold: str, problem: str, kind: str) -> list[tuple[str, str]]:
    """[(rule, rewriting)]: answers equal to `gold` written another way. Each rule applies where it keeps the value."""
    g = gold.strip()
    out: list[tuple[str, str]] = []
    add = lambda rule, text: out.append((rule, text))

    # Whitespace: none where there is some, spaces after commas and around + - = where there are none.
    if re.search(r"\s", g):
        add("no spaces", strip_spaces(g))
    spaced = add_spaces(g)
    if spaced != g:
        add("spaces", spaced)
    # \frac -> \dfrac and \tfrac; \dfrac -> \frac; \frac43 <-> \frac{4}{3}.
    if re.search(r"\\frac", g):
        add("dfrac", g.replace("\\frac", "\\dfrac"))
        add("tfrac", g.replace("\\frac", "\\tfrac"))
    if "\\dfrac" in g:
        add("frac", g.replace("\\dfrac", "\\frac"))
    short = brace_fracs(g)
    if short != g:
        add("frac braces", short)
    braced = re.sub(r"\\frac\{([0-9])\}\{([0-9])\}", r"\\frac\1\2", g)
    if braced != g:
        add("frac shorthand", braced)
    # \left / \right: removed where present, added around the outer brackets of a tuple or interval.
    if "\\left" in g:
        add("no \\left\\right", re.sub(r"\\(left|right)\s*", "", g))
    elif kind in ("tuple/set", "interval") and re.fullmatch(r"[(\[][^()\[\]]*[)\]]", g):
        add("\\left\\right", f"\\left{g[0]}{g[1:-1]}\\right{g[-1]}")
    # \sqrt{5} <-> \sqrt5.
    if re.search(r"\\sqrt\{[0-9A-Za-z]\}", g):
        add("sqrt shorthand", re.sub(r"\\sqrt\{([0-9A-Za-z])\}", r"\\sqrt\1", g))
    if re.search(r"\\sqrt[0-9]", g):
        add("sqrt braces", re.sub(r"\\sqrt([0-9])", r"\\sqrt{\1}", g))
    # A single fraction as a slash: \frac{\sqrt{3}}{3} -> \sqrt{3}/3, -\frac{\pi}{6} -> -\pi/6.
    m = re.fullmatch(r"(-?)\\[dt]?frac\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", g)
    if m:
        sign, num, den = m.groups()
        atom = lambda t: re.fullmatch(r"[0-9]+|\\pi|\\sqrt\{[0-9]+\}|[0-9]*\\sqrt\{[0-9]+\}|[a-z]", t)
        num = num if atom(num) else f"({num})"
        den = den if atom(den) else f"({den})"
        add("slash", f"{sign}{num}/{den}")
    # The value of a plain number in other forms: a terminating decimal, a fraction, `5.0`, thousands separators.
    core = g
    q = parse_number(core)
    if q is not None:
        dec = decimal_text(q)
        if q.denominator == 1:
            n = q.numerator
            add("integer .0", f"{n}.0")
            if abs(n) >= 1000:
                add("thousands", f"{n:,}")
            if "," in g or "\\$" in g or "\\!" in g:
                add("plain digits", str(n))
        elif dec is not None and "." not in g:
            add("decimal", dec)
        elif "." in g:
            add("fraction", frac_text(q))
            if g.startswith("."):
                add("leading zero", "0" + g)
            elif "\\$" in g:
                add("no currency", g.replace("\\$", ""))
            else:
                add("trailing zero", g + "0")
            if abs(q) < Fraction(1, 1000):
                mant, exp = q, 0
                while abs(mant) < 1:
                    mant, exp = mant * 10, exp - 1
                mdec = decimal_text(mant)
                if mdec is not None:
                    add("scientific", f"{mdec} \\times 10^{{{exp}}}")
    # Fractions inside a tuple or interval as terminating decimals: (\frac{3}{2}, -13) -> (1.5, -13).
    if kind in ("tuple/set", "interval", "other") and _FRAC_NUM.search(g):

        def to_decimal(m: re.Match) -> str:
            a, b, c, d = m.groups()
            dec = decimal_text(Fraction(int(a or b), int(c or d)))
            return dec if dec is not None else m.group()

        dec = _FRAC_NUM.sub(to_decimal, g)
        if dec != g:
            add("decimal entries", dec)
    # x = value, for a single value that is not an equation or an expression in a variable.
    if kind in ("integer", "decimal", "fraction", "radical", "pi") and "=" not in g and not _UNIT_TAIL.match(g):
        add("x =", f"x = {g}")
    # An assignment gold x=5 given as its value.
    m = re.fullmatch(r"([a-z])\s*=\s*(-?[0-9]+)", g)
    if m:
        add("value of assignment", m.group(2))
    m = re.fullmatch(r"([a-z])\s*\\in\s*(.+)", g)
    if m:
        add("set without x \\in", m.group(2))
    # Sums in another order: the gold's terms reversed (also the right side of an equation, a fraction's numerator).
    terms = sum_terms(g)
    if terms:
        add("reordered sum", join_terms(terms[::-1]))
    m = re.fullmatch(r"([a-z])\s*=\s*(.+)", g)
    if m and sum_terms(m.group(2)):
        add("reordered sum", f"{m.group(1)} = {join_terms(sum_terms(m.group(2))[::-1])}")
    m = re.fullmatch(r"(.+?)\s*=\s*0", g)
    if m and sum_terms(m.group(1)):
        add("reordered sum", f"{join_terms(sum_terms(m.group(1))[::-1])} = 0")
    m = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", g)
    if m and sum_terms(m.group(1)):
        add("reordered sum", f"\\frac{{{join_terms(sum_terms(m.group(1))[::-1])}}}{{{m.group(2)}}}")
    # Products in another order: 3\sqrt{13} -> \sqrt{13} \cdot 3, 7\pi -> \pi \cdot 7, (a+5)(b+2) -> (b+2)(a+5).
    m = re.fullmatch(r"(-?[0-9]+)\s*(\\sqrt\{?[0-9]+\}?|\\pi|[a-zA-Z](?:\^[0-9])?)", g)
    if m:
        add("reordered product", f"{m.group(2)} \\cdot {m.group(1)}")
        add("explicit product", f"{m.group(1)} \\cdot {m.group(2)}")
    m = re.fullmatch(r"(\([^()]+\))(\([^()]+\))", g)
    if m:
        add("reordered product", m.group(2) + m.group(1))
    # Unrationalised and unsimplified radicals: \frac{\sqrt{3}}{3} -> \frac{1}{\sqrt{3}}, 3\sqrt{13} -> \sqrt{117}.
    m = re.fullmatch(r"\\frac\{\\sqrt\{([0-9]+)\}\}\{([0-9]+)\}", g)
    if m and m.group(1) == m.group(2):
        add("unrationalised", f"\\frac{{1}}{{\\sqrt{{{m.group(1)}}}}}")
    m = re.fullmatch(r"([0-9]+)\s*\\sqrt\{?([0-9]+)\}?", g)
    if m:
        add("unsimplified radical", f"\\sqrt{{{int(m.group(1)) ** 2 * int(m.group(2))}}}")
    # pi: \frac{k\pi}{n} <-> \frac{k}{n}\pi.
    m = re.fullmatch(r"(-?)\\frac\{([0-9]*)\s*\\pi\}\{([0-9]+)\}", g)
    if m:
        add("pi coefficient", f"{m.group(1)}\\frac{{{m.group(2) or 1}}}{{{m.group(3)}}}\\pi")
    # Sets in another order (never tuples or intervals): a comma list, \{...\}, a union, a \pm written out.
    if kind == "tuple/set":
        inner = g[2:-2] if g.startswith("\\{") and g.endswith("\\}") else None
        items = depth_split(inner if inner is not None else g, ",")
        if len(items) > 1 and not g.startswith(("(", "\\left")):
            rev = ", ".join(t.strip() for t in items[::-1])
            add("reordered set", f"\\{{{rev}\\}}" if inner is not None else rev)
        expanded = []
        for item in (t.strip() for t in items):
            m = re.fullmatch(r"([^{}]*?)\s*\\pm\s*(.+)", item)
            expanded += [f"{m.group(1)} + {m.group(2)}", f"{m.group(1)} - {m.group(2)}"] if m else [item]
        if len(expanded) > len(items):
            add("\\pm written out", f"\\{{{', '.join(expanded)}\\}}" if inner is not None else ", ".join(expanded))
    if "\\cup" in g:
        add("reordered union", " \\cup ".join(p.strip() for p in g.split("\\cup")[::-1]))
    # Degrees: the mark removed, braced, spelled; added where the problem asks for degrees.
    if _DEGREES.search(g):
        value = _DEGREES.sub("", g).strip()
        add("no degree mark", value)
        add("^{\\circ}", f"{value}^{{\\circ}}")
        add("degrees in words", f"{value} \\text{{ degrees}}")
    elif q is not None and q.denominator == 1 and "degree" in problem.lower():
        add("degree mark added", f"{g}^\\circ")
    # A stated unit: removed, \text <-> \mbox, "square" for ^2.
    m = _UNIT_TAIL.match(g)
    if m:
        head, unit, power = m.group("head"), m.group("unit").strip(), m.group("pow") or ""
        add("no unit", head)
        add(
            "unit in \\text" if "mbox" in g else "unit in \\mbox",
            f"{head} \\{'text' if 'mbox' in g else 'mbox'}{{ {unit}}}{power}",
        )
        if power:
            add("square unit in words", f"{head} \\text{{ square {unit}}}")
        if unit == "degrees":
            add("degree mark", f"{head}^\\circ")
    # Multiple choice: C, (C), \textbf{(C)}.
    m = _CHOICE.fullmatch(g)
    if m:
        add("bare letter", m.group(1))
        add("letter in parentheses", f"({m.group(1)})")
        add("textbf", f"\\textbf{{({m.group(1)})}}")
    # Text answers unwrapped or in another wrapper.
    m = re.fullmatch(r"\\text\{([A-Za-z]+)\}", g)
    if m:
        add("no \\text", m.group(1))
        add("\\mathrm", f"\\mathrm{{{m.group(1)}}}")
    # Bases: 52_8 <-> 52_{8}.
    m = _BASE.fullmatch(g)
    if m:
        add(
            "base braces" if "{" not in g else "base no braces",
            f"{m.group(1)}_{{{m.group(2)}}}" if "{" not in g else f"{m.group(1)}_{m.group(2)}",
        )
    # Mixed numbers: 1\frac{4}{5} -> \frac{9}{5}, 1.8.
    m = _MIXED.fullmatch(g)
    if m:
        v = int(m.group(1)) + Fraction(int(m.group(2)), int(m.group(3)))
        add("improper fraction", frac_text(v))
        dec = decimal_text(v)
        if dec is not None:
            add("decimal", dec)
    # Matrices and vectors: bmatrix, a/b entries as \frac.
    if "pmatrix" in g:
        out[:] = [(rule, text) for rule, text in out if rule != "spaces"]  # `- 1/3` in a matrix is not a rewriting
        add("bmatrix", g.replace("pmatrix", "bmatrix"))
        fr = re.sub(r"(-?)([0-9]+)/([0-9]+)", r"\1\\frac{\2}{\3}", g)
        if fr != g:
            add("frac entries", fr)
    # Exponents in braces: x^5 -> x^{5}.
    if re.search(r"\^[0-9A-Za-z]", g) and "\\circ" not in g:
        add("exponent braces", re.sub(r"\^([0-9A-Za-z])", r"^{\1}", g))
    # A common integer factor taken out of a sum: 2k+2 -> 2(k + 1), 15x - 80 -> 5(3x - 16).
    terms = sum_terms(g)
    if terms and not re.search(r"\\(?!sqrt)|\(", g):
        coef = [re.match(r"[0-9]*", t).group() for _, t in terms]
        nums = [int(c) if c else 1 for c in coef]
        common = 0
        for n in nums:
            common = math.gcd(common, n)
        if common > 1:
            rest = []
            for (sign, t), c, n in zip(terms, coef, nums):
                body = t[len(c) :].strip()
                k = n // common
                rest.append((sign, (str(k) if k != 1 or not body else "") + body))
            add("common factor", f"{common}({join_terms(rest)})")
    # A product of two binomials expanded: (a+5)(b+2) -> ab + 2a + 5b + 10.
    m = re.fullmatch(r"\(([a-z])\s*\+\s*([0-9]+)\)\(([a-z])\s*\+\s*([0-9]+)\)", g)
    if m:
        x, c, y, d = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
        add("expanded product", f"{x}{y} + {d}{x} + {c}{y} + {c * d}")
    # Sets with and without braces: 3, 5, 7 <-> \{3, 5, 7\}.
    if kind == "tuple/set" and "\\pm" not in g and not g.startswith(("(", "\\left", "\\{")):
        add("braced set", f"\\{{{g}\\}}")
    if g.startswith("\\{") and g.endswith("\\}"):
        add("set without braces", g[2:-2])
    # Text answers capitalised: east -> East.
    m = re.fullmatch(r"\\text\{([a-z]+)\}", g)
    if m:
        add("capitalised", m.group(1).capitalize())
    # The minus sign in the numerator: -\frac{\pi}{6} -> \frac{-\pi}{6}.
    m = re.fullmatch(r"-\\frac\{([^{}]+)\}\{([^{}]+)\}", g)
    if m:
        add("minus in numerator", f"\\frac{{-{m.group(1)}}}{{{m.group(2)}}}")
    # An improper fraction as a mixed number: \frac{14}{3} -> 4\frac{2}{3}.
    if q is not None and q.denominator != 1 and abs(q) > 1 and "." not in g:
        whole, part = divmod(abs(q.numerator), q.denominator)
        add("mixed number", f"{'-' if q < 0 else ''}{whole}\\frac{{{part}}}{{{q.denominator}}}")
    # The rational coefficient of a radical in front: \frac{3\sqrt{3}}{4} -> \frac{3}{4}\sqrt{3}.
    m = re.fullmatch(r"(-?)\\frac\{([0-9]*)\s*(\\sqrt\{[0-9]+\})\}\{([0-9]+)\}", g)
    if m:
        add("coefficient in front", f"{m.group(1)}\\frac{{{m.group(2) or 1}}}{{{m.group(4)}}}{m.group(3)}")
    # Fractions of pi inside a tuple or interval with a slash: (3, \frac{\pi}{2}) -> (3, \pi/2).
    if kind in ("tuple/set", "interval") and re.search(r"\\frac\{[^{}]*\\pi[^{}]*\}\{[0-9]+\}", g):
        add("slash entries", re.sub(r"\\frac\{([^{}]*\\pi[^{}]*)\}\{([0-9]+)\}", r"\1/\2", g))
    # A column vector as a tuple: \begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix} -> (-2, -14, -7).
    m = re.fullmatch(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", g)
    if m and "&" not in m.group(1):
        add("vector as tuple", "(" + ", ".join(e.strip() for e in m.group(1).split("\\\\")) + ")")
    # The degree sign as a character: 90^\circ -> 90°.
    if _DEGREES.search(g):
        add("degree sign", _DEGREES.sub("", g).strip() + "\u00b0")
    # Trigonometric functions: parenthesised argument, and cot as cos/sin.
    m = re.fullmatch(r"\\(sin|cos|tan|cot|sec|csc)\s+([a-z])", g)
    if m:
        add("parenthesised argument", f"\\{m.group(1)}({m.group(2)})")
        if m.group(1) == "cot":
            add("cos over sin", f"\\frac{{\\cos {m.group(2)}}}{{\\sin {m.group(2)}}}")
            add("one over tan", f"\\frac{{1}}{{\\tan {m.group(2)}}}")
    return distinct(out, g)


# ---------------------------------------------------------------- wrong, approximate, unit, hedge


def increment_first_integer(g: str) -> str | None:
    """`g` with its first integer literal (outside \\text) plus one: `\\frac{3}{2}` -> `\\frac{4}{2}`."""
    g = brace_fracs(g)  # `\\frac9{19}` + 1 is `\\frac{10}{19}`, not `\\frac10{19}`
    masked = _TEXT.sub(lambda m: "#" * len(m.group()), g)
    m = re.search(r"[0-9]+", masked)
    if m is None:
        return None
    return g[: m.start()] + str(int(m.group()) + 1).zfill(len(m.group())) + g[m.end() :]


def wrong_answers(gold: str, kind: str, text_golds: list[str]) -> list[tuple[str, str]]:
    """[(rule, answer)]: answers that differ from `gold` in value."""
    g = gold.strip()
    out: list[tuple[str, str]] = []
    inc = increment_first_integer(g)
    if inc is not None and not _CHOICE.fullmatch(g):
        out.append(("first integer + 1", inc))
    q = parse_number(g)
    if q is not None and q != 0:
        out.append(("negated", frac_text(-q) if "frac" in g else (decimal_text(-q) or frac_text(-q))))
        out.append(("doubled", decimal_text(2 * q) if "." in g else frac_text(2 * q)))
    elif kind in ("radical", "pi", "fraction") and not g.startswith("-"):
        out.append(("negated", f"-{g}"))
    elif kind in ("radical", "pi", "fraction"):
        out.append(("negated", g[1:]))
    if kind == "tuple/set" and g.startswith(("(", "\\left(")):
        inner = re.sub(r"^\\left\(|\\right\)$", "", g)
        inner = inner[1:-1] if inner.startswith("(") else inner
        items = [t.strip() for t in depth_split(inner, ",")]
        if len(set(items)) > 1:
            out.append(("tuple reversed", "(" + ", ".join(items[::-1]) + ")"))
    if kind == "interval":
        m = re.search(r"(\\left)?([(\[])(?!\s*-\\infty)", g)
        if m is not None and "\\in" not in g:
            flip = "[" if m.group(2) == "(" else "("
            out.append(("bracket flipped", g[: m.start(2)] + flip + g[m.end(2) :]))
        m = re.search(r"(?<!\\infty)([)\]])", g)
        if m is not None:
            flip = "]" if m.group(1) == ")" else ")"
            flipped = g[: m.start(1)] + flip + g[m.end(1) :]
            if "\\infty" + flip not in flipped.replace(" ", ""):
                out.append(("bracket flipped", flipped))
    m = _CHOICE.fullmatch(g)
    if m:
        out.append(("next letter", f"\\text{{({chr((ord(m.group(1)) - ord('A') + 1) % 5 + ord('A'))})}}"))
        out.append(("next letter, bare", chr((ord(m.group(1)) - ord("A") + 1) % 5 + ord("A"))))
    elif kind == "text/choice":
        other = [t for t in text_golds if t != g and not _CHOICE.fullmatch(t)]
        if other:
            out.append(("another text answer", other[0]))
    m = _BASE.fullmatch(g)
    if m:
        out.append(("another base", f"{m.group(1)}_{{{int(m.group(2)) + 1}}}"))
    if inc is None and not out:
        out.append(("plus one", f"{g} + 1"))
    return distinct(out, g)


def approximations(gold: str, kind: str) -> list[tuple[str, str]]:
    """[(rule, answer)]: decimal approximations of a gold whose value is not a terminating decimal."""
    if kind not in ("fraction", "radical", "pi", "tuple/set", "interval") and "degrees" not in gold:
        return []
    from math_verify import parse  # the probe's own use of the library: the gold's numeric value

    core = gold
    m = _UNIT_TAIL.match(core)
    unit = ""
    if m:
        core, unit = m.group("head"), f" \\text{{ {m.group('unit').strip()}}}"
    try:
        parsed = parse("\\boxed{" + core + "}", fallback_mode="no_fallback")
    except Exception:
        return []
    if not parsed:
        return []
    expr = parsed[0]
    import sympy

    def approx(x, places: int) -> str | None:
        if not getattr(x, "is_number", False) or not x.is_real or x.is_infinite:
            return None
        if x.is_Rational and decimal_text(Fraction(int(x.p), int(x.q))) is not None:
            return None  # terminates: its decimal is exact, not an approximation
        return f"{float(sympy.N(x, 30)):.{places}f}"

    out = []
    for places in (3, 4, 6, 10):
        if isinstance(expr, (sympy.Tuple, sympy.Interval)) or type(expr).__name__ == "FiniteSet":
            if isinstance(expr, sympy.Interval):
                ends = [expr.start, expr.end]
            else:
                ends = list(expr.args)
            texts = [approx(x, places) for x in ends]
            if all(t is None for t in texts):
                return []
            exact = [t if t is not None else sympy.latex(x) for t, x in zip(texts, ends)]
            if isinstance(expr, sympy.Interval):
                left = "(" if expr.left_open else "["
                right = ")" if expr.right_open else "]"
                out.append((f"{places} places", f"{left}{exact[0]}, {exact[1]}{right}"))
            elif isinstance(expr, sympy.Tuple):
                out.append((f"{places} places", "(" + ", ".join(exact) + ")"))
            else:
                out.append((f"{places} places", ", ".join(exact)))
        else:
            text = approx(expr, places)
            if text is None:
                return []
            out.append((f"{places} places", text + unit))
    return out


_OTHER_UNIT = {"inches": "feet", "cm": "m", "cents": "dollars", "degrees": "radians"}


def wrong_units(gold: str) -> list[tuple[str, str]]:
    """[(rule, answer)]: the gold's value with another unit (only for a gold that states its unit)."""
    g = gold.strip()
    out = []
    if _DEGREES.search(g):
        value = _DEGREES.sub("", g).strip()
        out.append(("radians for degrees", f"{value} \\text{{ radians}}"))
    m = _UNIT_TAIL.match(g)
    if m:
        head, unit, power = m.group("head"), m.group("unit").strip(), m.group("pow") or ""
        other = _OTHER_UNIT.get(unit.split()[0], "meters")
        out.append(("another unit", f"{head} \\text{{ {other}}}{power}"))
        if power:
            out.append(("power dropped", f"{head} \\text{{ {unit}}}"))
    return out


def hedges(gold: str, wrong: str, kind: str) -> list[tuple[str, str]]:
    """[(rule, completion)]: the gold and a wrong answer offered together."""
    out = [
        ("two boxes, right first", f"I think it is $\\boxed{{{gold}}}$, but it could also be $\\boxed{{{wrong}}}$."),
        ("two boxes, right last", f"It could be $\\boxed{{{wrong}}}$, but I think it is $\\boxed{{{gold}}}$."),
        ("a \\text{ or } b", completion(f"{gold} \\text{{ or }} {wrong}")),
        ("b \\text{ or } a", completion(f"{wrong} \\text{{ or }} {gold}")),
        ("a or b", completion(f"{gold} or {wrong}")),
    ]
    if kind not in ("tuple/set", "interval"):
        out.append(("a, b", completion(f"{gold}, {wrong}")))
    return out


def completion(answer: str) -> str:
    return f"Let me work through the problem step by step.\nTherefore, the final answer is $\\boxed{{{answer}}}$."


# ---------------------------------------------------------------- running and reporting


def timed(text: str, gold: str, symbolic: bool, stats: dict) -> float | None:
    """math_reward(text, gold) timed; None (and counted) if it raised."""
    t0 = time.perf_counter()
    try:
        r = (symbolic_reward if symbolic else math_reward)(text, gold)
    except Exception as e:  # the probe counts what escapes; math_reward must never raise
        stats["exceptions"].append(f"{type(e).__name__}: {e}"[:200])
        r = None
    stats["ms"].append((time.perf_counter() - t0) * 1000)
    return r


def math_verify_alone(text: str, gold: str) -> bool:
    """math-verify as it is usually called: its own extraction from the whole completion, its defaults."""
    from math_verify import parse, verify

    try:
        return bool(verify(parse("\\boxed{" + gold + "}"), parse(text)))
    except Exception:
        return False


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def read_jsonl(path: Path, limit: int | None) -> list[dict]:
    with path.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def probe_math(rows: list[dict], compare: bool) -> tuple[dict, list[str], dict]:
    """Per answer type: counts of each kind and how many were credited; the misjudged items; per rule:
    [items, credited]. All items are built first, then timed in one pass (math-verify alone after it)."""
    per = {t: defaultdict(int) | {"ms": [], "exceptions": []} for t in TYPES}
    rules: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    misjudged: list[str] = []
    text_golds = sorted({r["answer"].strip() for r in rows if answer_type(r["answer"], r["problem"]) == "text/choice"})
    items = []  # (answer type, gold, kind of item, rule, completion, expected reward)
    for row in rows:
        gold, problem = row["answer"].strip(), row["problem"]
        kind = answer_type(gold, problem)
        per[kind]["golds"] += 1
        wrong = wrong_answers(gold, kind, text_golds)
        mine = [("as written", "written", completion(gold), 1.0)]
        mine += [("equal", rule, completion(a), 1.0) for rule, a in equal_rewritings(gold, problem, kind)]
        mine += [("wrong", rule, completion(a), 0.0) for rule, a in wrong]
        mine += [("approx", rule, completion(a), 0.0) for rule, a in approximations(gold, kind)]
        mine += [("unit", rule, completion(a), 0.0) for rule, a in wrong_units(gold)]
        if wrong:
            mine += [("hedge", rule, c, 0.0) for rule, c in hedges(gold, wrong[0][1], kind)]
        items += [(kind, gold, *item) for item in mine]
    for kind, gold, group, rule, text, expected in items:
        st = per[kind]
        r = timed(text, gold, True, st)
        st[group] += 1
        st[group + " credited"] += r == 1.0
        rules[group, rule][0] += 1
        rules[group, rule][1] += r == 1.0
        if r != expected:
            answer = text.rsplit("$\\boxed{", 1)[-1][:-3] if group != "hedge" else text
            misjudged.append(f"| {kind} | {group} | {rule} | `{gold}` | `{answer}` | {r} |")
    if compare:
        for kind, gold, group, _, text, _ in items:
            per[kind][group + " math-verify"] += math_verify_alone(text, gold)
    return per, misjudged, rules


def probe_gsm8k(rows: list[dict]) -> list[dict]:
    out = []
    data = []
    for row in rows:
        reasoning, gold = row["answer"].rsplit("####", 1)
        data.append((reasoning.rstrip(), gold.strip().replace(",", "")))
    for symbolic in (False, True):
        for form in ("#### x", "\\boxed{x}"):
            st = {"ms": [], "exceptions": []}
            right = wrong = 0
            for reasoning, gold in data:
                fmt = (
                    (lambda x: f"{reasoning}\n#### {x}")
                    if form == "#### x"
                    else (lambda x: f"{reasoning}\nThe answer is $\\boxed{{{x}}}$.")
                )
                right += timed(fmt(gold), gold, symbolic, st) == 1.0
                wrong += timed(fmt(str(int(gold) + 1)), gold, symbolic, st) == 1.0
            out.append(
                {
                    "symbolic": symbolic,
                    "form": form,
                    "golds": len(data),
                    "credited": right,
                    "wrong credited": wrong,
                    **st,
                }
            )
    return out


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def report(per: dict, misjudged: list[str], rules: dict, gsm: list[dict], command: str, seconds: float) -> str:
    from importlib.metadata import version

    lines = [
        "# Verifier probe: `reward.math_reward` on MATH-500 and GSM8K golds",
        "",
        "```",
        command,
        "```",
        "",
        f"Built by studies/verifier_probe.py (its docstring says how); python {platform.python_version()}, "
        f"math-verify {version('math-verify')}, {seconds:.0f} s in all. The rules: docs/math-verifier.md. "
        "Times are per call (time.perf_counter), after one untimed call that imports math-verify; "
        "they depend on the machine and its load.",
        "",
        "## MATH-500, symbolic=True",
        "",
        "Equal = rewritings of the gold that keep its value (the gold as written is counted apart); wrong, approx "
        "(decimal approximations of non-terminating golds), unit (the gold's unit replaced) and hedge (the gold "
        "and a wrong answer together) must all score 0.",
        "",
        "| type | golds | as written credited | equal rewritings | equal credited | wrong credited | approx credited "
        "| wrong unit credited | hedged credited | exceptions | p50 ms | p99 ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    total = defaultdict(int) | {"ms": [], "exceptions": []}
    for st in per.values():
        for k, v in st.items():
            total[k] += v
    for t in (*TYPES, "total"):
        st = total if t == "total" else per[t]
        if not st["golds"]:
            continue
        name = f"**{t}**" if t == "total" else t
        lines.append(
            f"| {name} | {st['golds']} | {st['as written credited']}/{st['as written']} | {st['equal']} "
            f"| {st['equal credited']} ({pct(st['equal credited'], st['equal'])}) "
            f"| {st['wrong credited']}/{st['wrong']} | {st['approx credited']}/{st['approx']} "
            f"| {st['unit credited']}/{st['unit']} | {st['hedge credited']}/{st['hedge']} | {len(st['exceptions'])} "
            f"| {percentile(st['ms'], 50):.2f} | {percentile(st['ms'], 99):.1f} |"
        )
    if total["as written math-verify"] or total["equal math-verify"]:
        lines += [
            "",
            "The same items scored by math-verify alone, as it is usually called (`verify(parse(gold), "
            "parse(completion))`: its own extraction from the whole completion, its defaults):",
            "",
            "| type | as written credited | equal credited | wrong credited | approx credited | wrong unit credited "
            "| hedged credited |",
            "|---|--:|--:|--:|--:|--:|--:|",
        ]
        for t in (*TYPES, "total"):
            st = total if t == "total" else per[t]
            if not st["golds"]:
                continue
            cells = [
                f"{st[g + ' math-verify']}/{st[g]}" for g in ("as written", "equal", "wrong", "approx", "unit", "hedge")
            ]
            lines.append(f"| {'**total**' if t == 'total' else t} | " + " | ".join(cells) + " |")
    lines += ["", "### Misjudged items", ""]
    if misjudged:
        lines += ["| type | kind | rule | gold | answer | reward |", "|---|---|---|---|---|--:|", *misjudged]
    else:
        lines.append("None: every equal rewriting credited, every other item 0.")
    lines += ["", "### Items by rule", "", "| kind | rule | items | credited |", "|---|---|--:|--:|"]
    order = {"as written": 0, "equal": 1, "wrong": 2, "approx": 3, "unit": 4, "hedge": 5}
    for (group, rule), (n, credited) in sorted(rules.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        lines.append(f"| {group} | {rule} | {n} | {credited} |")
    exc = total["exceptions"] + [e for g in gsm for e in g["exceptions"]]
    if exc:
        lines += ["", "### Exceptions", "", *sorted(set(f"- `{e}`" for e in exc))]
    lines += [
        "",
        "## GSM8K test golds",
        "",
        "The test set's own reasoning, then the gold as `#### x` or `The answer is $\\boxed{x}$.`; wrong = the gold "
        "plus one.",
        "",
        "| symbolic | form | golds | credited | wrong credited | exceptions | p50 ms | p99 ms |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for g in gsm:
        lines.append(
            f"| {g['symbolic']} | `{g['form']}` | {g['golds']} | {g['credited']} ({pct(g['credited'], g['golds'])}) "
            f"| {g['wrong credited']} | {len(g['exceptions'])} | {percentile(g['ms'], 50):.3f} "
            f"| {percentile(g['ms'], 99):.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="probe only the first N golds of each data set")
    ap.add_argument("--out", default=str(OUT), help="where the Markdown report goes (default: %(default)s)")
    ap.add_argument(
        "--vs-math-verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score every MATH-500 item with math-verify alone, for comparison (default: on)",
    )
    ap.add_argument(
        "--data",
        required=True,
        help="the folder with math500/test.jsonl and gsm8k/test.jsonl (HuggingFaceH4/MATH-500, openai/gsm8k)",
    )
    args = ap.parse_args(argv)
    data = Path(args.data)
    t0 = time.perf_counter()
    symbolic_reward("\\boxed{x}", "y")  # math-verify's first import and set-up, kept out of the times
    per, misjudged, rules = probe_math(read_jsonl(data / "math500" / "test.jsonl", args.limit), args.vs_math_verify)
    gsm = probe_gsm8k(read_jsonl(data / "gsm8k" / "test.jsonl", args.limit))
    command = "python -m studies.verifier_probe" + (f" --limit {args.limit}" if args.limit else "") + " --data DATA"
    text = report(per, misjudged, rules, gsm, command, time.perf_counter() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
