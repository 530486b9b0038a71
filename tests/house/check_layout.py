#!/usr/bin/env python3
"""The house rules a reviewer would otherwise check by hand (docs/development.md, "The house"):

1. no file of the library or the trainer past 500 lines;
2. no function of theirs past about 100 lines (110: a longer one has two jobs);
3. no include that climbs a folder ("../x.hpp"): private headers are named from their src/ root;
4. zero/src's parts include only the parts below them (zero/CMakeLists.txt lists the order).

Prints every breach with its file and line, and exits 1 when there is one. Run from anywhere:
    python3 tests/house/check_layout.py [REPO_ROOT]
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
COMPONENTS = ["async", "collectives", "data", "modules", "offload", "zero", "trainer"]
SOURCE_ENDINGS = (".cpp", ".hpp", ".cu", ".cuh", ".h")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 110
# zero/src's parts, bottom first: a file may include its own part and the ones before it.
ZERO_PARTS = ["", "placement", "schedule", "plan", "checkpoint", "formats", "engine"]

NOT_A_FUNCTION = re.compile(r"^((namespace|struct|class|enum|union|extern|using|typedef)\b|template\s*<[^>]*>\s*(struct|class)\b|#|//|/\*|\})")


def sources():
    for component in COMPONENTS:
        for folder, _, names in os.walk(os.path.join(ROOT, component)):
            for name in sorted(names):
                if name.endswith(SOURCE_ENDINGS):
                    yield os.path.join(folder, name)


def functions(lines):
    """(first line, line count, signature) of each function defined at namespace scope: a line at
    column 0 that opens a signature, its body's `{` closing a signature line, its `}` at column 0."""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line and not line[0].isspace() and "(" in line and not NOT_A_FUNCTION.match(line) and "=" not in line.split("(")[0]:
            j = i
            while j < len(lines) and j < i + 8 and not lines[j].rstrip().endswith(("{", ";", "}")):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{") and not lines[j].rstrip().endswith("= {"):
                k = j + 1
                while k < len(lines) and not lines[k].startswith("}"):
                    k += 1
                yield i + 1, k - i + 1, line.strip()[:90]
                i = k + 1
                continue
        i += 1


def zero_part(path):
    rel = os.path.relpath(path, os.path.join(ROOT, "zero", "src"))
    return os.path.dirname(rel)


def main():
    breaches = []
    for path in sources():
        rel = os.path.relpath(path, ROOT)
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if len(lines) > MAX_FILE_LINES:
            breaches.append(f"{rel}: {len(lines)} lines (at most {MAX_FILE_LINES}: split it by job)")
        for first, count, signature in functions(lines):
            if count > MAX_FUNCTION_LINES:
                breaches.append(f"{rel}:{first}: a function of {count} lines (at most {MAX_FUNCTION_LINES}): {signature}")
        in_zero = rel.startswith(os.path.join("zero", "src") + os.sep)
        for n, line in enumerate(lines, 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m:
                continue
            included = m.group(1)
            if included.startswith("../") or "/../" in included:
                breaches.append(f'{rel}:{n}: #include "{included}" climbs a folder (name it from the src/ root)')
            if in_zero and not included.startswith("coshard/"):
                part = os.path.dirname(included)
                mine = zero_part(path)
                if not os.path.exists(os.path.join(ROOT, "zero", "src", included)):
                    continue  # another component's private header (modules/src/kernels)
                if part not in ZERO_PARTS:
                    breaches.append(f'{rel}:{n}: #include "{included}": zero/src/{part} is not one of the parts {ZERO_PARTS}')
                elif mine not in ZERO_PARTS:
                    breaches.append(f"{rel}: zero/src/{mine} is not one of the parts {ZERO_PARTS}")
                elif ZERO_PARTS.index(part) > ZERO_PARTS.index(mine):
                    breaches.append(f'{rel}:{n}: #include "{included}": zero/src/{mine or "(core)"} may not include '
                                    f'zero/src/{part}, a part above it')
    for b in breaches:
        print(b)
    print(f"check_layout: {len(breaches)} breach(es)")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
