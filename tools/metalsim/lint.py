"""Lint for Metal Shading Language sources (``*.metal`` and the ``*.h`` headers they include).

The MSL emulator builds kernels with clang, and clang accepts much more C++ than Apple's Metal compiler.
This lint rejects those constructs. It also rejects the ones that break emulation, such as a ``simd_sum``
that only some lanes of a simdgroup reach. Run it with::

    PYTHONPATH=tools python -m metalsim.lint metal            # dirs are searched for *.metal and *.h
    PYTHONPATH=tools python -m metalsim.lint --rules          # list the rules and why they exist

It prints ``file:line:col: rule: message`` for each finding. The exit status is 1 when anything is
found and 0 when the sources are clean.

Python API: ``check_source(text, filename) -> list[Finding]`` and ``check_paths(paths) -> list[Finding]``.

Suppress one finding with a comment on the same line, or on a comment-only line just above it. The
reason is mandatory::

    x = simd_sum(v);  // lint: allow(divergent-collective) all lanes of this simdgroup take the branch

How it works: comments and string literals are blanked out first, and line/column positions are kept.
Then the file is tokenized, and the rules run on the tokens together with a light structural parse
(namespace, struct and function scopes, and the statements inside function bodies). Code the Metal
compiler never sees is skipped: ``#ifndef __METAL_VERSION__``, ``#if !defined(__METAL_VERSION__)``,
the ``#else`` of ``#ifdef __METAL_VERSION__``, and ``#if 0``.
This is a lint, not a compiler. It has no type checking, no template instantiation and no macro
expansion (it only looks at object-like macro bodies for ``constant``/``static``). Every rule is
written to avoid false positives. Its known blind spots are listed in ``docs/METAL_VERIFICATION.md``.
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

__all__ = ["Finding", "RULES", "check_source", "check_paths", "main"]

# Each rule's one-line reason. The docs and the --rules listing use these same texts.
RULES: dict[str, str] = {
    "std-namespace": "the C++ standard library does not exist in MSL (use the metal:: equivalents)",
    "std-include": "only <metal_*> headers exist for MSL; other system headers compile on clang only",
    "exceptions": "MSL has no exceptions (throw/try/catch)",
    "recursion": "MSL does not support recursive calls (no call stack on the GPU)",
    "virtual": "MSL has no virtual functions",
    "rtti": "MSL has no RTTI (dynamic_cast, typeid)",
    "dynamic-alloc": "MSL has no heap (new, delete, malloc, free)",
    "double": "Apple GPUs have no double (or long double)",
    "thread-local": "thread_local does not exist in MSL (the emulator uses it internally)",
    "mutable-global": "program-scope and static variables must be constant/constexpr in MSL",
    "function-pointer": "function pointers need Metal visible functions, which the emulator lacks",
    "goto": "goto is not allowed in MSL",
    "printf": "printf is not available in MSL kernels",
    "bfloat-from-half": "Apple's compiler rejects a direct half->bfloat conversion: go through float",
    "divergent-collective": "simd_*/quad_*/simdgroup_* collectives and threadgroup_barrier must be "
    "reached by all lanes: not under a per-lane condition",
    "early-return-collective": "a collective or barrier after some lanes returned (or left the loop) "
    "is divergent: mask values instead of returning early",
    "bad-suppression": "a suppression comment needs a known rule name and a reason",
}


@dataclass(frozen=True, order=True)
class Finding:
    file: str
    line: int
    col: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.rule}: {self.message}"


# --------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------

ADDRESS_SPACES = {"device", "constant", "threadgroup", "thread", "threadgroup_imageblock", "ray_data",
                  "object_data"}
QUALIFIERS = ADDRESS_SPACES | {"const", "volatile", "restrict", "__restrict", "static", "inline",
                               "constexpr", "mutable", "register", "signed", "unsigned"}
KEYWORDS = {
    "alignas", "alignof", "auto", "break", "case", "catch", "class", "const", "constexpr", "const_cast",
    "continue", "decltype", "default", "delete", "do", "else", "enum", "explicit", "extern", "false",
    "for", "friend", "goto", "if", "inline", "mutable", "namespace", "new", "noexcept", "nullptr",
    "operator", "private", "protected", "public", "reinterpret_cast", "return", "sizeof", "static",
    "static_assert", "static_cast", "struct", "switch", "template", "this", "throw", "true", "try",
    "typedef", "typeid", "typename", "union", "using", "virtual", "volatile", "while", "dynamic_cast",
    "thread_local", "register", "signed", "unsigned",
} | ADDRESS_SPACES

_VEC = r"(?:[234])?"
_MAT = r"(?:[234]x[234])?"
HALF_TYPE_RE = re.compile(rf"^(?:packed_)?half(?:{_VEC}|{_MAT})$")
BFLOAT_TYPE_RE = re.compile(rf"^(?:packed_)?bfloat{_VEC}$")
OTHER_TYPE_RE = re.compile(
    rf"^(?:packed_)?(?:float|int|uint|short|ushort|char|uchar|bool|long|ulong|bfloat){_VEC}$"
    rf"|^(?:float|bfloat){_MAT}$|^(?:size_t|ptrdiff_t|u?int(?:8|16|32|64)_t)$")

# simd/quad collectives whose result is uniform across the simdgroup (quad), and the level they cap at.
UNIFORMIZING = {f"simd_{n}": 1 for n in ("sum", "product", "min", "max", "and", "or", "xor", "broadcast",
                                          "broadcast_first", "all", "any", "ballot", "active_threads_mask",
                                          "vote")}
UNIFORMIZING.update({f"quad_{n}": 2 for n in ("sum", "product", "min", "max", "and", "or", "xor",
                                               "broadcast", "broadcast_first", "all", "any", "ballot",
                                               "active_threads_mask", "vote")})
PER_LANE_CALL_RE = re.compile(r"^(?:simd|quad)_(?:is_first|prefix_\w+)$")

# Levels of variation: 0 uniform in the threadgroup, 1 varies between simdgroups, 2 varies between
# quads of a simdgroup, 3 varies between lanes.
LANE_ATTRS = {
    "thread_position_in_grid": 3,
    "thread_position_in_threadgroup": 3,
    "thread_index_in_threadgroup": 3,
    "thread_index_in_simdgroup": 3,
    "thread_index_in_quadgroup": 3,
    "quadgroup_index_in_threadgroup": 2,
    "simdgroup_index_in_threadgroup": 1,
}
_LEVEL_WORD = {1: "per-simdgroup", 2: "per-quad", 3: "per-lane"}
SIMDGROUP_TYPE_RE = re.compile(r"^simdgroup_(?:(?:float|half|bfloat)\d+x\d+|matrix\w*|event)$")
_SWIZZLE_RE = re.compile(r"^(?:[xyzw]{1,4}|[rgba]{1,4})$")

ASSIGN_OPS = {"=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="}
_NOT_CALLS = {"decltype", "alignas", "alignof", "sizeof", "__attribute__", "noexcept", "static_assert",
              "requires", "if", "for", "while", "switch", "return", "catch", "typeid", "operator"}
# Generic metal functions whose result type follows their arguments (for the half -> bfloat check).
_GENERIC_FNS = {
    "abs", "fabs", "min", "max", "fmin", "fmax", "clamp", "mix", "select", "sign", "step", "smoothstep",
    "saturate", "exp", "exp2", "exp10", "log", "log2", "log10", "sqrt", "rsqrt", "pow", "powr", "sin", "cos",
    "tan", "sinh", "cosh", "tanh", "asin", "acos", "atan", "atan2", "floor", "ceil", "round", "rint",
    "trunc", "fract", "fmod", "fma", "dot", "normalize", "length", "copysign", "divide", "recip",
    "simd_sum", "simd_max", "simd_min", "simd_product", "simd_broadcast", "simd_broadcast_first",
    "simd_shuffle", "simd_shuffle_down", "simd_shuffle_up", "simd_shuffle_xor",
    "simd_shuffle_rotate_down", "simd_shuffle_rotate_up", "simd_prefix_exclusive_sum",
    "simd_prefix_inclusive_sum", "quad_sum", "quad_max", "quad_min", "quad_broadcast", "quad_shuffle",
    "quad_shuffle_down", "quad_shuffle_up", "quad_shuffle_xor",
}
_NAMESPACES = {"metal", "precise", "fast"}


def _is_builtin_name(name: str) -> bool:
    return name in _GENERIC_FNS or name.startswith(("simd_", "quad_", "simdgroup_", "as_type", "atomic_"))

# The comment must start with it: `// lint: allow(rule) reason` or `/* lint: allow(rule) reason */`.
_SUPPRESS_RE = re.compile(r"^(?://+|/\*+)\s*lint:\s*allow\(\s*([^)]*?)\s*\)(.*)", re.S)

_TOKEN_RE = re.compile(
    r"(?P<id>[A-Za-z_]\w*)"
    r"|(?P<num>\.?\d(?:[eEpP][+-]|[\w.'])*)"
    r"|(?P<op><<=|>>=|->|::|\+\+|--|&&|\|\||[<>=!+\-*/%&|^]=|<<|>>|\.\.\.|\S)"
)


class Tok(NamedTuple):
    kind: str  # "id", "num", "op"
    text: str
    off: int
    line: int
    col: int


class Lev(NamedTuple):
    """How much a value varies inside a threadgroup, and a human-readable why."""

    level: int
    why: str = ""
    line: int = 0


NOLEV = Lev(0)


def _maxlev(a: Lev, b: Lev) -> Lev:
    return b if b.level > a.level else a


# --------------------------------------------------------------------------------------------------
# Lexing: blank comments and literals, find preprocessor directives
# --------------------------------------------------------------------------------------------------


def _strip(text: str) -> tuple[str, list[tuple[int, str]]]:
    """Blank comments and the contents of string/char literals (newlines kept).

    Returns the blanked code and the list of (offset, comment text)."""
    out = list(text)
    comments: list[tuple[int, str]] = []
    n = len(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    i = 0
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = i + 2
            while j < n and text[j] != "\n":
                j += 2 if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n" else 1
            comments.append((i, text[i:j]))
            blank(i, j)
            i = j
        elif c == "/" and nxt == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            comments.append((i, text[i:j]))
            blank(i, j)
            i = j
        elif c == "R" and nxt == '"' and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^()\\\s]{0,16})\(', text[i:])
            if not m:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i + m.end())
            end = n if end < 0 else end + len(m.group(1)) + 2
            blank(i + 2, end - 1)
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = min(j + 1, n)
        elif (c.isdigit() or (c == "." and nxt.isdigit())) and not (
                i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")):
            j = i + 1
            while j < n:
                if text[j] in "+-" and text[j - 1] in "eEpP":
                    j += 1
                elif text[j].isalnum() or text[j] in "._'":
                    j += 1
                else:
                    break
            i = j
        else:
            i += 1
    return "".join(out), comments


@dataclass
class _Directive:
    start: int  # offset of '#'
    end: int  # offset past the last character (continuation lines included)
    name: str
    body_off: int  # offset where the directive's argument text starts
    body: str  # argument text (blanked code)


def _directives(code: str) -> list[_Directive]:
    out = []
    for m in re.finditer(r"^[ \t]*#[ \t]*(\w*)", code, re.M):
        end = m.end()
        while True:
            nl = code.find("\n", end)
            if nl < 0:
                end = len(code)
                break
            if code[nl - 1] == "\\":
                end = nl + 1
                continue
            end = nl
            break
        out.append(_Directive(m.start() + m.group(0).index("#"), end, m.group(1), m.end(),
                              code[m.end():end]))
    return out


def _classify_cond(name: str, expr: str) -> str:
    e = re.sub(r"\s+|\\\n", "", expr)
    if name == "ifdef":
        return "metal" if e == "__METAL_VERSION__" else "unknown"
    if name == "ifndef":
        return "host" if e == "__METAL_VERSION__" else "unknown"
    if e in ("0", "(0)"):
        return "dead"
    if e in ("defined(__METAL_VERSION__)", "defined__METAL_VERSION__", "__METAL_VERSION__"):
        return "metal"
    if e in ("!defined(__METAL_VERSION__)", "!defined__METAL_VERSION__", "!__METAL_VERSION__"):
        return "host"
    return "unknown"


# --------------------------------------------------------------------------------------------------
# Statements of a function body
# --------------------------------------------------------------------------------------------------


@dataclass
class _Expr:
    a: int
    b: int


@dataclass
class _Block:
    stmts: list


@dataclass
class _If:
    cond: tuple[int, int]
    then: object
    els: object
    constexpr: bool


@dataclass
class _Loop:
    init: tuple[int, int] | None
    cond: tuple[int, int] | None
    incr: tuple[int, int] | None
    body: object


@dataclass
class _Switch:
    cond: tuple[int, int]
    body: object


@dataclass
class _Return:
    a: int
    b: int
    tok: int


@dataclass
class _Jump:
    kind: str  # "break" | "continue"
    tok: int


@dataclass
class _Function:
    name: str
    name_tok: int
    owner: str | None
    params: tuple[int, int] | None  # token range inside the parentheses
    head: int  # first token of the declaration
    body: tuple[int, int]  # '{' and '}' token indices
    is_template: bool
    is_operator: bool
    arity: tuple[int, int] = (0, 0)


# --------------------------------------------------------------------------------------------------
# The linter for one source text
# --------------------------------------------------------------------------------------------------


class _Linter:
    def __init__(self, text: str, filename: str, macros: dict[str, list[str]] | None = None):
        self.extra_macros = dict(macros or {})
        self.text = text
        self.filename = filename
        self.findings: list[Finding] = []
        self.code, self.comments = _strip(text)
        self.nl = [i for i, ch in enumerate(text) if ch == "\n"]
        self._scan_preprocessor()
        self._tokenize()
        self._match_brackets()

    # --- positions ---------------------------------------------------------------------------
    def pos(self, off: int) -> tuple[int, int]:
        line = bisect.bisect_left(self.nl, off)
        start = self.nl[line - 1] + 1 if line > 0 else 0
        return line + 1, off - start + 1

    def add(self, off: int, rule: str, message: str) -> None:
        line, col = self.pos(off)
        self.findings.append(Finding(self.filename, line, col, rule, message))

    def add_tok(self, i: int, rule: str, message: str) -> None:
        t = self.toks[i]
        self.findings.append(Finding(self.filename, t.line, t.col, rule, message))

    # --- preprocessor ------------------------------------------------------------------------
    def _scan_preprocessor(self) -> None:
        self.dirs = _directives(self.code)
        self.skipped: list[tuple[int, int]] = []  # code ranges the Metal compiler never sees
        self.macros: dict[str, list[str]] = dict(self.extra_macros)
        stack: list[list] = []  # [kind, start_of_skipped_region or None]
        live_dirs = []

        def inactive() -> bool:
            return any(e[0] in ("host", "dead") for e in stack)

        region_start = None
        for d in self.dirs:
            was_inactive = inactive()
            if d.name in ("if", "ifdef", "ifndef"):
                stack.append([_classify_cond(d.name, d.body)])
            elif d.name == "elif" and stack:
                prev = stack[-1][0]
                stack[-1][0] = "host" if prev == "metal" else _classify_cond("elif", d.body)
            elif d.name == "else" and stack:
                prev = stack[-1][0]
                stack[-1][0] = {"metal": "host", "host": "metal", "dead": "unknown"}.get(prev, "unknown")
            elif d.name == "endif" and stack:
                stack.pop()
            elif not was_inactive:
                live_dirs.append((d, len(stack)))
            now_inactive = inactive()
            if not was_inactive and now_inactive:
                region_start = d.end
            elif was_inactive and not now_inactive and region_start is not None:
                self.skipped.append((region_start, d.start))
                region_start = None
        if region_start is not None:
            self.skipped.append((region_start, len(self.code)))
        self.live_dirs = live_dirs
        for d, _ in live_dirs:
            if d.name == "define":
                m = re.match(r"\s*([A-Za-z_]\w*)(\(?)(.*)", d.body, re.S)
                if m and not m.group(2):
                    self.macros[m.group(1)] = re.findall(r"[A-Za-z_]\w*", m.group(3))

    # --- tokens ------------------------------------------------------------------------------
    def _tokenize(self) -> None:
        code = self.code
        excluded = sorted([(d.start, d.end) for d in self.dirs] + self.skipped)
        self.toks: list[Tok] = []
        self.dir_toks: list[Tok] = []  # tokens of #define/#undef/#if bodies (token rules only)
        pos = 0
        for a, b in excluded + [(len(code), len(code))]:
            if a > pos:
                self._lex(code, pos, a, self.toks)
            pos = max(pos, b)
        for d, _ in self.live_dirs:
            if d.name in ("define", "undef"):
                self._lex(code, d.body_off, d.end, self.dir_toks)

    def _lex(self, code: str, a: int, b: int, out: list[Tok]) -> None:
        for m in _TOKEN_RE.finditer(code, a, b):
            kind = m.lastgroup
            text = m.group(0)
            if kind == "op" and text == "\\":
                continue
            line, col = self.pos(m.start())
            out.append(Tok(kind, text, m.start(), line, col))

    def _match_brackets(self) -> None:
        self.match: dict[int, int] = {}
        self.parent: list[int] = [-1] * len(self.toks)
        stack: list[int] = []
        pairs = {")": "(", "]": "[", "}": "{"}
        for i, t in enumerate(self.toks):
            self.parent[i] = stack[-1] if stack else -1
            if t.text in "([{" and len(t.text) == 1:
                stack.append(i)
            elif t.text in pairs and len(t.text) == 1:
                want = pairs[t.text]
                k = len(stack) - 1
                while k >= 0 and self.toks[stack[k]].text != want:
                    k -= 1
                if k < 0:
                    continue  # stray closer: ignore
                del stack[k + 1:]
                o = stack.pop()
                self.match[o] = i
                self.match[i] = o
                self.parent[i] = stack[-1] if stack else -1

    # --- small helpers ------------------------------------------------------------------------
    def t(self, i: int) -> str:
        return self.toks[i].text if 0 <= i < len(self.toks) else ""

    def close(self, i: int, limit: int) -> int:
        """Index of the bracket that closes toks[i] (clipped to limit-1 when unmatched)."""
        j = self.match.get(i)
        if j is None or j >= limit:
            return limit - 1
        return j

    def skip_angles(self, i: int, limit: int) -> int:
        """toks[i] is '<': return the index just past the matching '>'."""
        depth = 0
        j = i
        while j < limit:
            s = self.t(j)
            if s in ("(", "[", "{"):
                j = self.close(j, limit) + 1
                continue
            if s == "<":
                depth += 1
            elif s == ">":
                depth -= 1
            elif s == ">>":
                depth -= 2
            elif s in (";", "{", "}"):
                return j
            j += 1
            if depth <= 0:
                return j
        return j

    def top_level(self, a: int, b: int) -> Iterable[int]:
        """Indices in [a, b) not inside a bracket group that starts in [a, b) (the openers are yielded)."""
        i = a
        while i < b:
            yield i
            if self.t(i) in ("(", "[", "{"):
                i = self.close(i, b) + 1
            else:
                i += 1

    def split_top(self, a: int, b: int, sep: str, angles: bool = False) -> list[tuple[int, int]]:
        parts = []
        start = a
        i = a
        while i < b:
            s = self.t(i)
            if s in ("(", "[", "{"):
                i = self.close(i, b) + 1
                continue
            if angles and s == "<" and i > a and self.toks[i - 1].kind == "id":
                i = self.skip_angles(i, b)
                continue
            if s == sep:
                parts.append((start, i))
                start = i + 1
            i += 1
        if start < b or parts:
            parts.append((start, b))
        return parts

    def expand(self, names: Iterable[str], depth: int = 0) -> set[str]:
        """Identifier texts with object-like macros expanded (a few levels)."""
        out: set[str] = set()
        for n in names:
            out.add(n)
            if depth < 4 and n in self.macros:
                out |= self.expand(self.macros[n], depth + 1)
        return out

    # ==========================================================================================
    def run(self) -> list[Finding]:
        self.rule_includes()
        self.rule_tokens(self.toks, structural=True)
        self.rule_tokens(self.dir_toks, structural=False)
        self.functions: list[_Function] = []
        self.class_ranges: list[tuple[int, int, str]] = []
        self.scan_scope(0, len(self.toks), "namespace", None)
        self.fn_at = [-1] * len(self.toks)
        for k, f in enumerate(self.functions):
            for i in range(f.head, f.body[1] + 1):
                self.fn_at[i] = k
        self.rule_static_locals()
        self.rule_recursion_and_collect_calls()
        self.rule_bfloat()
        self.rule_divergence()
        self.apply_suppressions()
        return sorted(set(self.findings))

    # --- includes ------------------------------------------------------------------------------
    def rule_includes(self) -> None:
        for d, depth in self.live_dirs:
            if d.name not in ("include", "import", "include_next"):
                continue
            m = re.match(r"\s*<([^>]*)>", d.body)
            if not m:
                continue
            header = m.group(1).strip()
            off = d.body_off + d.body.index("<")
            if re.fullmatch(r"metal_\w+", header):
                continue
            if header.startswith("MetalPerformancePrimitives/"):
                if depth == 0:
                    self.add(off, "std-include",
                             f"<{header}> (Metal 4 tensor ops) must sit inside an #if so the "
                             "emulator-runnable fallback kernel compiles without it")
                continue
            self.add(off, "std-include",
                     f"#include <{header}>: only <metal_*> headers are available to MSL (guard host-only "
                     "includes with #ifndef __METAL_VERSION__)")

    # --- token rules -----------------------------------------------------------------------------
    def rule_tokens(self, toks: list[Tok], structural: bool) -> None:
        n = len(toks)
        # Template parameter lists: a function pointer there is a compile-time constant (fine).
        in_template: set[int] = set()
        if structural:
            for i, tk in enumerate(toks):
                if tk.text == "template" and i + 1 < n and toks[i + 1].text == "<":
                    in_template.update(range(i + 1, self.skip_angles(i + 1, n)))

        def txt(k: int) -> str:
            return toks[k].text if 0 <= k < n else ""

        for i, tk in enumerate(toks):
            s = tk.text
            if tk.kind == "num":
                continue
            msg = None
            rule = None
            if s == "std" and (txt(i + 1) == "::" or txt(i - 1) == "namespace"):
                rule, msg = "std-namespace", "`std::` is not available in MSL; use the metal:: equivalent"
            elif s in ("throw", "try", "catch"):
                rule, msg = "exceptions", f"`{s}`: MSL has no exceptions"
            elif s == "virtual":
                rule, msg = "virtual", "`virtual`: MSL has no virtual functions"
            elif s in ("dynamic_cast", "typeid"):
                rule, msg = "rtti", f"`{s}`: MSL has no RTTI"
            elif s == "new":
                rule, msg = "dynamic-alloc", "`new`: MSL has no dynamic allocation"
            elif s == "delete" and txt(i - 1) != "=":
                rule, msg = "dynamic-alloc", "`delete`: MSL has no dynamic allocation"
            elif s in ("malloc", "calloc", "realloc", "free", "aligned_alloc") and txt(i + 1) == "(" \
                    and txt(i - 1) not in (".", "->"):
                rule, msg = "dynamic-alloc", f"`{s}()`: MSL has no heap"
            elif re.fullmatch(r"double[234]?", s):
                what = "long double" if txt(i - 1) == "long" else s
                rule, msg = "double", f"`{what}` is not supported on Apple GPUs; use float"
            elif s == "thread_local":
                rule, msg = "thread-local", "`thread_local` does not exist in MSL"
            elif s == "goto":
                rule, msg = "goto", "`goto` is not allowed in MSL"
            elif s in ("printf", "fprintf", "puts") and txt(i + 1) == "(" and txt(i - 1) not in (".", "->"):
                rule, msg = "printf", f"`{s}` is not available in MSL kernels"
            elif s == "visible_function_table":
                rule, msg = "function-pointer", "visible function tables (function pointers) cannot be emulated"
            elif s == "(" and structural and i not in in_template:
                # ( [A::]* (*|&) [name] ) (   -> pointer/reference to function
                j = i + 1
                while j < n and toks[j].kind == "id" and txt(j + 1) == "::":
                    j += 2
                if txt(j) in ("*", "&"):
                    k = j + 1
                    name = None
                    if k < n and toks[k].kind == "id":
                        name = toks[k].text
                        k += 1
                    if txt(k) == ")" and txt(k + 1) == "(" and name != "this":
                        rule = "function-pointer"
                        msg = (f"function pointer `{name}`" if name else "function pointer type") + \
                            ": not supported by the emulator (use a template parameter or a switch)"
                        tk = toks[j]
            if rule:
                self.findings.append(Finding(self.filename, tk.line, tk.col, rule, msg))

    # --- scopes ---------------------------------------------------------------------------------
    def strip_template_prefix(self, a: int, b: int) -> int:
        while a < b and self.t(a) == "template" and self.t(a + 1) == "<":
            a = self.skip_angles(a + 1, b)
        return a

    def scan_scope(self, a: int, b: int, kind: str, owner: str | None) -> None:
        head = a
        i = a
        while i < b:
            s = self.t(i)
            if s in ("(", "["):
                i = self.close(i, b) + 1
                continue
            if s == ";":
                self.check_decl_statement(head, i, kind)
                i += 1
                head = i
                continue
            if s == ":" and kind == "class" and self.t(i - 1) in ("public", "private", "protected"):
                i += 1
                head = i
                continue
            if s == "}":
                i += 1
                head = i
                continue
            if s == "{":
                end = self.match.get(i)
                if end is None or end >= b:
                    return
                cls, name = self.classify_head(head, i)
                if cls == "namespace":
                    self.scan_scope(i + 1, end, "namespace", None)
                    head = end + 1
                elif cls == "class":
                    self.class_ranges.append((i, end, name or ""))
                    self.scan_scope(i + 1, end, "class", name)
                    head = end + 1
                elif cls == "function":
                    self.record_function(head, i, end, owner)
                    head = end + 1
                # "init" / "other": braces belong to the statement; keep accumulating the head
                i = end + 1
                continue
            i += 1

    def classify_head(self, a: int, b: int) -> tuple[str, str | None]:
        a = self.strip_template_prefix(a, b)
        tops = [k for k in self.top_level(a, b)]
        texts = [self.t(k) for k in tops if self.t(k) not in ("[",)]
        if not texts:
            return "other", None
        first = [x for x in texts if x not in ("inline", "export")]
        if first and first[0] in ("namespace", "extern"):
            return "namespace", None
        for k in tops:
            if self.t(k) == "=" and self.t(k - 1) != "operator":
                return "init", None
        for idx, k in enumerate(tops):
            if self.t(k) in ("struct", "class", "union", "enum"):
                rest = tops[idx + 1:]
                if any(self.t(r) == "(" and self.t(r - 1) not in ("alignas", "__attribute__") for r in rest):
                    break
                name = None
                for r in rest:
                    if self.toks[r].kind == "id" and self.t(r) not in KEYWORDS:
                        name = self.t(r)
                        break
                return "class", name
        if any(self.t(k) == "(" for k in tops):
            return "function", None
        return "other", None

    def record_function(self, a: int, lbrace: int, rbrace: int, owner: str | None) -> None:
        h = self.strip_template_prefix(a, lbrace)
        is_template = h != a
        tops = list(self.top_level(h, lbrace))
        # Cut constructor initializer lists and trailing return types.
        cut = len(tops)
        seen_paren = False
        for idx, k in enumerate(tops):
            if self.t(k) == "(":
                seen_paren = True
            elif seen_paren and self.t(k) in (":", "->"):
                cut = idx
                break
        tops = tops[:cut]
        is_operator = any(self.t(k) == "operator" for k in tops)
        name, name_tok, params = "operator", -1, None
        if not is_operator:
            for k in reversed(tops):
                if self.t(k) != "(":
                    continue
                p = k - 1
                if self.t(p) in (">", ">>"):  # explicit specialization f<float>(...)
                    depth = 0
                    while p >= h:
                        if self.t(p) == ">":
                            depth += 1
                        elif self.t(p) == ">>":
                            depth += 2
                        elif self.t(p) == "<":
                            depth -= 1
                            if depth <= 0:
                                break
                        p -= 1
                    p -= 1
                if p >= h and self.toks[p].kind == "id" and self.t(p) not in _NOT_CALLS:
                    name, name_tok, params = self.t(p), p, (k + 1, self.close(k, lbrace))
                    break
        fn_owner = owner
        if name_tok > h and self.t(name_tok - 1) == "::" and self.toks[name_tok - 2].kind == "id":
            fn_owner = self.t(name_tok - 2)
        f = _Function(name, name_tok, fn_owner, params, a, (lbrace, rbrace), is_template, is_operator)
        if params:
            parts = [p for p in self.split_top(params[0], params[1], ",", angles=True) if p[1] > p[0]]
            if len(parts) == 1 and self.t(parts[0][0]) == "void" and parts[0][1] - parts[0][0] == 1:
                parts = []
            defaults = sum(1 for pa, pb in parts if any(self.t(k) == "=" for k in self.top_level(pa, pb)))
            f.arity = (len(parts) - defaults, len(parts))
        self.functions.append(f)

    def check_decl_statement(self, a: int, b: int, kind: str) -> None:
        """A ';'-terminated statement at namespace or class scope: flag mutable variables."""
        a = self.strip_template_prefix(a, b)
        tops = [k for k in self.top_level(a, b) if self.t(k) != "["]
        if len(tops) < 2:
            return
        first = self.t(tops[0])
        if first in ("template", "typedef", "using", "static_assert", "namespace", "friend", "struct",
                     "class", "union", "enum", "extern", "public", "private", "protected", "typename",
                     "#", "operator"):
            return
        eq = next((k for k in tops if self.t(k) == "="), None)
        decl = [k for k in tops if eq is None or k < eq]
        if any(self.toks[k].kind == "op" and self.t(k) not in ("*", "&", "::", "<", ">", ">>", ",", "(", "{", "[")
               or self.t(k) in ("using", "namespace", "typedef", "template")
               for k in decl):
            return  # not a plain declaration (or a stray merged head): stay quiet
        if any(self.t(k) in ("(", "{") and self.t(k - 1) not in ("decltype", "alignas", "__attribute__")
               for k in decl):
            return  # function declaration, macro invocation, or direct-initialised object
        words = self.expand(self.t(k) for k in decl if self.toks[k].kind == "id")
        if kind == "class" and "static" not in words:
            return
        if words & {"constant", "constexpr"}:
            return
        ids = [k for k in decl if self.toks[k].kind == "id" and self.t(k) not in KEYWORDS]
        if len(ids) < 2 and not (len(ids) == 1 and any(self.t(k) in KEYWORDS for k in decl)):
            return
        name_tok = ids[-1]
        what = "static data member" if kind == "class" else "program-scope variable"
        self.add_tok(name_tok, "mutable-global",
                     f"{what} `{self.t(name_tok)}` is mutable: declare it `constant` (or `constexpr`)")

    def rule_static_locals(self) -> None:
        for fi, f in enumerate(self.functions):
            lb, rb = f.body
            for i in range(lb + 1, rb):
                if self.t(i) != "static" or self.fn_at[i] != fi:
                    continue
                if self.toks[self.parent[i]].text == "(" if self.parent[i] >= 0 else False:
                    continue
                j = i
                words = set()
                while j < rb and self.t(j) not in (";", "=", "{", "("):
                    if self.toks[j].kind == "id":
                        words.add(self.t(j))
                    j += 1
                if self.expand(words) & {"constant", "constexpr"}:
                    continue
                self.add_tok(i, "mutable-global",
                             "function-scope `static` variable is mutable: declare it `constant` or "
                             "`constexpr`, or use a local")

    # --- calls, recursion ----------------------------------------------------------------------------
    def calls_in(self, a: int, b: int) -> Iterable[tuple[int, int, bool, str | None]]:
        """(name token, '(' token, has explicit template args, qualifier) for calls in [a, b)."""
        for i in range(a, b):
            tk = self.toks[i]
            if tk.kind != "id" or tk.text in KEYWORDS or tk.text in _NOT_CALLS:
                continue
            j = i + 1
            templ = False
            if self.t(j) == "<":
                j2 = self.skip_angles(j, b)
                if self.t(j2) == "(" and self.t(j2 - 1) in (">", ">>"):
                    j, templ = j2, True
            if self.t(j) != "(":
                continue
            prev = self.t(i - 1)
            if prev in (".", "->") and not (prev == "->" and self.t(i - 2) == "this"):
                continue
            qual = None
            if prev == "::":
                qual = self.t(i - 2) if i >= 2 and self.toks[i - 2].kind == "id" else ""
            yield i, j, templ, qual

    def resolve(self, caller: _Function, name: str, qual: str | None, nargs: int) -> list[int]:
        cands = [k for k, g in enumerate(self.functions) if g.name == name and not g.is_operator]
        if qual is not None:
            cands = [k for k in cands if self.functions[k].owner == qual]
        else:
            same = [k for k in cands if self.functions[k].owner == caller.owner]
            cands = same or [k for k in cands if self.functions[k].owner is None]
        return [k for k in cands if self.functions[k].arity[0] <= nargs <= self.functions[k].arity[1]]

    def rule_recursion_and_collect_calls(self) -> None:
        self.call_edges: dict[int, list[tuple[int, int]]] = {}  # caller -> [(callee, name token)]
        for fi, f in enumerate(self.functions):
            lb, rb = f.body
            edges = []
            for i, lp, templ, qual in self.calls_in(lb + 1, rb):
                if self.fn_at[i] != fi:
                    continue
                rp = self.close(lp, rb)
                nargs = len([p for p in self.split_top(lp + 1, rp, ",") if p[1] > p[0]])
                # A declaration `T name(args)` is not a call.
                if self.toks[i - 1].kind == "id" and self.t(i - 1) not in KEYWORDS:
                    continue
                targets = self.resolve(f, self.t(i), qual, nargs)
                if len(targets) != 1:
                    continue
                if templ:
                    continue  # f<N-1>(...) is a different instantiation (compile-time recursion)
                edges.append((targets[0], i))
            self.call_edges[fi] = edges
            if f.is_operator or f.name == f.owner or _is_builtin_name(f.name):
                continue  # an overload of a Metal builtin usually calls the builtin
            for callee, i in edges:
                if callee == fi:
                    self.add_tok(i, "recursion",
                                 f"`{f.name}` calls itself: MSL does not support recursion")
                    break
        # Mutual recursion: strongly connected components of size >= 2 (Tarjan).
        index: dict[int, int] = {}
        low: dict[int, int] = {}
        on: set[int] = set()
        stack: list[int] = []
        counter = [0]
        sccs: list[list[int]] = []

        def strong(v: int) -> None:
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on.add(v)
            for w, _ in self.call_edges.get(v, []):
                if w not in index:
                    strong(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                sccs.append(comp)

        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 10000))
        try:
            for v in range(len(self.functions)):
                if v not in index:
                    strong(v)
        finally:
            sys.setrecursionlimit(old)
        for comp in sccs:
            if len(comp) < 2:
                continue
            members = set(comp)
            sites = sorted((i, v, w) for v in comp for w, i in self.call_edges[v] if w in members)
            i, v, w = sites[0]
            names = " -> ".join([self.functions[v].name, self.functions[w].name, self.functions[v].name]) \
                if len(comp) == 2 else ", ".join(sorted(self.functions[k].name for k in comp))
            self.add_tok(i, "recursion", f"mutual recursion ({names}): MSL does not support recursion")

    # --- half -> bfloat -------------------------------------------------------------------------------
    def _declared_name(self, i: int, limit: int) -> int | None:
        """toks[i] is (the end of) a type: the index of the declared name after it, if any."""
        j = i + 1
        while j < limit and (self.t(j) in ("*", "&", "&&") or self.t(j) in QUALIFIERS):
            j += 1
        if j < limit and self.toks[j].kind == "id" and self.t(j) not in KEYWORDS:
            nxt = self.t(j + 1)
            if nxt in ("::", "<") or (self.toks[j + 1].kind == "id" if j + 1 < len(self.toks) else False):
                return None
            return j
        return None

    def _type_end(self, i: int, limit: int, type_re: re.Pattern) -> int | None:
        """If a type matching type_re starts at i (`half`, `vec<half, 4>`), the index of its last token."""
        s = self.t(i)
        if type_re.match(s):
            return i
        if s == "vec" and self.t(i + 1) == "<" and type_re.match(self.t(i + 2)):
            end = self.skip_angles(i + 1, limit)
            return end - 1
        return None

    def collect_types(self) -> None:
        self.half_funcs: set[str] = set()
        self.member_half: set[str] = set()
        self.global_half: set[str] = set()
        self.fn_half: dict[int, set[str]] = {}
        self.fn_other: dict[int, set[str]] = {}
        n = len(self.toks)
        for i in range(n):
            for type_re, is_half in ((HALF_TYPE_RE, True), (OTHER_TYPE_RE, False)):
                end = self._type_end(i, n, type_re)
                if end is None:
                    continue
                if self.t(i - 1) in ("(",) and self.t(end + 1) == ")":
                    continue  # a C cast
                j = self._declared_name(end, n)
                if j is None:
                    continue
                name = self.t(j)
                fi = self.fn_at[j]
                in_class = any(a < j < b for a, b, _ in self.class_ranges)
                inside_body = fi >= 0 and self.functions[fi].body[0] < j
                if self.t(j + 1) == "(" and not inside_body:
                    if is_half:
                        self.half_funcs.add(name)
                    continue
                names = [name]
                pj = self.parent[j]
                if fi < 0 and pj >= 0 and self.t(pj) == "(":
                    continue  # a parameter of a prototype: not a variable of any body we lint
                if not (pj >= 0 and self.t(pj) == "("):  # not a parameter: follow `, b = ...`
                    k = j + 1
                    while k < n and self.t(k) not in (";", "{", "}"):
                        s = self.t(k)
                        if s in ("(", "["):
                            k = self.close(k, n) + 1
                            continue
                        if s == ",":
                            m = k + 1
                            while self.t(m) in ("*", "&"):
                                m += 1
                            if m < n and self.toks[m].kind == "id" and self.t(m + 1) in ("=", ",", ";", "["):
                                names.append(self.t(m))
                        if s == ")":
                            break
                        k += 1
                if fi >= 0:
                    (self.fn_half if is_half else self.fn_other).setdefault(fi, set()).update(names)
                elif is_half:
                    (self.member_half if in_class else self.global_half).update(names)
        # `auto x = <half expression>;`
        for i in range(n):
            if self.t(i) == "auto" and self.fn_at[i] >= 0:
                j = self._declared_name(i, n)
                if j is None or self.t(j + 1) != "=":
                    continue
                e = j + 2
                while e < n and self.t(e) not in (";", ","):
                    e = self.close(e, n) + 1 if self.t(e) in ("(", "[", "{") else e + 1
                if self.expr_kind(j + 2, e, self.fn_at[i]) == "half":
                    self.fn_half.setdefault(self.fn_at[i], set()).add(self.t(j))

    def half_names(self, fi: int) -> set[str]:
        other = self.fn_other.get(fi, set())
        local = self.fn_half.get(fi, set()) - other  # declared both ways in one function: unknown
        return local | (self.global_half - other)

    @staticmethod
    def _combine(kinds: Iterable[str]) -> str:
        ks = set(kinds)
        if "other" in ks:
            return "other"
        if "half" in ks:
            return "half"
        return "neutral"

    def _type_kind(self, a: int, b: int) -> str:
        for k in range(a, b):
            s = self.t(k)
            if HALF_TYPE_RE.match(s):
                return "half"
            if s not in QUALIFIERS and s not in ("vec", "<", ">", ",") and self.toks[k].kind != "num":
                return "other"
        return "other"

    def expr_kind(self, a: int, b: int, fi: int) -> str:
        """'half', 'other' or 'neutral' (integer literals) for the expression in [a, b)."""
        halfs = self.half_names(fi) if fi >= 0 else self.global_half
        kinds = []
        i = a
        while i < b:
            s = self.t(i)
            if s in ("==", "!=", "<=", ">=", "&&", "||", "!", "<", ">"):
                return "other"  # a comparison (template brackets are consumed by operand_kind)
            if s == "?":
                colon = self._ternary_colon(i, b)
                return self._combine([self.expr_kind(i + 1, colon, fi), self.expr_kind(colon + 1, b, fi)])
            if s in ("+", "-", "*", "/", "%", "&", "|", "^", "<<", ">>", "~", "++", "--", ","):
                i += 1
                continue
            k, i = self.operand_kind(i, b, fi, halfs)
            kinds.append(k)
        return self._combine(kinds)

    def _ternary_colon(self, q: int, b: int) -> int:
        depth = 0
        for k in self.top_level(q + 1, b):
            s = self.t(k)
            if s == "?":
                depth += 1
            elif s == ":":
                if depth == 0:
                    return k
                depth -= 1
        return b

    def operand_kind(self, i: int, b: int, fi: int, halfs: set[str]) -> tuple[str, int]:
        """Kind of the unary expression starting at i, and the index just past it."""
        while i < b and self.t(i) in ("-", "+", "!", "~", "*", "&", "++", "--"):
            i += 1
        if i >= b:
            return "neutral", b
        tk = self.toks[i]
        s = tk.text
        if tk.kind == "num":
            low = s.lower()
            if low.startswith("0x"):
                return "neutral", i + 1
            if low.endswith("h"):
                return "half", i + 1
            if "." in s or "e" in low or low.endswith("f"):
                return "other", i + 1
            return "neutral", i + 1
        if s == "(":
            c = self.close(i, b)
            inner = range(i + 1, c)
            if inner and all(self.t(k) in QUALIFIERS or HALF_TYPE_RE.match(self.t(k))
                             or OTHER_TYPE_RE.match(self.t(k)) for k in inner) and c + 1 < b:
                kind = self._type_kind(i + 1, c)
                _, nxt = self.operand_kind(c + 1, b, fi, halfs)
                return kind, nxt
            kind = self.expr_kind(i + 1, c, fi)
            return self.postfix(kind, c + 1, b, halfs)
        if s in ("static_cast", "as_type", "reinterpret_cast") and self.t(i + 1) == "<":
            end = self.skip_angles(i + 1, b)
            kind = self._type_kind(i + 2, end - 1)
            if self.t(end) == "(":
                return self.postfix(kind, self.close(end, b) + 1, b, halfs)
            return kind, end
        if tk.kind == "id":
            j = i
            while self.t(j) in _NAMESPACES and self.t(j + 1) == "::":
                j += 2
            s = self.t(j)
            if s == "vec" and self.t(j + 1) == "<":
                end = self.skip_angles(j + 1, b)
                kind = self._type_kind(j + 2, end - 1)
                if self.t(end) in ("(", "{"):
                    return self.postfix(kind, self.close(end, b) + 1, b, halfs)
                return kind, end
            if self.t(j + 1) in ("(", "{"):
                c = self.close(j + 1, b)
                if HALF_TYPE_RE.match(s) or s in self.half_funcs:
                    kind = "half"
                elif OTHER_TYPE_RE.match(s):
                    kind = "other"
                elif s in _GENERIC_FNS:
                    args = self.split_top(j + 2, c, ",")
                    kind = self._combine(self.expr_kind(pa, pb, fi) for pa, pb in args)
                else:
                    kind = "other"
                return self.postfix(kind, c + 1, b, halfs)
            if self.t(j + 1) == "<":  # some other template: unknown
                end = self.skip_angles(j + 1, b)
                if self.t(end) == "(":
                    end = self.close(end, b) + 1
                return "other", end
            kind = "half" if s in halfs else "other"
            return self.postfix(kind, j + 1, b, halfs)
        return "other", i + 1

    def postfix(self, kind: str, i: int, b: int, halfs: set[str]) -> tuple[str, int]:
        while i < b:
            s = self.t(i)
            if s == "[":
                i = self.close(i, b) + 1
            elif s in (".", "->") and i + 1 < b:
                m = self.t(i + 1)
                if not _SWIZZLE_RE.match(m):  # .x/.xy keep the vector's kind
                    kind = "half" if m in self.member_half else "other"
                i += 2
            elif s in ("++", "--"):
                i += 1
            else:
                break
        return kind, i

    def rule_bfloat(self) -> None:
        self.collect_types()
        n = len(self.toks)
        for i in range(n):
            s = self.t(i)
            fi = self.fn_at[i]
            arg = None  # (a, b) ranges to test
            what = None
            if BFLOAT_TYPE_RE.match(s) and self.t(i + 1) in ("(", "{") and self.t(i - 1) not in ("<", ",") \
                    and not (self.toks[i - 1].kind == "id" and self.t(i - 1) not in KEYWORDS):
                c = self.close(i + 1, n)
                arg = self.split_top(i + 2, c, ",")
                what = f"{s}(...)"
            elif s == "vec" and self.t(i + 1) == "<" and BFLOAT_TYPE_RE.match(self.t(i + 2)):
                end = self.skip_angles(i + 1, n)
                if self.t(end) in ("(", "{"):
                    arg = self.split_top(end + 1, self.close(end, n), ",")
                    what = "vec<bfloat, N>(...)"
            elif s == "static_cast" and self.t(i + 1) == "<":
                end = self.skip_angles(i + 1, n)
                if any(BFLOAT_TYPE_RE.match(self.t(k)) for k in range(i + 2, end - 1)) and self.t(end) == "(":
                    arg = [(end + 1, self.close(end, n))]
                    what = "static_cast<bfloat>"
            elif s == "(" and BFLOAT_TYPE_RE.match(self.t(i + 1)) and self.t(i + 2) == ")":
                nxt = i + 3
                if nxt < n and (self.toks[nxt].kind in ("id", "num") or self.t(nxt) in ("(", "-", "+")):
                    _, e = self.operand_kind(nxt, n, fi, set())
                    arg = [(nxt, e)]
                    what = f"({self.t(i + 1)}) cast"
            if not arg:
                continue
            if any(pb > pa and self.expr_kind(pa, pb, fi) == "half" for pa, pb in arg):
                self.add_tok(i, "bfloat-from-half",
                             f"{what} of a half value: Apple's compiler rejects half->bfloat; "
                             "convert through float (bfloat(float(h)))")

    # --- divergence -----------------------------------------------------------------------------------
    def parse_stmts(self, a: int, b: int) -> list:
        out = []
        i = a
        while i < b:
            s, i = self.parse_stmt(i, b)
            if s is not None:
                out.append(s)
        return out

    def parse_stmt(self, i: int, b: int):
        s = self.t(i)
        if s == "{":
            e = self.close(i, b + 1)
            return _Block(self.parse_stmts(i + 1, e)), e + 1
        if s == ";":
            return None, i + 1
        if s == "if":
            j = i + 1
            constexpr = False
            if self.t(j) == "constexpr":
                j, constexpr = j + 1, True
            if self.t(j) == "(":
                c = self.close(j, b)
                then, k = self.parse_stmt(c + 1, b) if c + 1 < b else (None, b)
                els = None
                if k < b and self.t(k) == "else":
                    els, k = self.parse_stmt(k + 1, b) if k + 1 < b else (None, b)
                return _If((j + 1, c), then, els, constexpr), k
        if s in ("for", "while") and self.t(i + 1) == "(":
            c = self.close(i + 1, b)
            if s == "for":
                parts = self.split_top(i + 2, c, ";")
                if len(parts) == 3:
                    init, cond, incr = parts
                else:
                    init, cond, incr = None, (i + 2, c), None
            else:
                init, cond, incr = None, (i + 2, c), None
            body, k = self.parse_stmt(c + 1, b) if c + 1 < b else (None, b)
            return _Loop(init, cond, incr, body), k
        if s == "do":
            body, k = self.parse_stmt(i + 1, b) if i + 1 < b else (None, b)
            cond = None
            if self.t(k) == "while" and self.t(k + 1) == "(":
                c = self.close(k + 1, b)
                cond = (k + 2, c)
                k = c + 1
                if self.t(k) == ";":
                    k += 1
            return _Loop(None, cond, None, body), k
        if s == "switch" and self.t(i + 1) == "(":
            c = self.close(i + 1, b)
            body, k = self.parse_stmt(c + 1, b) if c + 1 < b else (None, b)
            return _Switch((i + 2, c), body), k
        if s in ("case", "default"):
            j = i + 1
            while j < b and self.t(j) != ":":
                j = self.close(j, b) + 1 if self.t(j) in ("(", "[", "{") else j + 1
            return None, j + 1
        if self.toks[i].kind == "id" and self.t(i + 1) == ":" and s not in KEYWORDS:
            return None, i + 2  # label
        if s in ("break", "continue"):
            j = i + 1
            return _Jump(s, i), (j + 1 if self.t(j) == ";" else j)
        j = i
        while j < b and self.t(j) != ";":
            j = self.close(j, b) + 1 if self.t(j) in ("(", "[", "{") else j + 1
        if s == "return":
            return _Return(i + 1, j, i), j + 1
        return _Expr(i, j), j + 1

    def collective_threshold(self, i: int, b: int) -> tuple[int, str] | None:
        """If toks[i] is a call of a collective (or of a helper that runs one): (threshold, what)."""
        s = self.t(i)
        if self.toks[i].kind != "id" or self.t(i + 1) != "(" or self.t(i - 1) in (".", "->"):
            return None
        if self.t(i - 1) == "::" and self.t(i - 2) not in _NAMESPACES:
            return None
        fk = self.helper_thresholds.get(s)
        if fk is not None:
            return fk[0], f"`{s}` (which calls `{fk[1]}`)"
        if s in self.fn_names:
            return None
        if s == "threadgroup_barrier":
            return 1, "`threadgroup_barrier`"
        if s.startswith("simdgroup_") and not SIMDGROUP_TYPE_RE.match(s):
            return 2, f"`{s}`"
        if s.startswith("simd_") and s != "simd_is_helper_thread":
            return 2, f"`{s}`"
        if s.startswith("quad_") and s != "quad_is_helper_thread":
            return 3, f"`{s}`"
        return None

    # Variables are keyed per declaration ("i#3"), so two loops that each declare their own `i` do not
    # share a level. Names declared outside the body (parameters, globals) keep their plain name.
    def _declarator(self, pa: int, pb: int, continuation: bool) -> int | None:
        """Name token if the comma-part [pa, pb) of a statement declares a variable."""
        eq = next((k for k in self.top_level(pa, pb) if self.t(k) == "="), None)
        k = (eq if eq is not None else pb) - 1
        while k >= pa and self.t(k) in ("]", ")", "}"):
            o = self.match.get(k)
            if o is None or o < pa:
                return None
            if self.t(k) == ")" and eq is not None:
                return None
            k = o - 1
        if k < pa or self.toks[k].kind != "id" or self.t(k) in KEYWORDS or self.t(k - 1) in (".", "->", "::"):
            return None
        if continuation:
            return k if all(self.t(x) in ("*", "&") for x in range(pa, k)) else None
        if k == pa or self.toks[pa].kind != "id" or self.t(pa) in ("return", "case", "goto", "delete", "new",
                                                                        "throw", "else", "do", "sizeof"):
            return None
        p = self.t(k - 1)
        if p in ("*", "&", "&&", ">", ">>") or p in QUALIFIERS or p == "auto" or \
                (self.toks[k - 1].kind == "id" and p not in KEYWORDS):
            return k
        return None

    def _resolve_range(self, a: int, b: int, scopes: list[dict[str, str]]) -> None:
        for i in range(a, b):
            tk = self.toks[i]
            if tk.kind != "id" or self.t(i - 1) in (".", "->", "::") or i in self.var_of:
                continue
            for sc in reversed(scopes):
                if tk.text in sc:
                    self.var_of[i] = sc[tk.text]
                    break

    def _declare_in(self, a: int, b: int, scopes: list[dict[str, str]]) -> None:
        """Resolve uses in a statement range and enter the variables it declares."""
        angles = self.toks[a].kind == "id" and self.t(a + 1) == "<" if a < b else False
        parts = self.split_top(a, b, ",", angles=angles)
        first = True
        is_decl = False
        for pa, pb in parts:
            name = self._declarator(pa, pb, continuation=not first and is_decl)
            if first:
                is_decl = name is not None
            first = False
            self._resolve_range(pa, pb, scopes)
            if name is not None and (is_decl):
                self._nvars += 1
                key = f"{self.t(name)}#{self._nvars}"
                scopes[-1][self.t(name)] = key
                self.var_of[name] = key

    def resolve_scopes(self, stmts: list, scopes: list[dict[str, str]]) -> None:
        for st in stmts:
            if st is None:
                continue
            if isinstance(st, _Expr):
                self._declare_in(st.a, st.b, scopes)
            elif isinstance(st, _Return):
                self._resolve_range(st.a, st.b, scopes)
            elif isinstance(st, _Block):
                self.resolve_scopes(st.stmts, scopes + [{}])
            elif isinstance(st, _If):
                self._resolve_range(*st.cond, scopes)
                self.resolve_scopes([st.then], scopes + [{}])
                self.resolve_scopes([st.els], scopes + [{}])
            elif isinstance(st, _Loop):
                inner = scopes + [{}]
                if st.init:
                    self._declare_in(*st.init, inner)
                for r in (st.cond, st.incr):
                    if r:
                        self._resolve_range(*r, inner)
                self.resolve_scopes([st.body], inner + [{}])
            elif isinstance(st, _Switch):
                self._resolve_range(*st.cond, scopes)
                self.resolve_scopes([st.body], scopes + [{}])

    def key(self, i: int) -> str:
        return self.var_of.get(i, self.t(i))

    def lane_level(self, a: int, b: int, lanes: dict[str, Lev]) -> Lev:
        best = NOLEV
        i = a
        while i < b:
            tk = self.toks[i]
            if tk.kind == "id" and self.t(i - 1) not in (".", "->"):
                s = tk.text
                if self.t(i + 1) == "(" and s in UNIFORMIZING:
                    c = self.close(i + 1, b)
                    inner = self.lane_level(i + 2, c, lanes)
                    lev = min(UNIFORMIZING[s], inner.level)
                    if lev:
                        best = _maxlev(best, Lev(lev, inner.why, inner.line))
                    i = c + 1
                    continue
                if self.t(i + 1) == "(" and PER_LANE_CALL_RE.match(s):
                    best = _maxlev(best, Lev(3, f"`{s}()`", tk.line))
                elif self.key(i) in lanes:
                    best = _maxlev(best, lanes[self.key(i)])
            i += 1
        return best

    def _base_name(self, a: int, b: int) -> tuple[int | None, bool]:
        """Base variable of an assignment target in [a, b), and whether it is indexed/dereferenced."""
        k = b - 1
        indexed = False
        while k >= a:
            s = self.t(k)
            if s == "]":
                o = self.match.get(k)
                if o is None:
                    return None, indexed
                k = o - 1
                indexed = True
                continue
            if self.toks[k].kind == "id" and self.t(k - 1) in (".", "->") and k - 2 >= a:
                indexed = True
                k -= 2
                continue
            if s == ")":
                o = self.match.get(k)
                if o is None:
                    return None, indexed
                k = o - 1
                continue
            break
        if k >= a and self.toks[k].kind == "id" and self.t(k) not in KEYWORDS:
            if a < k and self.t(k - 1) == "*":
                indexed = True
            return k, indexed
        return None, indexed

    def flow_items(self, stmts: list, out: list) -> None:
        for st in stmts:
            if st is None:
                continue
            if isinstance(st, _Expr):
                out.append((st.a, st.b))
            elif isinstance(st, _Block):
                self.flow_items(st.stmts, out)
            elif isinstance(st, _If):
                out.append(st.cond)
                self.flow_items([st.then, st.els], out)
            elif isinstance(st, _Loop):
                out.extend(x for x in (st.init, st.cond, st.incr) if x)
                self.flow_items([st.body], out)
            elif isinstance(st, _Switch):
                out.append(st.cond)
                self.flow_items([st.body], out)

    def memory_names(self, f: _Function) -> set[str]:
        """Names declared in device/constant/threadgroup memory: writing a per-lane value through
        them (`shm[lid] = v`) does not make later reads at a uniform index per-lane."""
        out = set()
        a = f.params[0] if f.params else f.body[0]
        for i in range(a, f.body[1]):
            if self.t(i) not in ("device", "constant", "threadgroup"):
                continue
            j = i + 1
            while j < f.body[1] and self.t(j) not in (";", ",", ")", "=", "[", "{", "("):
                j += 1
            k = j - 1
            while k > i and self.toks[k].kind != "id":
                k -= 1
            if k > i:
                out.add(self.t(k))
        return out

    def propagate_lanes(self, f: _Function, stmts: list, lanes: dict[str, Lev]) -> None:
        items: list[tuple[int, int]] = []
        self.flow_items(stmts, items)
        mem = self.memory_names(f)
        assigns: list[tuple[str, int, int]] = []
        for a, b in items:
            for pa, pb in self.split_top(a, b, ","):
                eq = next((k for k in self.top_level(pa, pb) if self.t(k) in ASSIGN_OPS), None)
                if eq is not None:
                    base, indexed = self._base_name(pa, eq)
                    if base is None or (indexed and self.t(base) in mem):
                        continue
                    assigns.append((self.key(base), eq + 1, pb))
                    continue
                # T name(expr) / T name{expr}
                last = pb - 1
                if pb - pa >= 3 and self.t(last) in (")", "}"):
                    o = self.match.get(last)
                    if o is not None and o - 1 > pa and self.toks[o - 1].kind == "id":
                        prev = o - 2
                        if (self.toks[prev].kind == "id" and self.t(prev) not in KEYWORDS) or \
                                self.t(prev) in (">", "*", "&", ">>") or self.t(prev) in QUALIFIERS:
                            assigns.append((self.key(o - 1), o + 1, last))
        for _ in range(12):
            changed = False
            for key, a, b in assigns:
                lev = self.lane_level(a, b, lanes)
                if lev.level > lanes.get(key, NOLEV).level:
                    name = key.split("#")[0]
                    lanes[key] = Lev(lev.level, f"`{name}` (from {lev.why})", lev.line)
                    changed = True
            if not changed:
                break

    def rule_divergence(self) -> None:
        self.var_of: dict[int, str] = {}
        self._nvars = 0
        self.fn_names = {f.name for f in self.functions}
        # Helper functions that (transitively) run a collective, with the strictest threshold.
        direct: dict[int, tuple[int, str]] = {}
        self.helper_thresholds: dict[str, tuple[int, str]] = {}
        for fi, f in enumerate(self.functions):
            lb, rb = f.body
            for i in range(lb + 1, rb):
                if self.fn_at[i] != fi:
                    continue
                c = self.collective_threshold(i, rb)
                if c is not None and (fi not in direct or c[0] < direct[fi][0]):
                    direct[fi] = (c[0], self.t(i))
        changed = True
        while changed:
            changed = False
            for fi, edges in self.call_edges.items():
                for callee, _ in edges:
                    if callee in direct and (fi not in direct or direct[callee][0] < direct[fi][0]):
                        direct[fi] = direct[callee]
                        changed = True
        by_name: dict[str, list[int]] = {}
        for fi, f in enumerate(self.functions):
            by_name.setdefault(f.name, []).append(fi)
        for name, fis in by_name.items():
            ths = [direct[k] for k in fis if k in direct]
            if ths and len(ths) == len(fis):  # every overload runs a collective
                self.helper_thresholds[name] = min(ths)
        for fi, f in enumerate(self.functions):
            lanes: dict[str, Lev] = {}
            if f.params:
                pa, pb = f.params
                for j in range(pa, pb):
                    if self.t(j) == "[" and self.t(j + 1) == "[" and self.t(j + 2) in LANE_ATTRS \
                            and self.toks[j - 1].kind == "id":
                        name, attr = self.t(j - 1), self.t(j + 2)
                        lanes[name] = Lev(LANE_ATTRS[attr], f"`{name} [[{attr}]]`", self.toks[j].line)
            stmts = self.parse_stmts(f.body[0] + 1, f.body[1])
            self.resolve_scopes(stmts, [{}])
            if lanes:
                self.propagate_lanes(f, stmts, lanes)
            _Walker(self, lanes).block(stmts, NOLEV)

    # --- suppressions ---------------------------------------------------------------------------------
    def apply_suppressions(self) -> None:
        code_lines = {t.line for t in self.toks} | {t.line for t in self.dir_toks} | \
            {self.pos(d.start)[0] for d in self.dirs}
        allowed: dict[int, set[str]] = {}
        bad: list[Finding] = []
        for off, text in self.comments:
            m = _SUPPRESS_RE.match(text)
            if not m:
                continue
            line, col = self.pos(off)
            rules = [r for r in re.split(r"[\s,]+", m.group(1)) if r]
            reason = m.group(2)
            if text.startswith("/*"):
                reason = reason[:-2] if reason.endswith("*/") else reason
            reason = reason.strip()
            unknown = [r for r in rules if r not in RULES or r == "bad-suppression"]
            if not rules or unknown:
                bad.append(Finding(self.filename, line, col, "bad-suppression",
                                   f"unknown rule(s) {', '.join(unknown) or '(none)'} in lint: allow(...); "
                                   f"rules: {', '.join(r for r in RULES if r != 'bad-suppression')}"))
                continue
            if not re.search(r"[A-Za-z0-9]", reason):
                bad.append(Finding(self.filename, line, col, "bad-suppression",
                                   f"lint: allow({', '.join(rules)}) needs a reason after it, e.g. "
                                   "`// lint: allow(rule) why this is safe here`"))
                continue
            targets = [line]
            if line not in code_lines:  # a comment-only line covers the next line with code
                later = sorted(x for x in code_lines if x > line)
                if later:
                    targets.append(later[0])
            for tl in targets:
                allowed.setdefault(tl, set()).update(rules)
        self.findings = [f for f in self.findings if f.rule not in allowed.get(f.line, set())] + bad


class _Walker:
    """Walks one function body in source order, tracking how divergent each point is."""

    def __init__(self, lint: _Linter, lanes: dict[str, Lev]):
        self.L = lint
        self.lanes = lanes
        self.exit = NOLEV  # some lanes returned earlier
        self.frames: list[dict] = []  # loops and switches: {"kind", "skip", "brk"}
        self.flagged: set[int] = set()

    def block(self, stmts: list, lev: Lev) -> None:
        for s in stmts:
            self.stmt(s, lev)

    def level_here(self, lev: Lev) -> tuple[Lev, Lev]:
        """(branch level, early-exit level) at this point."""
        ex = self.exit
        for fr in self.frames:
            ex = _maxlev(ex, fr["skip"])
        return lev, ex

    def stmt(self, s, lev: Lev) -> None:
        L = self.L
        if s is None:
            return
        if isinstance(s, _Expr):
            self.expr(s.a, s.b, lev)
        elif isinstance(s, _Block):
            self.block(s.stmts, lev)
        elif isinstance(s, _If):
            self.expr(*s.cond, lev)
            nl = lev if s.constexpr else _maxlev(lev, self._cond(s.cond))
            self.stmt(s.then, nl)
            self.stmt(s.els, nl)
        elif isinstance(s, _Loop):
            if s.init:
                self.expr(*s.init, lev)
            body_lev = _maxlev(lev, self._cond(s.cond)) if s.cond else lev
            left = NOLEV
            for attempt in range(2):
                # `left`: lanes that broke out (or returned) in an earlier iteration are missing from
                # the whole body of every later iteration.
                frame = {"kind": "loop", "skip": left, "brk": NOLEV}
                self.frames.append(frame)
                if s.cond:
                    self.expr(*s.cond, body_lev)
                self.stmt(s.body, body_lev)
                if s.incr:
                    self.expr(*s.incr, body_lev)
                self.frames.pop()
                if attempt == 0 and frame["brk"].level > max(body_lev.level, self.exit.level):
                    left = frame["brk"]
                    continue
                break
        elif isinstance(s, _Switch):
            self.expr(*s.cond, lev)
            nl = _maxlev(lev, self._cond(s.cond))
            self.frames.append({"kind": "switch", "skip": NOLEV, "brk": NOLEV})
            self.stmt(s.body, nl)
            self.frames.pop()
        elif isinstance(s, _Return):
            self.expr(s.a, s.b, lev)
            br, ex = self.level_here(lev)
            eff = _maxlev(br, ex)
            if eff.level:
                tagged = Lev(eff.level, eff.why, L.toks[s.tok].line)
                self.exit = _maxlev(self.exit, tagged)
                for fr in self.frames:
                    if fr["kind"] == "loop":
                        fr["brk"] = _maxlev(fr["brk"], tagged)
        elif isinstance(s, _Jump):
            br, ex = self.level_here(lev)
            eff = _maxlev(br, ex)
            if not eff.level or not self.frames:
                return
            tagged = Lev(eff.level, eff.why, L.toks[s.tok].line)
            if s.kind == "continue":
                loops = [fr for fr in self.frames if fr["kind"] == "loop"]
                if loops:
                    loops[-1]["skip"] = _maxlev(loops[-1]["skip"], tagged)
            else:
                fr = self.frames[-1]
                fr["skip"] = _maxlev(fr["skip"], tagged)
                if fr["kind"] == "loop":
                    fr["brk"] = _maxlev(fr["brk"], tagged)

    def _cond(self, rng) -> Lev:
        lev = self.L.lane_level(rng[0], rng[1], self.lanes)
        if lev.level:
            return Lev(lev.level, lev.why, self.L.toks[rng[0]].line if rng[0] < len(self.L.toks) else 0)
        return lev

    def expr(self, a: int, b: int, lev: Lev) -> None:
        L = self.L
        for pa, pb in L.split_top(a, b, ","):
            eq = next((k for k in L.top_level(pa, pb) if L.t(k) in ASSIGN_OPS), None)
            if eq is not None:
                self.expr(pa, eq, lev)
                self.expr(eq + 1, pb, lev)
                continue
            q = next((k for k in L.top_level(pa, pb) if L.t(k) == "?"), None)
            if q is not None:
                colon = L._ternary_colon(q, pb)
                self.expr(pa, q, lev)
                c = L.lane_level(pa, q, self.lanes)
                nl = _maxlev(lev, Lev(c.level, c.why, L.toks[q].line)) if c.level else lev
                self.expr(q + 1, colon, nl)
                self.expr(colon + 1, pb, nl)
                continue
            ops = [k for k in L.top_level(pa, pb) if L.t(k) in ("&&", "||")]
            if ops:
                cur = lev
                start = pa
                for k in ops + [pb]:
                    self.expr(start, k, cur)
                    c = L.lane_level(start, k, self.lanes)
                    if c.level:
                        cur = _maxlev(cur, Lev(c.level, c.why, L.toks[k].line if k < len(L.toks) else 0))
                    start = k + 1
                continue
            i = pa
            while i < pb:
                s = L.t(i)
                if s in ("(", "[", "{"):
                    c = L.close(i, pb)
                    self.expr(i + 1, c, lev)
                    i = c + 1
                    continue
                self.check_call(i, pb, lev)
                i += 1

    def check_call(self, i: int, b: int, lev: Lev) -> None:
        L = self.L
        c = L.collective_threshold(i, len(L.toks))
        if c is None or i in self.flagged:
            return
        thr, what = c
        br, ex = self.level_here(lev)
        need = {1: "every thread of the threadgroup", 2: "every lane of the simdgroup",
                3: "every lane of the quad"}[thr]
        if br.level >= thr:
            self.flagged.add(i)
            L.add_tok(i, "divergent-collective",
                      f"{what} must be reached by {need}, but it runs under a condition (line {br.line}) "
                      f"that depends on {br.why}, which is {_LEVEL_WORD[br.level]}; make it uniform "
                      "(mask the value instead of branching)")
        elif ex.level >= thr:
            self.flagged.add(i)
            L.add_tok(i, "early-return-collective",
                      f"{what} must be reached by {need}, but some lanes may have left at line {ex.line} "
                      f"(condition on {ex.why}, {_LEVEL_WORD[ex.level]}); compute with masked values "
                      "instead of returning early")


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def check_source(text: str, filename: str = "<string>",
                 macros: dict[str, list[str]] | None = None) -> list[Finding]:
    """Lint one MSL source text. Findings are sorted by position.

    ``macros`` maps object-like macro names defined elsewhere (another header) to the identifiers in
    their bodies; ``check_paths`` fills it from the linted files and the headers they include."""
    return _Linter(text, filename, macros).run()


def _object_macros(text: str) -> dict[str, list[str]]:
    code, _ = _strip(text)
    out = {}
    for d in _directives(code):
        if d.name == "define":
            m = re.match(r"\s*([A-Za-z_]\w*)(\(?)(.*)", d.body, re.S)
            if m and not m.group(2):
                out[m.group(1)] = re.findall(r"[A-Za-z_]\w*", m.group(3))
    return out


def _expand_paths(paths: Iterable[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files.extend(sorted(x for x in p.rglob("*") if x.is_file() and x.suffix in (".metal", ".h")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return files


def _lint_files(files: list[Path]) -> list[Finding]:
    texts = {f: f.read_text(encoding="utf-8", errors="replace") for f in files}
    # Object-like macros of every linted file and of the local headers they include ("x.h").
    macros: dict[str, list[str]] = {}
    seen: set[Path] = set()
    todo = list(texts)
    while todo:
        f = todo.pop()
        rf = f.resolve()
        if rf in seen:
            continue
        seen.add(rf)
        text = texts.get(f)
        if text is None:
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
        for name, body in _object_macros(text).items():
            macros.setdefault(name, body)
        for inc in re.findall(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', text, re.M):
            cand = f.parent / inc
            if cand.is_file():
                todo.append(cand)
    findings: list[Finding] = []
    for f, text in texts.items():
        findings.extend(check_source(text, str(f), macros))
    return findings


def check_paths(paths: Iterable[str | os.PathLike]) -> list[Finding]:
    """Lint files; directories are searched recursively for *.metal and *.h."""
    return _lint_files(_expand_paths(paths))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metalsim.lint",
                                 description="Lint MSL sources for what Apple's compiler or the emulator rejects.")
    ap.add_argument("paths", nargs="*", help="files, or directories searched for *.metal and *.h")
    ap.add_argument("--rules", action="store_true", help="list the rules and exit")
    args = ap.parse_args(argv)
    if args.rules:
        for name, why in RULES.items():
            print(f"{name}: {why}")
        return 0
    if not args.paths:
        ap.error("give at least one file or directory")
    try:
        files = _expand_paths(args.paths)
    except FileNotFoundError as e:
        print(f"metalsim.lint: {e}", file=sys.stderr)
        return 2
    findings = _lint_files(files)
    for f in findings:
        print(f)
    if findings:
        print(f"{len(findings)} finding(s) in {len(files)} file(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
