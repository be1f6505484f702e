"""Hostile inputs for the verifier: (completion, gold) pairs that must all score 0.0.

The reward is optimised against, so the verifier is tested the way a policy would probe it: huge
and deeply nested inputs (must stay fast and never raise), forms that lenient graders wrongly credit
(exponents, Unicode digits, split digits), and near-miss numbers. Every completion here is NOT a
correct answer for its gold under the rules of `reward.py`, so any reward of 1.0 is a wrongly
credited answer. Wrong values are computed here with `Fraction` arithmetic, independently of
`reward.py`, and checked to differ from the gold before they are formatted.
"""

import random
import string
import time
from fractions import Fraction

_UNICODE_DIGITS = ("٠١٢٣٤٥٦٧٨٩", "０１２３４５６７８９", "⁰¹²³⁴⁵⁶⁷⁸⁹", "०१२३४५६७८९", "𝟎𝟏𝟐𝟑𝟒𝟓𝟔𝟕𝟖𝟗")
# Junk without ASCII digits: every number `reward.py` accepts needs one, so such junk can never be
# correct, whatever the random draw. Unicode digits and minus signs are in, to tempt isdigit().
_JUNK = string.ascii_letters + " \n\t\r#\\{}$%.,-+/*^()=_\x00\u2212٤４²" + "boxed" * 4
_MB = 1 << 20


def _gold(rng: random.Random) -> tuple[Fraction, str]:
    """A nonzero gold value and its text (sometimes with thousands commas, sometimes a fraction)."""
    kind = rng.random()
    if kind < 0.1:
        q = rng.randint(2, 12)
        v = Fraction(rng.choice([1, -1]) * rng.randint(1, 100), q)
        if v.denominator != 1:
            return v, f"{v.numerator}/{v.denominator}"
    v = Fraction(rng.choice([rng.randint(1, 99), rng.randint(100, 10**7), -rng.randint(1, 10**4)]))
    return v, (f"{int(v):,}" if abs(v) >= 1000 and rng.random() < 0.3 else str(int(v)))


def _fmt(rng: random.Random, w: Fraction) -> str:
    """An ASCII rendering of `w` in one of the accepted formats (so only its value is wrong)."""
    if w.denominator == 1:
        i = int(w)
        return rng.choice([str(i), f"{i:,}", f"${i}", f"{i}.0", f"{i}%", f"{i}."])
    p, q = w.numerator, w.denominator
    return rng.choice([f"{p}/{q}", f"\\frac{{{p}}}{{{q}}}", f"\\dfrac{{{p}}}{{{q}}}"])


def _wrong(rng: random.Random, v: Fraction) -> str:
    """A near miss of `v`: off by one, x10, /2, sign flipped, a digit changed/dropped/added."""
    ops = [
        lambda: v + 1,
        lambda: v - 1,
        lambda: v * 10,
        lambda: v / 2,
        lambda: -v,
        lambda: v + Fraction(1, 10),
        lambda: v / 10,
    ]
    if v.denominator == 1:
        s = str(abs(int(v)))
        sign = -1 if v < 0 else 1

        def changed():
            k = rng.randrange(len(s))
            # The leading digit never becomes 0: "072" would equal 72, not be a near miss.
            choices = [d for d in "0123456789" if d != s[k] and (k or d != "0")]
            return sign * Fraction(int(s[:k] + rng.choice(choices) + s[k + 1 :]))

        def dropped():
            k = rng.randrange(len(s))
            t = s[:k] + s[k + 1 :]
            return sign * Fraction(int(t)) if t else v + 1

        ops += [changed, dropped, lambda: sign * Fraction(int(s + rng.choice("0123456789")))]
    w = rng.choice(ops)()
    return _fmt(rng, w if w != v else v + 1)


def _reasoning(rng: random.Random) -> str:
    return rng.choice(["", "Let me think step by step.\n", "We compute 3 + 4 = 7 and 7 * 2 = 14.\n"])


