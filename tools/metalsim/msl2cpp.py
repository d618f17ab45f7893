"""MSL -> C++ rewriter of the Metal emulator.

Input is MSL that clang has already preprocessed (``clang -E`` with the shim's metal_stdlib empty, so MSL
spellings survive and macros such as MLX's ``instantiate_kernel`` are expanded); its line markers keep every
diagnostic pointing at the original ``.metal`` file and line. Every rewrite keeps the line count.

What it does, and only this (everything else is the shim's job, in C++):
  * kernels (``kernel void f(...)``, ``[[kernel]] void f(...)``, templated kernels instantiated with
    ``template [[host_name("x")]] [[kernel]] decltype(f<T>) f<T>;``): parses the parameter attributes,
    removes them, and appends an entry thunk per kernel plus the ``mslsim_library_get()`` registry (abi.h);
  * ``threadgroup T x[N];`` inside functions: becomes a reference to per-threadgroup storage from libmslsim
    (poisoned with 0xFF bytes at the start of every threadgroup, separately allocated so ASan sees overflows);
  * ``constant T x [[function_constant(i)]];``: a global set per dispatch, plus program-scope constants whose
    initializers use function constants, recomputed per dispatch;
  * ``1.0h`` / ``1.0bf`` literals, ``static_cast<vector>(v)`` (a bit cast for clang vectors, a conversion in
    MSL) and ``vec<T, N>(...)`` constructors.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

__all__ = ["RewriteError", "Rewritten", "rewrite", "BUILTINS"]

REWRITER_VERSION = "2"

BUILTINS = (
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "dispatch_threads_per_threadgroup",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
    "thread_execution_width",
    "thread_index_in_quadgroup",
    "quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup",
    "grid_origin",
)
_BUILTIN_ALIASES = {"grid_size": "threads_per_grid", "dispatch_simdgroups_per_threadgroup": "simdgroups_per_threadgroup",
                    "dispatch_quadgroups_per_threadgroup": "quadgroups_per_threadgroup"}
# Attributes clang understands; every other [[...]] group (MSL's) is removed.
_STANDARD_ATTRS = {"maybe_unused", "likely", "unlikely", "fallthrough", "nodiscard", "noreturn", "deprecated"}


class RewriteError(Exception):
    """MSL the emulator cannot handle (message names file:line)."""


@dataclass
class Tok:
    kind: str  # id, num, str, punct
    text: str
    start: int
    end: int


@dataclass
class Arg:
    kind: str  # buffer, threadgroup, builtin
    index: int
    name: str
    type: str
    param: int  # position in the parameter list
    builtin: str = ""
    enabled_by: str = ""  # function constant name from [[function_constant(x)]]
    implicit: bool = False  # no [[buffer(i)]] / [[threadgroup(i)]]: the index is assigned as Metal does
    constant: bool = False  # in the constant address space (read-only)


@dataclass
class Kernel:
    name: str  # host name
    expr: str  # C++ expression naming the function (f or f<half>)
    params: list[Arg]
    body: int | None = None  # token index of the body's '{' (the template's, for an instantiation)


@dataclass
class Rewritten:
    cpp: str
    kernels: list[dict] = field(default_factory=list)
    constants: list[dict] = field(default_factory=list)


_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\f\v]+)
  | (?P<nl>\n)
  | (?P<str>(?:u8|u|U|L)?"(?:\\.|[^"\\\n])*")
  | (?P<chr>(?:u8|u|U|L)?'(?:\\.|[^'\\\n])*')
  | (?P<num>\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.'])*)
  | (?P<id>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<punct>::|->|\.\.\.|.)
    """,
    re.VERBOSE | re.DOTALL,
)
_MARKER = re.compile(r'#\s*(?:line\s+)?(\d+)\s+"((?:\\.|[^"\\])*)"')
_LITERAL = re.compile(r"^((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)(h|H|bf|BF)$")


