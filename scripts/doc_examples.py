#!/usr/bin/env python3
"""Runs the shell examples of the README and the user guide, as a reader would.

Every fenced code block of ``README.md`` and ``docs/src/**/*.md`` is classified by its info
string (the text after the opening fence):

- ``sh`` or ``bash``: run here. The blocks of one page run in order, each with
  ``bash -euo pipefail``, in a fresh copy of the repository's tracked files (a fresh clone
  with nothing beside it: no ``target/``, no ``../shared``), so a page's later blocks see the
  files its earlier blocks wrote. ``remat`` is the release binary: ``target/release`` (or
  ``--bin DIR``) goes first on PATH.
- ``python``: run by pytest, one test per block (``python/tests/test_doc_python.py``, which
  reads the blocks through :func:`blocks`).
- ``rust`` and ``console``: refused unless marked ``no-run`` (the guide has no Rust
  examples of its own; Rust examples live in rustdoc, where ``cargo test`` runs them;
  ``console`` mixes commands with output nobody checks: write ``sh`` and ``text``).
- anything else (``text``, ``toml``, ``json``, ``pycon``...): data, never run.

A block that needs a service CI provides names the environment variable that points at it:
``sh,needs-env: REMAT_S3_TEST_ENDPOINT`` runs when the variable is set and is skipped, saying
so, when it is not (``--strict-env``, as CI runs it, fails it instead). A block that cannot
run at all says why: ``sh,no-run: needs Open MPI and 4 ranks``. The reason is
required; a ``no-run`` without one fails the check, and so does an unmarked block that
fails. Relative links and images that point at no file fail it too.

    python3 scripts/doc_examples.py                 # every page (after cargo build --release -p remat-cli)
    python3 scripts/doc_examples.py --only docs/src/cli/plan.md
    python3 scripts/doc_examples.py --list          # each block, its line and what happens to it
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHELL = {"sh", "bash"}
REFUSED_UNMARKED = {"rust", "console", "shell", "shell-session"}
PYTHON = {"python", "py", "python3"}
BLOCK_TIMEOUT_S = 240
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclasses.dataclass
class Block:
    """One fenced code block: where it is, its language, its no-run reason, its text."""

    path: Path  # relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str
    no_run: str | None  # the reason, when marked no-run
    marker_error: str | None  # what is wrong with the info string, if anything
    code: str
    needs_env: str | None = None  # an environment variable the block needs (needs-env: VAR)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def kind(self) -> str:
        """``shell``, ``python``, ``skip`` (marked no-run), ``data``, or ``bad``."""
        if self.marker_error:
            return "bad"
        if self.no_run is not None:
            return "skip"
        if self.lang in SHELL:
            return "shell"
        if self.lang in PYTHON:
            return "python"
        if self.lang in REFUSED_UNMARKED:
            return "bad"
        return "data"


ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def needs_env(info: str) -> str | None:
    """The variable of a ``needs-env: VAR`` attribute, if the info string has a valid one."""
    rest = info.strip().partition(",")[2].strip()
    if rest.startswith("needs-env:") and ENV_NAME.match(rest[len("needs-env:"):].strip()):
        return rest[len("needs-env:"):].strip()
    return None


def parse_info(info: str) -> tuple[str, str | None, str | None]:
    """(language, no-run reason or None, error or None) from a fence's info string, e.g.
    ``sh,no-run: needs Open MPI``; ``sh,needs-env: VAR`` is read by :func:`needs_env`."""
    lang, _, rest = info.strip().partition(",")
    lang = lang.strip().lower()
    rest = rest.strip()
    if not rest:
        return lang, None, None
    if rest.startswith("needs-env"):
        if lang not in SHELL or needs_env(info) is None:
            return lang, None, "`needs-env: VAR` takes one variable name, on sh blocks"
        return lang, None, None
    if not rest.startswith("no-run"):
        return lang, None, (f"unknown attribute {rest!r} (the attributes are `no-run: REASON` "
                            "and, on sh blocks, `needs-env: VAR`)")
    reason = rest[len("no-run"):].lstrip()
    if not reason.startswith(":") or not reason[1:].strip():
        return lang, None, "`no-run` needs a reason: `no-run: WHY IT CANNOT RUN HERE`"
    return lang, reason[1:].strip(), None


def parse(path: Path, text: str) -> list[Block]:
    """Every fenced block of a Markdown text (CommonMark fences: three or more backticks or
    tildes, closed by a fence of the same character at least as long)."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group("fence"), i
        lang, reason, error = parse_info(m.group("info"))
        if lang in REFUSED_UNMARKED and reason is None and error is None:
            error = (f"a `{lang}` block must be marked `no-run: REASON` (Rust examples belong "
                     "in rustdoc; write commands as `sh` and their output as `text`)")
        body = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0]) and set(close) == {fence[0]} and len(close) >= len(fence):
                break
            body.append(lines[i])
            i += 1
        else:
            error = error or "the block is never closed"
        out.append(Block(path, start + 1, lang, reason, error, "\n".join(body) + "\n",
                         needs_env(m.group("info")) if error is None else None))
        i += 1
    return out


def pages(repo: Path = REPO) -> list[Path]:
    """The README and every page of the guide, relative to ``repo``, in a fixed order."""
    found = [Path("README.md")]
    found += sorted(p.relative_to(repo) for p in (repo / "docs" / "src").rglob("*.md"))
    return found


def blocks(repo: Path = REPO) -> list[Block]:
    """Every fenced block of every page."""
    out: list[Block] = []
    for page in pages(repo):
        out += parse(page, (repo / page).read_text(encoding="utf-8"))
    return out


def tracked_files(repo: Path) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=repo, check=True,
                            capture_output=True).stdout
    return [name for name in listed.decode().split("\0") if name]


