#!/usr/bin/env python3
"""The documents stay current: README.md and docs/*.md.

- Every C++ block is an excerpt of a file that is built and run as a test: the line before it is
  `<!-- code: PATH -->` (PATH under examples/ or tests/), and its lines (without their indentation
  and the blank ones) are a run of that file's lines. Code that drifts from its file fails here.
- Every relative link names a file or folder of the repository.
- The README stays one screen of prose and code: at most 250 lines.

Usage: check_docs.py REPOSITORY_ROOT. Prints each failure as DOC:LINE: what; exits 1 on any.
"""
import pathlib
import re
import sys

MAX_README_LINES = 250


def lines_of(text):
    return [l.strip() for l in text.split("\n") if l.strip()]


def is_run_of(block, source):
    n = len(block)
    return n > 0 and any(source[i:i + n] == block for i in range(len(source) - n + 1))


def check(root):
    failures = []
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    for doc in docs:
        text = doc.read_text()
        name = doc.relative_to(root)
        for block in re.finditer(r"^```(c\+\+|cpp)\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, block.start()) + 1
            before = text[:block.start()].rstrip("\n").split("\n")[-1].strip()
            marker = re.fullmatch(r"<!-- code: (\S+) -->", before)
            if not marker:
                failures.append(f"{name}:{line}: a C++ block without `<!-- code: PATH -->` on the line before it")
                continue
            path = marker.group(1)
            source = root / path
            if not re.match(r"(examples|tests)/", path) or not source.is_file():
                failures.append(f"{name}:{line}: {path}: expected a file under examples/ or tests/")
                continue
            if not is_run_of(lines_of(block.group(2)), lines_of(source.read_text())):
                failures.append(f"{name}:{line}: the block is not (any more) a run of lines of {path}")
        for link in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = link.group(1).split("#")[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not (doc.parent / target).exists():
                line = text.count("\n", 0, link.start()) + 1
                failures.append(f"{name}:{line}: link to {link.group(1)}: no such file")
    readme_lines = (root / "README.md").read_text().count("\n")
    if readme_lines > MAX_README_LINES:
        failures.append(f"README.md: {readme_lines} lines (expected at most {MAX_README_LINES}: the rest goes in docs/)")
    return failures


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: check_docs.py REPOSITORY_ROOT")
    found = check(pathlib.Path(sys.argv[1]).resolve())
    for f in found:
        print(f)
    print(f"check_docs: {len(found)} failure(s)" if found else "check_docs: README.md and docs/ are current")
    sys.exit(1 if found else 0)
