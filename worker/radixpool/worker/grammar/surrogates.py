"""Keeping UTF-8-encoded surrogates out of every grammar the engine compiles.

xgrammar matches text byte by byte and reads three bytes ED A0-BF xx as one character, a
surrogate code point, which no UTF-8 decoder accepts. A byte-level tokenizer has tokens for each
of those bytes, so a grammar whose character class admits a surrogate lets the model write text
that decodes to U+FFFD replacement characters: it no longer matches the regex it was constrained
by, nor the schema's length bounds. Negated classes (`[^x]`) and the regex `.` (`[\\0-\\U0010ffff]`)
admit them; here every such class excludes them.
"""

from __future__ import annotations

SURROGATES = r"\ud800-\udfff"
_ANY = r"[\0-\U0010ffff]"
_ANY_BUT_SURROGATES = r"[\0-\ud7ff\ue000-\U0010ffff]"


def exclude_surrogates(ebnf: str) -> str:
    """`ebnf` (xgrammar's EBNF, as `str(Grammar)` prints it) with no class admitting a
    surrogate; quoted literals are left as they are."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':                       # a literal: copy to its closing quote
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif ebnf.startswith(_ANY, i):
            out.append(_ANY_BUT_SURROGATES)
            i += len(_ANY)
        elif ebnf.startswith("[^", i) and not ebnf.startswith(SURROGATES, i + 2):
            out.append("[^" + SURROGATES)
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def exclude_surrogates_from_regex(pattern: str) -> str:
    """A regular expression like `pattern` whose `.` and negated classes match no surrogate.
    (A JSON schema's `pattern` reaches xgrammar as a regex, not as EBNF this module can mend.)"""
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            out.append(c)
        elif c == "[":
            in_class = True
            negated = pattern.startswith("[^", i)
            out.append("[^" + SURROGATES if negated else "[")
            i += 1 + negated
            continue
        else:
            out.append("[^" + SURROGATES + "]" if c == "." else c)
        i += 1
    return "".join(out)