def fresh_clone(repo: Path, into: Path) -> Path:
    """A copy of the working tree's tracked files (what a clone holds, edits included)."""
    clone = into / "remat"
    for name in tracked_files(repo):
        src = repo / name
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        dst = clone / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return clone


def run_page(page_blocks: list[Block], repo: Path, bin_dir: Path,
             strict_env: bool = False) -> list[str]:
    """Runs a page's shell blocks in order in one fresh clone; the failures, described. A
    block that needs an environment variable that is not set is skipped, saying so, or fails
    with ``strict_env`` (CI sets what its blocks need)."""
    failures: list[str] = []
    runnable = [b for b in page_blocks if b.kind == "shell"]
    if not runnable:
        return failures
    with tempfile.TemporaryDirectory(prefix="remat-doc-") as tmp:
        clone = fresh_clone(repo, Path(tmp))
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        for block in runnable:
            if block.needs_env and not os.environ.get(block.needs_env):
                if strict_env:
                    failures.append(f"{block.where}: needs {block.needs_env}, which is not set")
                else:
                    print(f"  {block.where}: skipped: {block.needs_env} is not set", flush=True)
                break  # later blocks of the page may build on it
            started = time.monotonic()
            try:
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=clone,
                                      env=env, capture_output=True, text=True,
                                      timeout=BLOCK_TIMEOUT_S)
                ok, output = done.returncode == 0, done.stdout + done.stderr
                status = f"exit {done.returncode}"
            except subprocess.TimeoutExpired as err:
                ok, status = False, f"timed out after {BLOCK_TIMEOUT_S} s"
                output = (err.stdout or b"").decode(errors="replace") if isinstance(
                    err.stdout, bytes) else (err.stdout or "")
            took = time.monotonic() - started
            print(f"  {block.where}: {'ok' if ok else 'FAILED'} ({took:.1f} s)", flush=True)
            if not ok:
                tail = "\n".join(output.splitlines()[-30:])
                failures.append(f"{block.where}: {status}\n--- block ---\n{block.code}"
                                f"--- output (last 30 lines) ---\n{tail}")
                break  # later blocks of the page build on this one
    return failures


def check_markers(all_blocks: list[Block]) -> list[str]:
    return [f"{b.where}: {b.marker_error}" for b in all_blocks if b.kind == "bad"]


LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?:#(?P<anchor>[^)\s]*))?\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")


def heading_ids(text: str) -> set[str]:
    """The ids mdbook gives a page's headings: the text without its markup, lower case,
    spaces as dashes, other punctuation dropped."""
    ids, in_fence = set(), False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        m = None if in_fence else HEADING.match(line)
        if m:
            plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group("text")).replace("`", "")
            slug = "".join(c for c in plain.lower().replace(" ", "-")
                           if c.isalnum() or c in "-_")
            ids.add(slug)
    return ids


def check_links(repo: Path = REPO) -> list[str]:
    """Relative links and images of every page that point at no file (a moved chapter, a
    renamed picture) or at a heading the page does not have; links to the web are not
    fetched."""
    broken = []
    for page in pages(repo):
        in_fence = False
        for number, line in enumerate((repo / page).read_text(encoding="utf-8").splitlines(), 1):
            if FENCE.match(line):
                in_fence = not in_fence
            if in_fence:
                continue
            for m in LINK.finditer(line):
                target, anchor = m.group("target"), m.group("anchor")
                if re.match(r"^[a-z]+:", target) or (not target and not anchor):
                    continue
                path = repo / page.parent / target if target else repo / page
                if not path.exists():
                    broken.append(f"{page}:{number}: link to {target}: no such file")
                elif anchor and path.suffix == ".md" and anchor not in heading_ids(
                        path.read_text(encoding="utf-8")):
                    broken.append(f"{page}:{number}: link to {target}#{anchor}: no such heading")
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin", type=Path, default=REPO / "target" / "release",
                        help="directory holding the remat binary (default: target/release)")
    parser.add_argument("--only", action="append", default=[],
                        help="run only this page (a path as --list prints it); repeatable")
    parser.add_argument("--list", action="store_true", help="list the blocks and exit")
    parser.add_argument("--strict-env", action="store_true",
                        help="fail, instead of skipping, a block whose needs-env variable is unset")
    args = parser.parse_args(argv)

    all_blocks = blocks(REPO)
    if args.list:
        for b in all_blocks:
            note = f": {b.no_run}" if b.no_run else (f": {b.marker_error}" if b.marker_error else "")
            note += f" (needs {b.needs_env})" if b.needs_env else ""
            print(f"{b.where}\t{b.lang or '-'}\t{b.kind}{note}")
        return 0
    failures = check_markers(all_blocks) + check_links(REPO)
    binary = args.bin / "remat"
    if not binary.is_file():
        failures.append(f"{binary}: no remat binary (cargo build --release -p remat-cli)")
    wanted = {str(Path(p)) for p in args.only}
    unknown = wanted - {str(p) for p in pages(REPO)}
    failures += [f"--only {p}: not a page of the README or the guide" for p in sorted(unknown)]
    if not failures:
        started = time.monotonic()
        for page in pages(REPO):
            if wanted and str(page) not in wanted:
                continue
            page_blocks = [b for b in all_blocks if b.path == page]
            if any(b.kind == "shell" for b in page_blocks):
                print(f"{page}:", flush=True)
            failures += run_page(page_blocks, REPO, args.bin.resolve(), args.strict_env)
        print(f"shell examples: {time.monotonic() - started:.0f} s", flush=True)
    counts: dict[str, int] = {}
    for b in all_blocks:
        counts[b.kind] = counts.get(b.kind, 0) + 1
    print("blocks: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for failure in failures:
        print(f"\nFAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