def _one(rng: random.Random) -> tuple[str, str]:
    """One hostile pair; the cases are ordered by frequency, the costly ones rare."""
    v, gold = _gold(rng)
    wrong = _wrong(rng, v)
    digits = str(abs(v.numerator))
    r = rng.random()
    if r < 0.0005:  # megabyte strings (a few per 20,000)
        return rng.choice(
            [
                "x" * _MB + "\n#### " + wrong,
                "#### " + gold + "\n" + "a" * _MB + "\n#### " + wrong,
                "9" * _MB,
                "\\boxed{" * (_MB // 7),
                "####" * (_MB // 4),
                "\x00" * _MB,
                "\\boxed{" + gold + "}" + "}" * _MB + "\\boxed{" + wrong + "}",
            ]
        ), gold
    if r < 0.01:  # 10^5-digit and over-long numbers
        return rng.choice(
            [
                "#### " + "9" * 100_000,
                "#### " + digits + "0" * 100_000,
                "9" * 100_000,
                "\\boxed{" + "1" * 4_000 + "}",
                "#### " + "7" * 4_000,
                "#### " + gold + "." + "0" * 200 + "1",  # gold + 10^-201: close, but > 100 digits
                "#### " + digits + "0" * 101,
            ]
        ), gold
    if r < 0.03:  # nested / unterminated / ill-nested \boxed
        k = rng.choice([2, 10, 100, 1000, 3000, 6000])
        return rng.choice(
            [
                "\\boxed{" * k + wrong + "}" * k,
                "\\boxed{" * k + gold,  # never closed: no answer
                "\\boxed{" + gold + " {" * k,
                "}" * k + "\\boxed{" + wrong + "}" + "{" * k,
                "\\boxed{" + gold + "} " * (k // 10 + 1) + "\\boxed{" + wrong + "}",
            ]
        ), gold
    if r < 0.06:  # exponents and other expressions
        return "#### " + rng.choice(
            [
                "1e999999",
                "10**10**10",
                "2^10",
                "1E5",
                f"{digits}e1",
                f"{digits}e-1",
                "10^{100}",
                f"{digits}*10",
                f"{digits}+1",
                f"0x{int(digits):x}0",
            ]
        ), gold
    if r < 0.10:  # NUL bytes, Unicode digits and minus signs
        table = rng.choice(_UNICODE_DIGITS)
        uni = "".join(table[int(c)] for c in digits)
        nul = digits[:1] + "\x00" + digits[1:] if len(digits) > 1 else "\x00" + digits + "\x00" + "1"
        pos = str(abs(v.numerator))  # only used for a positive gold below
        return (
            rng.choice(
                [
                    "#### " + uni,
                    "\\boxed{" + uni + "}",
                    uni,
                    "#### " + nul,
                    "\x00" * 100 + "#### " + wrong,
                    "#### " + ("\u2212" + pos if v > 0 else wrong),  # U+2212 flips a positive gold's sign
                    "#### " + digits[:1] + table[int(digits[-1])] if len(digits) > 1 else "#### " + uni,
                ]
            ),
            gold,
        )
    if r < 0.18:  # repeated answers, the last one wrong
        k = rng.randint(1, 50)
        return rng.choice(
            [
                ("#### " + gold + "\n") * k + "#### " + wrong,
                "\\boxed{" + gold + "}\n#### " + wrong,
                "#### " + wrong + "\nSo the answer is \\boxed{" + gold + "}",
                ("\\boxed{" + gold + "} ") * k + "\\boxed{" + wrong + "}",
                "#### " + gold + "\n" + "filler " * 700 + "\n#### " + wrong,
            ]
        ), gold
    if r < 0.23:  # malformed versions of the gold itself
        d = digits if len(digits) > 1 else digits + "1"
        return (
            "#### "
            + rng.choice(
                [
                    d[0] + " " + d[1:],  # split digits
                    d[:-1] + "," + d[-1:],  # bad thousands grouping ("7,2", "123,4")
                    digits + "/0",
                    f"\\frac{{{digits}}}{{0}}",  # division by zero
                    digits + ".2.0",
                    "+-" + digits,
                    digits + "//1",
                    "/" + digits,
                ]
            ),
            gold,
        )
    if r < 0.26:  # empty and answer-less
        return rng.choice(
            ["", " ", "\n", "####", "#### ", "\\boxed{}", "\\boxed{", "}", "{}", "$", "%", "-", ".", "/", "\\frac{}{}"]
        ), gold
    if r < 0.36:  # random junk, with or without a wrong answer
        junk = "".join(rng.choices(_JUNK, k=rng.randint(0, 3000)))
        return (junk if rng.random() < 0.5 else junk + "\n#### " + wrong), gold
    # Near-miss numbers in each answer position (the bulk of the set).
    return rng.choice(
        [
            _reasoning(rng) + "#### " + wrong,
            _reasoning(rng) + "The answer is \\boxed{" + wrong + "}.",
            wrong,
        ]
    ), gold


def hostile_inputs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (completion, gold) pairs, none of which is a correct answer; deterministic in `seed`."""
    rng = random.Random(seed)
    return [_one(rng) for _ in range(n)]


def verifier_timing(n: int = 20000, seed: int = 0) -> dict:
    """Time `math_reward` on each of `hostile_inputs(n, seed)`: {"n", "p50_ms", "p99_ms", "max_ms"}."""
    from reward import math_reward  # here, so importing this file needs no path

    times = []
    for completion, gold in hostile_inputs(n, seed):
        t0 = time.perf_counter()
        math_reward(completion, gold)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"n": n, "p50_ms": times[n // 2], "p99_ms": times[min(n - 1, (99 * n) // 100)], "max_ms": times[-1]}
