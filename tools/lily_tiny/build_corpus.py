#!/usr/bin/env python3
"""Build the lily-tiny training corpus from the CPython 3.11.7 standard library.

Source: the ``Lib/`` tree of CPython 3.11.7 (Python Software Foundation License
Version 2, a permissive licence). Either the ``Lib/`` folder of the official
source tarball ``Python-3.11.7.tar.xz`` or an installed 3.11.7 stdlib folder
(``.../lib/python3.11``) works; files that only exist in an installed copy
(``site-packages``, ``__pycache__``, ``_sysconfigdata_*``, ``config-3.11-*``)
are skipped, so both give the same corpus (check the printed SHA-256).

Three kinds of documents are made, all from that tree:

* ``src``   - every ``.py`` file (code, docstrings and comments), minus codec
  tables and files with very long lines or much non-ASCII text;
* ``topic`` - each entry of ``pydoc_data/topics.py`` (the language reference
  help topics, plain English prose);
* ``chat``  - ChatML conversations: a question about a public module, class or
  function, answered with its signature and docstring (non-test modules only).

Every document gets a group key (its source file or topic). A deterministic
hash of the group key splits groups into train and held-out, so a chat about a
function is held out together with the file that defines it. The held-out set
is: groups ordered by SHA-256 of the key, small ones (< 32 KB in total) taken in
that order until 220 KB of file groups (source + chats) and 30 KB of topics are
collected (about 1% of the corpus).

Outputs (in --out-dir): ``train.jsonl`` and ``heldout.jsonl`` (one JSON object
per document: id, kind, text), ``stats.json``. With --heldout-txt the held-out
documents are also written as one text file, documents joined by
``<|endoftext|>``.

Usage:
    python3 tools/lily_tiny/build_corpus.py --stdlib PATH/TO/lib/python3.11 \
        --out-dir .tiny_work/corpus --heldout-txt docs/lily-tiny/heldout.txt
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys

EOT = "<|endoftext|>"
HELDOUT_TARGET_CHARS = {"file:": 220_000, "topic:": 30_000}  # per group type
HELDOUT_MAX_GROUP_CHARS = 32_000

SKIP_DIRS = {"site-packages", "__pycache__"}
SKIP_FILE_PREFIXES = ("_sysconfigdata",)

QUESTION_TEMPLATES = {
    "module": [
        "What is the `{name}` module for?",
        "Give me an overview of the `{name}` module.",
        "What does the Python module `{name}` provide?",
    ],
    "class": [
        "What is the class `{name}`?",
        "Explain the `{name}` class.",
        "How do I use `{name}`?",
    ],
    "function": [
        "What does `{name}` do?",
        "Explain `{name}`.",
        "How do I use the function `{name}`?",
    ],
    "method": [
        "What does the method `{name}` do?",
        "Explain `{name}`.",
        "What is `{name}` for?",
    ],
}


def sha(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def pick(seq, key: str):
    return seq[int(sha(key)[:8], 16) % len(seq)]


def chatml(pairs) -> str:
    out = []
    for q, a in pairs:
        out.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
    return "".join(out)


def keep_source(rel: str, text: str) -> bool:
    parts = rel.split("/")
    if parts[0] == "encodings" and "decoding_table" in text:
        return False  # codec tables
    if rel == "pydoc_data/topics.py":
        return False  # used as prose topics instead
    lines = text.split("\n")
    if max(len(l) for l in lines) > 500:
        return False
    non_ascii = sum(1 for c in text if ord(c) > 127)
    if non_ascii > 0.02 * len(text):
        return False
    if len(text.strip()) < 200:
        return False
    return True


def module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    if mod.endswith(".__init__"):
        mod = mod[: -len(".__init__")]
    return mod


def is_test_module(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")


def signature(node) -> str:
    try:
        return "(" + ast.unparse(node.args) + ")"
    except Exception:
        return "(...)"


def docstring_pairs(rel: str, tree: ast.Module):
    """(question, answer) pairs for the public API documented in one module."""
    mod = module_name(rel)
    if any(p.startswith("_") for p in mod.split(".")):
        return []
    pairs = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= 80:
        q = pick(QUESTION_TEMPLATES["module"], mod).format(name=mod)
        pairs.append((q, doc.strip()))

    def visit(body, prefix, in_class):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name.startswith("_"):
                    continue
                qual = f"{prefix}{node.name}"
                full = f"{mod}.{qual}"
                d = ast.get_docstring(node)
                if isinstance(node, ast.ClassDef):
                    kind = "class"
                    head = f"class {full}"
                    bases = [ast.unparse(b) for b in node.bases]
                    if bases:
                        head += "(" + ", ".join(bases) + ")"
                else:
                    kind = "method" if in_class else "function"
                    head = f"{full}{signature(node)}"
                if d and len(d) >= 80:
                    q = pick(QUESTION_TEMPLATES[kind], full).format(name=full)
                    pairs.append((q, f"`{head}`\n\n{d.strip()}"))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, qual + ".", True)

    visit(tree.body, "", False)
    return pairs


def group_conversations(rel: str, pairs):
    """Split a module's pairs into conversations of 1 to 3 turns (deterministic)."""
    convs, i, n = [], 0, 0
    while i < len(pairs):
        size = 1 + int(sha(f"{rel}#{n}")[:8], 16) % 3
        convs.append(pairs[i : i + size])
        i += size
        n += 1
    return convs