class _Source:
    """Tokens of preprocessed text plus the map from offsets to the original file:line."""

    def __init__(self, text: str):
        self.text = text
        self.toks: list[Tok] = []
        self._marks: list[tuple[int, str, int]] = []  # (offset of the next line, file, its line number)
        self._nl: list[int] = []
        pos = 0
        line_start = True
        n = len(text)
        while pos < n:
            if line_start:
                j = pos
                while j < n and text[j] in " \t":
                    j += 1
                if j < n and text[j] == "#":
                    end = text.find("\n", j)
                    end = n if end < 0 else end
                    m = _MARKER.match(text, j, end)
                    if m:
                        self._marks.append((end + 1, bytes(m.group(2), "utf-8").decode("unicode_escape"), int(m.group(1))))
                    pos = end
                    line_start = False
                    continue
            m = _TOKEN.match(text, pos)
            kind = m.lastgroup
            if kind == "nl":
                self._nl.append(pos)
                line_start = True
            elif kind != "ws":
                line_start = False
                k = "str" if kind == "chr" else kind
                self.toks.append(Tok(k, m.group(), pos, m.end()))
            pos = m.end()
        self._mark_offsets = [m[0] for m in self._marks]

    def locate(self, offset: int) -> str:
        i = bisect.bisect_right(self._mark_offsets, offset) - 1
        if i < 0:
            return "<source>:?"
        start, name, line = self._marks[i]
        lines = bisect.bisect_left(self._nl, offset) - bisect.bisect_left(self._nl, start)
        return f"{name}:{line + lines}"


def _match(toks: list[Tok], i: int, open_: str, close: str) -> int:
    """Index of the token closing the bracket opened at toks[i]."""
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j].text
        if t == open_:
            depth += 1
        elif t == close:
            depth -= 1
            if depth == 0:
                return j
    raise RewriteError(f"unbalanced '{open_}'")


def _is_attr_start(toks: list[Tok], i: int) -> bool:
    return (
        i + 1 < len(toks)
        and toks[i].text == "["
        and toks[i + 1].text == "["
        and toks[i + 1].start == toks[i].end
    )


def _attr_end(toks: list[Tok], i: int) -> int:
    """Index of the final ']' of the attribute group starting at toks[i] ('[' '[')."""
    return _match(toks, i, "[", "]")


def _split_top(toks: list[Tok], lo: int, hi: int, angles: bool = True) -> list[tuple[int, int]]:
    """Ranges [a, b) of toks[lo:hi] separated by commas at nesting depth 0."""
    parts, depth, a = [], 0, lo
    for j in range(lo, hi):
        t = toks[j].text
        if t in "([{" or (angles and t == "<"):
            depth += 1
        elif t in ")]}" or (angles and t == ">"):
            depth -= 1
        elif t == "," and depth == 0:
            parts.append((a, j))
            a = j + 1
    if a < hi:
        parts.append((a, hi))
    return parts


