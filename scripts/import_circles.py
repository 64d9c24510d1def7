#!/usr/bin/env python3
"""Import circles inside each crate of the workspace (issue 29's aim: at most 3).

Usage: python3 scripts/import_circles.py [--edges] [WORKSPACE]

Reads every `crates/*/src/` tree, maps each `.rs` file to its module path (`src/a/b.rs`
and `src/a/b/mod.rs` are `a::b`; `src/lib.rs` and `src/main.rs` are the crate root),
collects the references each file makes to other modules of its crate (`use crate::...`,
`use super::...`, `use self::...` trees and `crate::` / `super::` / `self::` paths in code,
test modules included, comments and string literals not), builds the graph of modules and
prints, per crate, the strongly connected components with more than one node, and their
count.

What a node is: the module of one file. Its inline modules (`mod tests { ... }`) and a child
in a file of its own named `tests` (`a/b/tests.rs`) belong to it, since they count against
the module they test. Folder modules are not merged: `a/b/mod.rs` is node `a::b` and
`a/b/c.rs` is node `a::b::c`.

What an edge is: node X refers to an item of node Y. A path is resolved to the deepest
module it names; a name that module re-exports (`pub use child::Name` or
`pub use child::{Name, ...}`, followed through nested re-exports) is taken to the module
that defines it. An edge between a module and its own ancestor or descendant is left out:
a folder module's file declares and re-exports its parts, and the parts use what it
defines; that is the folder's structure, not an import between peers.

Python 3 standard library only, so the figure can be re-measured anywhere.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(src: str) -> str:
    """Blank out comments, string and char literals (newlines kept)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * src.count("\n", i, j))
            i = j
            continue
        m = re.match(r'b?r(#*)"', src[i : i + 260])
        if m and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + 1
            continue
        if c == "'":
            m = re.match(r"'(\\.[^']*|[^'\\])'", src[i : i + 12])
            if m:
                out.append("' '")
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def split_top(s: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside braces."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def expand_use_tree(tree: str, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """`a::{b, c::{d, e as f}}` -> [(a, b), (a, c, d), (a, c, e)]; globs end in `*`."""
    tree = re.sub(r"\s+as\s+" + IDENT, "", tree)
    tree = re.sub(r"\s+", "", tree)
    if tree.startswith("::"):
        tree = tree[2:]
    if not tree:
        return [prefix] if prefix else []
    if tree.startswith("{") and tree.endswith("}"):
        paths = []
        for part in split_top(tree[1:-1]):
            paths.extend(expand_use_tree(part, prefix))
        return paths
    brace = tree.find("{")
    if brace >= 0:
        head = tree[:brace].rstrip(":")
        segs = tuple(s for s in head.split("::") if s)
        return expand_use_tree(tree[brace:], prefix + segs)
    segs = tuple(s for s in tree.split("::") if s)
    return [prefix + segs]


def file_module(src_dir: Path, path: Path) -> tuple[str, ...]:
    rel = path.relative_to(src_dir).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts.pop()
    if len(parts) == 1 and parts[0] in ("lib", "main"):
        parts = []
    return tuple(parts)


class Crate:
    def __init__(self, root: Path):
        self.name = root.name
        self.src = root / "src"
        self.files: dict[tuple[str, ...], str] = {}
        for path in sorted(self.src.rglob("*.rs")):
            mod = file_module(self.src, path)
            if mod in self.files:  # a binary's extra roots (src/bin) are not walked
                continue
            self.files[mod] = strip_comments_and_strings(path.read_text(encoding="utf-8"))
        self.modules: set[tuple[str, ...]] = set(self.files)
        # Inline modules: (module path) -> the file module that holds it.
        self.inline_owner: dict[tuple[str, ...], tuple[str, ...]] = {}
        # Per file: list of (module path at that point, text) chunks.
        self.chunks: dict[tuple[str, ...], list[tuple[tuple[str, ...], str]]] = {}
        for mod, text in self.files.items():
            self.chunks[mod] = self._split_inline(mod, text)
        self.reexports: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = {}
        for mod, chunks in self.chunks.items():
            for scope, text in chunks:
                for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", text):
                    for path in expand_use_tree(m.group(1)):
                        if not path or path[-1] in ("*", "self"):
                            continue
                        full = self._absolute(scope, path)
                        if full is not None:
                            self.reexports.setdefault(scope, {})[path[-1]] = full

    def _split_inline(self, mod, text):
        """Cut a file into chunks by inline `mod name { ... }` blocks."""
        chunks = []
        stack = [(mod, -1)]  # (module, brace depth at which it closes)
        depth, start = 0, 0
        tokens = re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{|[{}]", text)
        for t in tokens:
            if t.group(1):
                chunks.append((stack[-1][0], text[start : t.start()]))
                start = t.end()
                inner = stack[-1][0] + (t.group(1),)
                self.modules.add(inner)
                self.inline_owner[inner] = mod
                stack.append((inner, depth))
                depth += 1
            elif t.group(0) == "{":
                depth += 1
            else:
                depth -= 1
                if len(stack) > 1 and depth == stack[-1][1]:
                    chunks.append((stack[-1][0], text[start : t.start()]))
                    start = t.end()
                    stack.pop()
        chunks.append((stack[-1][0], text[start:]))
        return chunks

    def _absolute(self, scope, path):
        """A path as written in `scope` -> absolute segments, or None (extern or unknown)."""
        segs = list(path)
        if segs[0] == "crate":
            return tuple(segs[1:])
        base = list(scope)
        if segs[0] == "self":
            return tuple(base + segs[1:])
        if segs[0] == "super":
            while segs and segs[0] == "super":
                if not base:
                    return None
                base.pop()
                segs.pop(0)
            return tuple(base + segs)
        if tuple(base + [segs[0]]) in self.modules:  # a child module, named bare
            return tuple(base + segs)
        return None

    def resolve(self, segs, seen=None):
        """Absolute segments -> the module that defines what they name."""
        seen = seen or set()
        k = len(segs)
        while k > 0 and tuple(segs[:k]) not in self.modules:
            k -= 1
        mod = tuple(segs[:k])
        rest = segs[k:]
        if rest and rest[0] in self.reexports.get(mod, {}) and (mod, rest[0]) not in seen:
            seen.add((mod, rest[0]))
            target = self.reexports[mod][rest[0]]
            return self.resolve(tuple(target) + tuple(rest[1:]), seen)
        return mod

    def node(self, mod):
        """The node a module belongs to (its file; `tests` children fold into the parent)."""
        mod = self.inline_owner.get(mod, mod)
        while mod and mod[-1] == "tests" and mod[:-1] in self.files:
            mod = mod[:-1]
        return mod

    def edges(self):
        edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
        path_re = re.compile(r"(?<![A-Za-z0-9_:$])((?:crate|super|self)(?:\s*::\s*" + IDENT + r")+)")
        for mod, chunks in self.chunks.items():
            src_node = self.node(mod)
            edges.setdefault(src_node, set())
            for scope, text in chunks:
                paths = []
                for m in re.finditer(r"\buse\s+([^;]+);", text):
                    paths.extend(expand_use_tree(m.group(1)))
                code = re.sub(r"\buse\s+[^;]+;", "", text)
                code = re.sub(r"\bpub\s*\(\s*in\s+[^)]*\)", "", code)
                for m in path_re.finditer(code):
                    paths.append(tuple(re.sub(r"\s+", "", m.group(1)).split("::")))
                for path in paths:
                    if not path or path[0] not in ("crate", "super", "self") and (
                        scope + (path[0],) not in self.modules
                    ):
                        continue
                    full = self._absolute(scope, path)
                    if full is None:
                        continue
                    target = self.node(self.resolve(tuple(s for s in full if s != "*")))
                    if related(src_node, target):
                        continue
                    edges[src_node].add(target)
        return edges


def related(a, b):
    """One module is the other, or its ancestor."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def sccs(edges):
    """Tarjan's strongly connected components, iteratively."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def name(mod):
    return "::".join(mod) or "crate"


def main(argv):
    show_edges = "--edges" in argv
    args = [a for a in argv if not a.startswith("--")]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    total = 0
    for crate_dir in sorted((root / "crates").iterdir()):
        if not (crate_dir / "src").is_dir():
            continue
        crate = Crate(crate_dir)
        edges = crate.edges()
        circles = [c for c in sccs(edges) if len(c) > 1]
        total += len(circles)
        print(f"{crate.name}: {len(circles)} circle(s)")
        for comp in circles:
            print("  " + " <-> ".join(name(m) for m in comp))
            if show_edges:
                members = set(comp)
                for m in comp:
                    for t in sorted(edges.get(m, ())):
                        if t in members:
                            print(f"    {name(m)} -> {name(t)}")
    print(f"total: {total} circle(s) inside crates")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