def load_topics(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise SystemExit(f"no `topics` dict in {path}")


def collect(stdlib: str):
    docs = []  # dicts: id, group, kind, text
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = os.path.relpath(dirpath, stdlib).replace(os.sep, "/")
        dirnames[:] = [
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")
        ]
        for fn in filenames:
            if fn.endswith(".py") and not fn.startswith(SKIP_FILE_PREFIXES):
                rel = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                files.append(rel)
    files.sort()
    skipped = 0
    for rel in files:
        with open(os.path.join(stdlib, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        text = text.replace("\r\n", "\n")
        if not keep_source(rel, text):
            skipped += 1
            continue
        if not text.endswith("\n"):
            text += "\n"
        group = f"file:{rel}"
        docs.append({"id": f"src:{rel}", "group": group, "kind": "src", "text": text})
        if is_test_module(rel):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue  # lib2to3 test data etc.
        for n, conv in enumerate(group_conversations(rel, docstring_pairs(rel, tree))):
            docs.append(
                {"id": f"chat:{rel}#{n}", "group": group, "kind": "chat", "text": chatml(conv)}
            )
    topics = load_topics(os.path.join(stdlib, "pydoc_data", "topics.py"))
    for name in sorted(topics):
        text = topics[name].strip() + "\n"
        docs.append({"id": f"topic:{name}", "group": f"topic:{name}", "kind": "topic", "text": text})
    return docs, skipped


def split(docs):
    size = {}
    for d in docs:
        size[d["group"]] = size.get(d["group"], 0) + len(d["text"])
    held = set()
    for prefix, target in HELDOUT_TARGET_CHARS.items():
        total = 0
        for g in sorted((g for g in size if g.startswith(prefix)), key=sha):
            if total >= target:
                break
            if size[g] < HELDOUT_MAX_GROUP_CHARS:
                held.add(g)
                total += size[g]
    train = [d for d in docs if d["group"] not in held]
    heldout = [d for d in docs if d["group"] in held]
    return train, heldout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stdlib", required=True, help="CPython 3.11.7 Lib/ folder (or installed lib/python3.11)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--heldout-txt", help="also write the held-out documents here as text")
    args = ap.parse_args()

    if not os.path.isfile(os.path.join(args.stdlib, "pydoc_data", "topics.py")):
        sys.exit(f"{args.stdlib} does not look like a CPython Lib/ folder")
    docs, skipped = collect(args.stdlib)
    for d in docs:
        if EOT in d["text"]:
            sys.exit(f"document {d['id']} contains {EOT}")
    train, heldout = split(docs)

    os.makedirs(args.out_dir, exist_ok=True)
    digest = hashlib.sha256()
    for name, part in (("train", train), ("heldout", heldout)):
        with open(os.path.join(args.out_dir, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for d in part:
                line = json.dumps({"id": d["id"], "kind": d["kind"], "text": d["text"]}, ensure_ascii=False)
                f.write(line + "\n")
                digest.update(line.encode("utf-8") + b"\n")
    stats = {"sha256": digest.hexdigest(), "skipped_files": skipped}
    for name, part in (("train", train), ("heldout", heldout)):
        by_kind = {}
        for d in part:
            k = by_kind.setdefault(d["kind"], {"docs": 0, "chars": 0})
            k["docs"] += 1
            k["chars"] += len(d["text"])
        stats[name] = by_kind
    with open(os.path.join(args.out_dir, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    if args.heldout_txt:
        with open(args.heldout_txt, "w", encoding="utf-8") as f:
            f.write(EOT.join(d["text"] for d in heldout))
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