class _Rewriter:
    def __init__(self, text: str, source_name: str):
        self.src = _Source(text)
        self.text = text
        self.toks = self.src.toks
        self.source_name = source_name
        self.edits: list[tuple[int, int, str]] = []
        self.kernels: list[Kernel] = []
        self.templates: dict[str, tuple[int, int]] = {}  # kernel template name -> params (open, close)
        self.fconsts: list[dict] = []
        self.derived: list[tuple[str, str, str]] = []  # (scope, name, initializer)
        self.attr_groups: list[tuple[int, int]] = []
        self.tg_count = 0
        self.scope = ""  # qualification of the namespace being scanned ("a::b::")
        # Function definitions at namespace scope: body '{' index -> (name, scope, static-memory tag or None
        # for a kernel, template-argument text of a kernel template or None). Filled by scan_top.
        self.bodies: dict[int, tuple[str, str, str | None, str | None]] = {}
        self.body_close: dict[int, int] = {}
        self.helper_tags: dict[str, str] = {}  # qualified helper name -> tag struct (helpers with threadgroup vars)
        self.helper_decl_start: dict[int, int] = {}  # body '{' index -> first token of the helper's declaration

    # ---- helpers ------------------------------------------------------------------------------------
    def err(self, tok_index: int, msg: str) -> RewriteError:
        where = self.src.locate(self.toks[min(tok_index, len(self.toks) - 1)].start) if self.toks else "<source>"
        return RewriteError(f"{where}: error: {msg}")

    def span(self, a: int, b: int) -> str:
        """Source text of toks[a:b] (with single spaces between tokens)."""
        out = []
        for j in range(a, b):
            if out and self.toks[j].start > self.toks[j - 1].end:
                out.append(" ")
            out.append(self.toks[j].text)
        return "".join(out)

    def replace(self, a: int, b: int, new: str) -> None:
        """Replaces toks[a..b] (inclusive) keeping the number of newlines."""
        start, end = self.toks[a].start, self.toks[b].end
        self.edits.append((start, end, new + "\n" * self.text.count("\n", start, end)))

    def attr_items(self, i: int, j: int) -> list[str]:
        """Items of the attribute group toks[i..j] ('[[' ... ']]')."""
        return [self.span(a, b).strip() for a, b in _split_top(self.toks, i + 2, j - 1, angles=False)]

    def groups_in(self, a: int, b: int):
        """Attribute groups (start, end, items) in toks[a:b]."""
        j = a
        while j < b:
            if _is_attr_start(self.toks, j):
                e = _attr_end(self.toks, j)
                yield j, e, self.attr_items(j, e)
                j = e + 1
            else:
                j += 1

    # ---- top level ----------------------------------------------------------------------------------
    def scan_top(self) -> None:
        toks, n, i = self.toks, len(self.toks), 0
        scopes: list[str] = []  # enclosing namespaces ('' for extern "C" and unnamed ones)
        while i < n:
            t = toks[i].text
            if t == "}":
                if scopes:
                    scopes.pop()
                    self.scope = "".join(f"{s}::" for s in scopes if s)
                i += 1
                continue
            if t == ";":
                i += 1
                continue
            if t == "namespace":
                j = i + 1
                while j < n and toks[j].text not in ("{", ";", "="):
                    j += 1
                if j < n and toks[j].text == "{":
                    scopes.append("".join(x.text for x in toks[i + 1 : j] if x.text != "inline"))
                    self.scope = "".join(f"{s}::" for s in scopes if s)
                    i = j + 1
                    continue
            if t == "extern" and i + 2 < n and toks[i + 1].kind == "str" and toks[i + 2].text == "{":
                scopes.append("")
                i += 3
                continue
            i = self.statement(i)

    def statement(self, i: int) -> int:
        toks, n = self.toks, len(self.toks)
        j, depth = i, 0
        while j < n:
            x = toks[j].text
            if x in ("(", "["):
                depth += 1
            elif x in (")", "]"):
                depth -= 1
            elif depth == 0 and x == ";":
                self.declaration(i, j, None)
                return j + 1
            elif depth == 0 and x == "{":
                k = _match(toks, j, "{", "}")
                hs = i  # the header, after any template parameter list (default arguments have '=')
                if toks[i].text == "template" and i + 1 < j and toks[i + 1].text == "<":
                    hs = min(_match(toks, i + 1, "<", ">") + 1, j)
                head, d = set(), 0
                for h in range(hs, j):  # the header's tokens outside parentheses and brackets
                    x = toks[h].text
                    d += x in ("(", "[")
                    d -= x in (")", "]")
                    if d == 0:
                        head.add(x)
                has_paren = any(toks[h].text == "(" for h in range(hs, j))
                if "=" in head or (head & {"struct", "class", "union", "enum"} and not has_paren):
                    j = k + 1  # a type definition or an initializer: the statement goes on to ';'
                    continue
                self.declaration(i, j, (j, k))
                return k + 1
            j += 1
        return n

    def declaration(self, a: int, b: int, body) -> None:
        """A top-level declaration toks[a:b] (b is ';' or the body's '{')."""
        toks = self.toks
        first = toks[a].text
        is_kernel = any(t.kind == "id" and t.text == "kernel" for t in toks[a:b]) or any(
            "kernel" in items for _, _, items in self.groups_in(a, b)
        )
        if first == "template" and a + 1 < b and toks[a + 1].text != "<":
            if is_kernel:
                self.instantiation(a, b)
            return
        if is_kernel:
            self.kernel_decl(a, b, body)
            return
        if body is not None:
            try:
                name_i, _, _ = self.function_parts(a, b)
            except RewriteError:
                return
            if toks[name_i].kind == "id":
                self.bodies[body[0]] = (toks[name_i].text, self.scope, None, None)
                self.body_close[body[0]] = body[1]
                self.helper_decl_start[body[0]] = a
            return
        if first == "constant":
            self.constant_decl(a, b)

    def function_parts(self, a: int, b: int):
        """(name index, '(' index, ')' index) of the function declared in toks[a:b]."""
        toks, j = self.toks, a
        if toks[j].text == "template" and j + 1 < b and toks[j + 1].text == "<":
            j = _match(toks, j + 1, "<", ">") + 1
        while j < b:
            if _is_attr_start(toks, j):
                j = _attr_end(toks, j) + 1
                continue
            if toks[j].text == "(":
                break
            j += 1
        if j >= b:
            raise self.err(a, "cannot find the kernel's parameter list")
        name = j - 1
        if toks[name].text == ">":  # f<T>(...)
            depth = 0
            while name > a:
                if toks[name].text == ">":
                    depth += 1
                elif toks[name].text == "<":
                    depth -= 1
                    if depth == 0:
                        name -= 1
                        break
                name -= 1
        return name, j, _match(toks, j, "(", ")")

    def host_name(self, a: int, b: int) -> str | None:
        for _, _, items in self.groups_in(a, b):
            for it in items:
                m = re.fullmatch(r"host_name\s*\((.*)\)", it, re.DOTALL)
                if m:  # adjacent literals concatenate, as macros like MLX's instantiate_kernel produce them
                    return "".join(re.findall(r'"((?:\\.|[^"\\])*)"', m.group(1)))
        return None

    def kernel_decl(self, a: int, b: int, body) -> None:
        toks = self.toks
        for j in range(a, b):
            if toks[j].kind == "id" and toks[j].text == "kernel":
                self.replace(j, j, "")
        name_i, lp, rp = self.function_parts(a, b)
        name = toks[name_i].text
        if toks[a].text == "template":
            self.templates[name] = (lp, rp)
            if body is not None:
                self.bodies[body[0]] = (name, self.scope, "kernel", self.template_args(a))
                self.body_close[body[0]] = body[1]
            return
        if body is not None:
            self.bodies[body[0]] = (name, self.scope, "kernel", None)
            self.body_close[body[0]] = body[1]
        if body is None:
            return  # a prototype; the definition registers the kernel
        params = self.parse_params(lp, rp)
        self.kernels.append(Kernel(self.host_name(a, b) or name, self.scope + name, params, body[0]))

    def template_args(self, a: int) -> str:
        """`T, N, Ts...`: the template's own parameters as arguments (toks[a] is 'template')."""
        toks = self.toks
        close = _match(toks, a + 1, "<", ">")
        names = []
        for pa, pb in _split_top(toks, a + 2, close):
            eq = next((j for j in range(pa, pb) if toks[j].text == "="), pb)
            ids = [j for j in range(pa, eq) if toks[j].kind == "id"]
            if not ids:
                raise self.err(pa, "cannot parse this template parameter")
            pack = any(toks[j].text == "..." for j in range(pa, eq))
            names.append(toks[ids[-1]].text + ("..." if pack else ""))
        return ", ".join(names)

    def instantiation(self, a: int, b: int) -> None:
        """template [[host_name("x")]] [[kernel]] decltype(f<T>) f<T>;  (or ... void f<T>(params);)"""
        toks = self.toks
        host = self.host_name(a, b)
        j = a + 1
        while j < b and _is_attr_start(toks, j):
            j = _attr_end(toks, j) + 1
        if j < b and toks[j].text == "decltype":
            close = _match(toks, j + 1, "(", ")")
            expr = self.span(j + 2, close)
            base = toks[j + 2].text
            if base not in self.templates:
                raise self.err(j, f"instantiation of unknown kernel template '{base}'")
            lp, rp = self.templates[base]
        else:
            # template [[host_name("x")]] kernel void f<float>(device const float*, ...); the parameter list
            # names only types, so attributes and names come from the kernel template's definition.
            name_i, lp, rp = self.function_parts(a, b)
            expr = self.span(name_i, lp)
            base = toks[name_i].text
            if base in self.templates:
                lp, rp = self.templates[base]
        params = self.parse_params(lp, rp)
        body = next((k for k, v in self.bodies.items() if v[0] == base and v[2] == "kernel"), None)
        self.kernels.append(Kernel(host or expr, self.scope + expr, params, body))
        # The thunk names the specialization, which instantiates it; the explicit instantiation goes.
        self.replace(a, b, "")

    def parse_params(self, lp: int, rp: int) -> list[Arg]:
        toks, out = self.toks, []
        for pos, (pa, pb) in enumerate(_split_top(toks, lp + 1, rp)):
            attrs, keep = [], []
            j = pa
            while j < pb:
                if _is_attr_start(toks, j):
                    e = _attr_end(toks, j)
                    attrs.extend(self.attr_items(j, e))
                    j = e + 1
                else:
                    keep.append(j)
                    j += 1
            if not keep:
                continue
            if len(keep) == 1 and toks[keep[0]].text == "void":
                continue
            name_i = keep[-1]
            if toks[name_i].kind != "id":
                raise self.err(pa, "kernel parameters need a name")
            name = toks[name_i].text
            type_text = " ".join(toks[k].text for k in keep[:-1])
            type_text = re.sub(r"\s*([*&])", r"\1", type_text)
            arg = None
            enabled = ""
            for it in attrs:
                m = re.fullmatch(r"(\w+)\s*(?:\((.*)\))?", it, re.DOTALL)
                if not m:
                    raise self.err(pa, f"unsupported attribute [[{it}]] on kernel parameter '{name}'")
                key, val = m.group(1), (m.group(2) or "").strip()
                key = _BUILTIN_ALIASES.get(key, key)
                if key in ("buffer", "threadgroup"):
                    arg = Arg(key, self.index_value(val, pa), name, type_text, pos)
                elif key in BUILTINS:
                    arg = Arg("builtin", -1, name, type_text, pos, builtin=key)
                elif key == "function_constant":
                    enabled = val
                else:
                    raise self.err(pa, f"kernel parameter '{name}': [[{it}]] is not supported by the emulator")
            type_ids = {toks[k].text for k in keep[:-1]}
            if arg is None:
                space = next((sp for sp in ("device", "constant", "threadgroup") if sp in type_ids), None)
                if space is None:
                    raise self.err(pa, f"kernel parameter '{name}' has no [[buffer]], [[threadgroup]] or builtin "
                                       "attribute, and is not in the device, constant or threadgroup address space")
                arg = Arg("threadgroup" if space == "threadgroup" else "buffer", -1, name, type_text, pos,
                          implicit=True)
            arg.constant = "constant" in type_ids
            arg.enabled_by = enabled
            out.append(arg)
        # Arguments without an index attribute. The MSL specification (section 5.2.1, "Locating buffer,
        # texture, and sampler arguments") says: "If the location indices are not specified, the Metal
        # compiler assigns them using the first available location index." The search tools available here
        # did not find the spec text itself, so this implements that sentence as quoted: in parameter order,
        # each unattributed argument takes the lowest index of its kind (buffer or threadgroup) not taken by
        # an explicit attribute or an earlier unattributed argument.
        for kind in ("buffer", "threadgroup"):
            taken = {a.index for a in out if a.kind == kind and not a.implicit}
            nxt = 0
            for a in out:
                if a.kind == kind and a.implicit:
                    while nxt in taken:
                        nxt += 1
                    a.index = nxt
                    taken.add(nxt)
        return out

    def index_value(self, text: str, at: int) -> int:
        if not re.fullmatch(r"[0-9xXa-fA-FuUlL+\-*() \t]+", text):
            raise self.err(at, f"binding index '{text}' is not an integer constant")
        try:
            return int(eval(re.sub(r"(?<=[0-9a-fA-F])[uUlL]+", "", text), {"__builtins__": {}}))
        except Exception as e:  # noqa: BLE001 - reported as a compile error
            raise self.err(at, f"binding index '{text}': {e}") from None

    def constant_decl(self, a: int, b: int) -> None:
        toks = self.toks
        for g, e, items in self.groups_in(a, b):
            for it in items:
                m = re.fullmatch(r"function_constant\s*\((.*)\)", it, re.DOTALL)
                if m:
                    name_i = g - 1
                    name = toks[name_i].text
                    ctype = self.span(a + 1, name_i)
                    self.fconsts.append({"index": self.index_value(m.group(1), g), "name": name, "type": ctype,
                                         "scope": self.scope})
                    self.replace(a, b, f"static {ctype} {name}; static int __mslsim_fcdef_{name};")
                    return
        eq = next((j for j in range(a, b) if toks[j].text == "="), None)
        if eq is None:
            return
        known = {c["name"] for c in self.fconsts} | {d[1] for d in self.derived} | {"is_function_constant_defined"}
        if not any(toks[j].kind == "id" and toks[j].text in known for j in range(eq + 1, b)):
            return
        name_i = eq - 1
        name = toks[name_i].text
        ctype = self.span(a + 1, name_i)
        self.derived.append((self.scope, name, self.span(eq + 1, b)))
        self.replace(a, b, f"static {ctype} {name};")

    # ---- function bodies: threadgroup storage ------------------------------------------------------------
    def scan_bodies(self) -> None:
        """`threadgroup` storage declared inside any function body (member functions and lambdas too)."""
        toks, n = self.toks, len(self.toks)
        stack: list[bool] = []  # per open brace: is it a namespace / extern "C" block?
        funcs: list[tuple[int, int]] = []  # enclosing function bodies: (brace depth, '{' index)
        j = 0
        while j < n:
            t = toks[j]
            if t.text == "{" and j in self.bodies:
                funcs.append((len(stack), j))
            if t.text == "}" and funcs and funcs[-1][0] == len(stack) - 1:
                funcs.pop()
            if t.text == "{":
                k = j - 1
                while k >= 0 and (toks[k].kind == "id" or toks[k].text == "::") and toks[k].text != "namespace":
                    k -= 1
                is_ns = (k >= 0 and toks[k].text == "namespace") or (
                    j >= 2 and toks[j - 1].kind == "str" and toks[j - 2].text == "extern"
                )
                stack.append(is_ns)
            elif t.text == "}":
                if stack:
                    stack.pop()
            elif (
                t.kind == "id"
                and t.text == "threadgroup"
                and stack
                and not stack[-1]
                and toks[j - 1].text in ("{", "}", ";")
            ):
                end, depth = j, 0
                while end < n:
                    x = toks[end].text
                    if x in "([{":
                        depth += 1
                    elif x in ")]}":
                        depth -= 1
                    elif x == ";" and depth == 0:
                        break
                    end += 1
                self.threadgroup_decl(j, end, funcs[-1][1] if funcs else None)
                j = end
                continue
            j += 1

    def static_tag(self, body: int | None) -> str | None:
        """The tag type under which threadgroup declarations in the function with this body register."""
        if body is None:
            return None  # a member function or lambda: counted only at run time
        name, scope, kind, targs = self.bodies[body]
        if kind == "kernel":
            return f"::mslsim::fn_tag<&{name}{'<' + targs + '>' if targs else ''}>"
        qual = f"{scope}__mslsim_tgfn_{name}"
        self.helper_tags[scope + name] = qual
        return qual

    def threadgroup_decl(self, a: int, b: int, body: int | None = None) -> None:
        """toks[a] is 'threadgroup', toks[b] is ';'; body is the '{' of the enclosing function (if known)."""
        toks = self.toks
        parts = _split_top(toks, a + 1, b)
        depth = 0
        for j in range(a + 1, b):
            x = toks[j].text
            if x in "([<":
                depth += 1
            elif x in ")]>":
                depth -= 1
            elif x in ("*", "&", "&&") and depth == 0:
                return  # a pointer or reference to threadgroup memory, not storage
        out = []
        ctype = None
        for k, (pa, pb) in enumerate(parts):
            br = next((j for j in range(pa, pb) if toks[j].text == "["), pb)
            name_i = br - 1
            if toks[name_i].kind != "id":
                raise self.err(pa, "cannot parse this threadgroup declaration")
            if k == 0:
                ctype = self.span(pa, name_i)
            dims = self.span(br, pb)
            if "=" in dims:
                raise self.err(pa, "threadgroup variables cannot have initializers")
            name = toks[name_i].text
            self.tg_count += 1
            key = f"__mslsim_tgkey_{self.tg_count}"
            # Through a typedef: `half (&t)[64]` would expand the shim's function-like macro `half(...)`
            # (MSL's constructor syntax), as would every vector type name followed by '('.
            ty = f"__mslsim_tgtype_{self.tg_count}"
            reg = ""
            tag = self.static_tag(body)
            if tag is not None:
                reg = f"(void)&::mslsim::tg_static<{tag}, {self.tg_count}, sizeof({ty})>::reg; "
            out.append(
                f"typedef {ctype} {ty}{dims}; static char {key}; {reg}threadgroup {ty}& {name} = "
                f"*(threadgroup {ty}*)::mslsim_tg_alloc(&{key}, sizeof({ty}), alignof({ty}));"
            )
        self.replace(a, b, " ".join(out))

    # ---- token-level rewrites -----------------------------------------------------------------------
    def scan_tokens(self) -> None:
        toks, n = self.toks, len(self.toks)
        j = 0
        while j < n:
            t = toks[j]
            if _is_attr_start(toks, j):
                e = _attr_end(toks, j)
                items = self.attr_items(j, e)
                if not all(it.split("(")[0].strip() in _STANDARD_ATTRS or "::" in it for it in items):
                    self.replace(j, e, "")
                j = e + 1
                continue
            if t.kind == "num":
                m = _LITERAL.match(t.text)
                if m:
                    ty = "half" if m.group(2) in ("h", "H") else "bfloat"
                    self.replace(j, j, f"(({ty}){m.group(1)})")
            elif t.kind == "id" and t.text == "static_cast" and j + 1 < n and toks[j + 1].text == "<":
                close = self.angle_close(j + 1)
                if close is not None and toks[close - 1].text not in ("*", "&", "&&"):
                    self.replace(j, j, "::mslsim::msl_static_cast")
            elif t.kind == "id" and t.text == "vec" and j + 1 < n and toks[j + 1].text == "<":
                close = self.angle_close(j + 1)
                prev = toks[j - 1].text if j else ""
                if close is not None and close + 1 < n and toks[close + 1].text == "(" and prev not in (".", "->"):
                    start = j
                    if prev == "::" and j >= 2 and toks[j - 2].text == "metal":
                        start = j - 2
                    self.replace(start, close, f"::mslsim::make_vec<{self.span(j + 2, close)}>")
                    j = close
            j += 1

    def angle_close(self, i: int) -> int | None:
        depth = 0
        for j in range(i, min(len(self.toks), i + 200)):
            x = self.toks[j].text
            if x in ("<", "(", "["):
                depth += 1
            elif x in (">", ")", "]"):
                depth -= 1
                if depth == 0:
                    return j if x == ">" else None
            elif x in (";", "{", "}"):
                return None
        return None

    # ---- output -------------------------------------------------------------------------------------
    def apply_edits(self) -> str:
        out, pos = [], 0
        for start, end, new in sorted(self.edits, key=lambda e: (e[0], -e[1])):
            if start < pos:
                continue  # inside a larger edit (a removed statement)
            out.append(self.text[pos:start])
            out.append(new)
            pos = end
        out.append(self.text[pos:])
        return "".join(out)

    def generate(self) -> str:
        fc_index = {c["name"]: c["index"] for c in self.fconsts}
        seen = set()
        lines = ['', '# 1 "<mslsim generated>"', "namespace {"]
        for k, kern in enumerate(self.kernels):
            if kern.name in seen:
                raise RewriteError(f"{self.source_name}: error: two kernels named '{kern.name}'")
            seen.add(kern.name)
            F = f"decltype({kern.expr})"
            call, args = [], []
            for p in kern.params:
                P = f"::mslsim::param_t<{F}, {p.param}>"
                if p.kind == "builtin":
                    call.append(f"::mslsim::builtin_arg<{P}>(__b->{p.builtin})")
                    continue
                if p.enabled_by and p.enabled_by not in fc_index:
                    raise RewriteError(
                        f"{self.source_name}: error: kernel '{kern.name}': argument '{p.name}' names unknown "
                        f"function constant '{p.enabled_by}'"
                    )
                call.append(f"::mslsim::bind_arg<{P}>(__a[{len(args)}])")
                kind = "MSLSIM_ARG_BUFFER" if p.kind == "buffer" else "MSLSIM_ARG_THREADGROUP"
                writes = "0" if p.kind != "buffer" or p.constant else f"::mslsim::arg_writes<{P}>()"
                args.append(
                    f"{{{kind}, {p.index}, {_c_str(p.name)}, {_c_str(p.type)}, ::mslsim::arg_min_bytes<{P}>(), "
                    f"{fc_index.get(p.enabled_by, -1)}, {writes}}}"
                )
            tags = [f"::mslsim::fn_tag<&{kern.expr}>"] + self.reachable_helper_tags(kern.body)
            lines.append(f"size_t __mslsim_static_tg_{k}() {{ return ::mslsim::tg_static_bytes<{', '.join(tags)}>(); }}")
            lines.append(f"void __mslsim_entry_{k}(void* const* __a) {{")
            lines.append("  const ::mslsim_builtins* __b = ::mslsim_lane_builtins(); (void)__b; (void)__a;")
            lines.append(f"  {kern.expr}({', '.join(call)});")
            lines.append("}")
            if args:
                lines.append(f"const ::mslsim_arg __mslsim_args_{k}[] = {{{', '.join(args)}}};")
        kern_entries = [
            f"{{{_c_str(kern.name)}, {sum(p.kind != 'builtin' for p in kern.params)}, "
            f"{f'__mslsim_args_{k}' if any(p.kind != 'builtin' for p in kern.params) else 'nullptr'}, "
            f"&__mslsim_entry_{k}, &__mslsim_static_tg_{k}}}"
            for k, kern in enumerate(self.kernels)
        ]
        if kern_entries:
            lines.append(f"const ::mslsim_kernel __mslsim_kernels[] = {{{', '.join(kern_entries)}}};")
        const_entries = [
            f"{{{c['index']}, {_c_str(c['name'])}, {_c_str(c['type'])}, sizeof({c['scope']}{c['name']}), "
            f"(void*)&{c['scope']}{c['name']}, &{c['scope']}__mslsim_fcdef_{c['name']}}}"
            for c in self.fconsts
        ]
        if const_entries:
            lines.append(f"const ::mslsim_function_constant __mslsim_constants[] = {{{', '.join(const_entries)}}};")
        lines.append("void __mslsim_specialize() {")
        for scope, name, init in self.derived:
            using = f"using namespace {scope[:-2]}; " if scope else ""
            lines.append(f"  {{ {using}{scope}{name} = ({init}); }}")
        lines.append("}")
        lines.append("}  // namespace")
        lines.append('extern "C" __attribute__((visibility("default"))) const ::mslsim_library* mslsim_library_get(void) {')
        lines.append(
            f"  static const ::mslsim_library lib = {{MSLSIM_ABI_VERSION, {_c_str(self.source_name)}, "
            f"{len(self.kernels)}, {'__mslsim_kernels' if kern_entries else 'nullptr'}, {len(self.fconsts)}, "
            f"{'__mslsim_constants' if const_entries else 'nullptr'}, &__mslsim_specialize}};"
        )
        lines.append("  return &lib;")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def reachable_helper_tags(self, body: int | None) -> list[str]:
        """Tags of the same-file helpers with threadgroup variables that this body calls, transitively
        (by name: an overloaded helper counts with all its overloads)."""
        if body is None:
            return []
        by_name: dict[str, list[int]] = {}
        for start, (name, _scope, kind, _t) in self.bodies.items():
            if kind is None:
                by_name.setdefault(name, []).append(start)
        seen, todo, tags = {body}, [body], []
        while todo:
            b = todo.pop()
            for j in range(b + 1, self.body_close[b]):
                t = self.toks[j]
                if t.kind != "id" or t.text not in by_name or j + 1 >= len(self.toks):
                    continue
                for hb in by_name[t.text]:
                    if hb not in seen:
                        seen.add(hb)
                        todo.append(hb)
                        name, scope, _k, _t = self.bodies[hb]
                        tag = self.helper_tags.get(scope + name)
                        if tag and tag not in tags:
                            tags.append(tag)
        return tags

    def run(self) -> Rewritten:
        self.scan_top()
        self.scan_bodies()
        self.scan_tokens()
        # Helper tags are declared before any code: namespace-scope structs in the helper's namespace.
        decls = []
        for qual in self.helper_tags.values():
            *ns, tag = qual.split("::")
            decls.append("".join(f"namespace {x} {{ " for x in ns) + f"struct {tag};" + " }" * len(ns))
        prefix = " ".join(decls) + "\n" if decls else ""
        cpp = prefix + self.apply_edits() + self.generate()
        kernels = [
            {
                "name": k.name,
                "args": [
                    {"kind": p.kind, "index": p.index, "name": p.name, "type": p.type, "builtin": p.builtin}
                    for p in k.params
                ],
            }
            for k in self.kernels
        ]
        return Rewritten(cpp, kernels, [{k: c[k] for k in ("index", "name", "type")} for c in self.fconsts])


def _c_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def rewrite(preprocessed: str, source_name: str) -> Rewritten:
    """Rewrites preprocessed MSL into C++ for the shim; raises RewriteError naming file:line."""
    return _Rewriter(preprocessed, source_name).run()
