"""scripts/doc_examples.py, the runner of the README's and the guide's shell examples: how it
reads info strings, which blocks it runs, refuses or skips, that a page's blocks run in
order in a fresh copy of the tracked files, and that a failing block fails the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from remat_test_scripts import REPO, load_script


D = load_script("doc_examples")


@pytest.mark.parametrize("info, expected", [
    ("sh", ("sh", None, None)),
    ("sh,no-run: needs Open MPI and 4 ranks", ("sh", "needs Open MPI and 4 ranks", None)),
    ("Python , no-run:  a signature", ("python", "a signature", None)),
    ("text", ("text", None, None)),
])
def test_info_strings(info, expected):
    assert D.parse_info(info) == expected


@pytest.mark.parametrize("info", ["sh,no-run", "sh,no-run:", "sh,no-run:   ", "sh,ignore",
                                  "sh,needs-env:", "sh,needs-env: lower", "python,needs-env: X"])
def test_a_marker_without_a_reason_or_unknown_is_an_error(info):
    lang, reason, error = D.parse_info(info)
    assert reason is None and error


def test_blocks_are_found_with_their_lines_and_kinds():
    text = ("# Page\n\n```sh\necho hi\n```\n\ntext\n\n````python\nx = '```'\n````\n\n"
            "```rust\nfn main() {}\n```\n\n```rust,no-run: needs a crate\nfn f() {}\n```\n"
            "```toml\na = 1\n```\n```console\n$ ls\n```\n")
    blocks = D.parse(Path("p.md"), text)
    assert [(b.line, b.lang, b.kind) for b in blocks] == [
        (3, "sh", "shell"), (9, "python", "python"), (13, "rust", "bad"),
        (17, "rust", "skip"), (20, "toml", "data"), (23, "console", "bad")]
    assert blocks[1].code == "x = '```'\n"  # a longer fence holds a shorter one


def test_an_unclosed_block_is_an_error():
    [block] = D.parse(Path("p.md"), "```sh\necho hi\n")
    assert block.kind == "bad" and "never closed" in block.marker_error


def _repo(tmp_path: Path, pages: dict[str, str]) -> Path:
    repo = tmp_path / "repo"
    (repo / "docs" / "src").mkdir(parents=True)
    (repo / "data.txt").write_text("tracked\n")
    (repo / "untracked.txt").write_text("not in a clone\n")
    for name, text in pages.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "data.txt", *pages], cwd=repo, check=True)
    return repo


def _run(repo: Path, page: str, bin_dir: Path) -> list[str]:
    blocks = D.parse(Path(page), (repo / page).read_text())
    return D.run_page(blocks, repo, bin_dir)


def test_a_page_runs_in_order_in_a_fresh_copy_of_the_tracked_files(tmp_path):
    page = ("```sh\ncat data.txt > copy.txt\ntest ! -e untracked.txt\n```\n"
            "```sh,no-run: would fail\nfalse\n```\n"
            "```sh\ngrep -q tracked copy.txt\nremat-fake\n```\n")
    repo = _repo(tmp_path, {"README.md": page})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "remat-fake").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "remat-fake").chmod(0o755)
    assert _run(repo, "README.md", bin_dir) == []
    assert not (repo / "copy.txt").exists()  # the copy, not the repository, was written to


def test_a_block_that_needs_an_unset_variable_is_skipped_or_fails_when_strict(tmp_path, monkeypatch):
    page = ("```sh\necho first > first.txt\n```\n"
            "```sh,needs-env: REMAT_DOC_TEST_SERVICE\ntest -n \"$REMAT_DOC_TEST_SERVICE\"\n```\n")
    repo = _repo(tmp_path, {"README.md": page})
    [_, block] = D.parse(Path("README.md"), page)
    assert block.kind == "shell" and block.needs_env == "REMAT_DOC_TEST_SERVICE"
    monkeypatch.delenv("REMAT_DOC_TEST_SERVICE", raising=False)
    assert _run(repo, "README.md", tmp_path) == []
    blocks = D.parse(Path("README.md"), page)
    [failure] = D.run_page(blocks, repo, tmp_path, strict_env=True)
    assert "README.md:4: needs REMAT_DOC_TEST_SERVICE" in failure
    monkeypatch.setenv("REMAT_DOC_TEST_SERVICE", "http://127.0.0.1:1")
    assert D.run_page(blocks, repo, tmp_path, strict_env=True) == []


def test_a_failing_unmarked_block_fails_and_names_its_line(tmp_path):
    page = "intro\n\n```sh\necho before\nfalse\necho never\n```\n```sh\necho later\n```\n"
    repo = _repo(tmp_path, {"docs/src/page.md": page})
    [failure] = _run(repo, "docs/src/page.md", tmp_path)
    assert failure.startswith("docs/src/page.md:3: exit 1")
    assert "before" in failure and "never" not in failure.split("--- output")[1]


def test_a_broken_relative_link_or_anchor_is_reported(tmp_path):
    repo = _repo(tmp_path, {
        "README.md": ("[guide](docs/src/intro.md) [web](https://example.com) ![pic](missing.svg)\n"
                      "[ok](docs/src/intro.md#plan-forms---order) [bad](docs/src/intro.md#nope)\n"),
        "docs/src/intro.md": ("# Intro\n## Plan forms: `--order`\n[back](../../README.md) [self](#intro)\n"
                              "```sh\n[not a link](nowhere.md)\n# not a heading\n```\n"),
    })
    assert D.check_links(repo) == [
        "README.md:1: link to missing.svg: no such file",
        "README.md:2: link to docs/src/intro.md#nope: no such heading",
    ]


def test_the_readme_stays_a_front_door():
    """Issue 59: a README a newcomer reads in five minutes (at most ~250 lines), opening with
    the two set-up commands, the test command being the one .ci/run runs."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    first = D.parse(Path("README.md"), readme)[0]
    assert "cargo run --release -p remat-cli -- train" in first.code
    assert "cargo test --workspace --release" in first.code
    assert "\ncargo test --workspace --release\n" in (REPO / ".ci" / "run").read_text()


def test_the_readme_and_the_guide_have_no_bad_blocks_or_links():
    """What CI checks before running anything: every block classified, every marker with
    its reason, every relative link resolving."""
    blocks = D.blocks(REPO)
    assert any(b.kind == "shell" and b.path == Path("README.md") for b in blocks)
    assert D.check_markers(blocks) == []
    assert D.check_links(REPO) == []
