#!/usr/bin/env python3
"""Every documented coshard-train command runs: README.md and docs/*.md (issue #60 item 2).

Which lines. In README.md and docs/*.md, every fenced block tagged sh, bash, shell or console, or
bare (no tag), is read as shell: `\\` continuations are joined, a `for ...; do ...; done` loop is
one line however many lines it spans, and in a block that has `$ ` prompts only the prompted lines
are commands (the rest is output). A line is a command line when it starts coshard-train: the
program's name (`coshard-train`, or a path ending in it such as build/release/trainer/coshard-train)
after environment assignments (`WORLD_SIZE=2 ...`), a launcher (`mpirun`/`mpiexec`/`srun` and their
options) or a timing wrapper (`time`, `/usr/bin/time -v`), alone or in a `for` loop. Every command
line either runs and exits 0, or carries the mark below. Other lines of a block (`cat`, `head`) are
not run; `NAME=value` lines alone set a variable for the lines after them (`$T`), as the shell would.

The mark: a line that cannot run here carries, in its trailing shell comment, the words
`docs-check: skip (REASON)`, e.g.

    mpirun -np 8 coshard-train --device cuda ...   # ranks as processes; docs-check: skip (needs GPUs)

A mark without a reason, or on a line that is not a command line, is a failure. A command line
with a placeholder (`...`, or a word in `[...]`) must be made runnable or be marked.

The rule: each command runs as written, made small, in a scratch folder of its block (the lines of
one block run in order in the same folder, so a line can read what the one before wrote:
`--adapter adapter/`, `--init tiny-llama`), under a timeout (120 s), OPENBLAS_NUM_THREADS=1:
- the program is the coshard-train built (TARGET_FILE); a timing wrapper is left out;
- `mpirun`/`mpiexec` is the mpiexec given, with `--oversubscribe --bind-to none` and
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader (the ranks
  and the rest of its options as written); without an mpiexec those lines are counted as not run;
- inputs that do not exist are made: `~/models/NAME` (any `~/models/` folder) is a Hugging Face
  Llama folder of the small shape below, written by coshard-train itself (`--export` of a
  2-step run with every parameter frozen); a `--data`/`--val-data` file (a quoted glob: two files
  matching it) is text (64 KiB of data/coshard_docs.txt) or, for a `.bin` name, 16384 uint16 token
  ids below 256; a `--config` file is a DeepSpeed config of `{"zero_optimization": {"stage": 3}}`;
- paths outside the repository move into the scratch folder: `/nvme/swap` (also in
  `nvme:/nvme/swap`) becomes SCRATCH/root/nvme/swap, `~/PATH` becomes WORK/home/PATH; relative
  outputs (`--export`, `--metrics`, `--checkpoint-dir`, `--export-adapter`) land in the scratch
  folder anyway;
- shrinking (coshard-train refuses a flag given twice, so a value is replaced, not appended):
  `--steps` at most 2, `--seq` at most 32, `--sample-tokens` at most 8 (each at that value when
  absent, and `--batch` at max(4, ranks)); `--warmup` at most 1 and `--decay-steps` at most 2 (a
  schedule that fits in 2 steps); `--layers` 2, `--dim` 64, `--heads` 8, `--kv-heads` 4 (then a
  divisor of the heads), `--head-dim` 8, `--intermediate` 128, `--vocab` 256 at most, and a
  `--preset` other than llama-tiny gets each of these shape flags it lacks at that value (not with
  `--init`: its folder sets the shape); `--sample-every`, `--eval-every`, `--checkpoint-every` at
  most 1 (so each happens), `--eval-batches` at most 2. `--world-size`, `-np`, `--tensor-parallel`,
  `--shard-group-size`, `--zero-stage`, offload and the rest stay as written. A `--help` line runs
  as it is.

Usage: run_doc_commands.py --root REPO --coshard-train BIN [--mpiexec MPIEXEC] [--work DIR]
       [--timeout SECONDS] [--dry-run]
Prints each command line (ok, marked, FAIL with the doc, line, command as run and its output's
tail), then `N command lines run, M marked (reasons: ...)`; exits 1 on any failure.
"""
import argparse
import json
import math
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

SHELL_TAGS = {"", "sh", "bash", "shell", "console", "zsh"}
MARK = re.compile(r"#.*\bdocs-check:\s*skip\b\s*(?:\((?P<reason>[^)]*)\))?")
PROGRAM = "coshard-train"
LAUNCHERS = {"mpirun", "mpiexec", "srun"}
TIMERS = {"time", "/usr/bin/time"}
SEPARATORS = {";", "&", "&&", "||", "|", ";;"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")

# The small shape: the most each shape flag may be, and what a large preset gets.
SHAPE = {"--layers": 2, "--dim": 64, "--heads": 8, "--kv-heads": 4, "--head-dim": 8,
         "--intermediate": 128, "--vocab": 256}
CAPS = dict(SHAPE, **{"--steps": 2, "--seq": 32, "--sample-tokens": 8, "--eval-batches": 2, "--warmup": 1,
                      "--decay-steps": 2})
ADDED = ("--steps", "--seq", "--sample-tokens")  # given their cap when absent (and --batch)
EVERY = ("--sample-every", "--eval-every", "--checkpoint-every")
SMALL_PRESETS = {"llama-tiny"}
TOKENS = 16384
TEXT_BYTES = 64 * 1024
MPI_ENVIRONMENT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "OMPI_MCA_btl": "self,vader"}


class Failure(Exception):
    pass


# ---- finding the command lines ------------------------------------------------------------------

def fenced_blocks(text):
    """(tag, [(line number, line)]) for each fenced block of a markdown text."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(```+)\s*([^\s`]*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, tag = opening.group(2), opening.group(3).lower()
        body = []
        i += 1
        while i < len(lines) and not re.match(r"^\s*" + fence + r"\s*$", lines[i]):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        yield tag, body


def logical_lines(body):
    """(first line number, text) for each shell line of a block: continuations and loops joined."""
    prompted = any(re.match(r"\s*\$ ", line) for _, line in body)
    out = []
    i = 0
    while i < len(body):
        number, line = body[i]
        i += 1
        if prompted:
            m = re.match(r"\s*\$ (.*)", line)
            if not m:
                continue
            line = m.group(1)
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        while text.endswith("\\") and i < len(body):
            text = text[:-1] + " " + body[i][1].strip()
            i += 1
        if re.match(r"(for|while|until)\s", text):
            while not re.search(r"(^|[;\s])done(\s|;|$|\s*#)", strip_comment(text)) and i < len(body):
                nxt = body[i][1].strip()
                i += 1
                while nxt.endswith("\\") and i < len(body):
                    nxt = nxt[:-1] + " " + body[i][1].strip()
                    i += 1
                if nxt and not nxt.startswith("#"):
                    text += " ; " + nxt
        out.append((number, text))
    return out


def strip_comment(text):
    try:
        return " ".join(words(text))
    except ValueError:
        return text


def words(text):
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    return list(lexer)


def parse(tokens):
    """A shell list: [('cmd', words) | ('for', var, values, body)], separators dropped."""
    items = []
    i = 0
    current = []

    def close():
        nonlocal current
        if current:
            items.append(("cmd", current))
        current = []

    while i < len(tokens):
        t = tokens[i]
        if t in SEPARATORS:
            close()
            i += 1
        elif t == "for" and not current:
            if i + 2 >= len(tokens) or tokens[i + 2] != "in":
                raise Failure("a for loop that is not `for NAME in WORDS; do ...; done`")
            var = tokens[i + 1]
            j = i + 3
            values = []
            while j < len(tokens) and tokens[j] not in SEPARATORS and tokens[j] != "do":
                values.append(tokens[j])
                j += 1
            while j < len(tokens) and tokens[j] in SEPARATORS:
                j += 1
            if j >= len(tokens) or tokens[j] != "do":
                raise Failure("a for loop without `do`")
            depth, k = 1, j + 1
            while k < len(tokens):
                if tokens[k] in ("for", "while", "until") and (k == j + 1 or tokens[k - 1] in SEPARATORS or tokens[k - 1] == "do"):
                    depth += 1
                elif tokens[k] == "done" and (tokens[k - 1] in SEPARATORS or tokens[k - 1] == "do"):
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            if k >= len(tokens):
                raise Failure("a for loop without `done`")
            items.append(("for", var, values, parse(tokens[j + 1:k])))
            i = k + 1
        else:
            current.append(t)
            i += 1
    close()
    return items


def split_command(cmd):
    """(environment, launcher words, timer words, program, arguments), or None for another program."""
    i = 0
    env = {}
    while i < len(cmd) and ASSIGNMENT.match(cmd[i]):
        name, value = cmd[i].split("=", 1)
        env[name] = value
        i += 1
    launcher, timer = [], []
    if i < len(cmd) and os.path.basename(cmd[i]) in LAUNCHERS:
        start = i
        while i < len(cmd) and os.path.basename(cmd[i]) != PROGRAM:
            i += 1
        launcher = cmd[start:i]
    elif i < len(cmd) and cmd[i] in TIMERS:
        start = i
        i += 1
        while i < len(cmd) and cmd[i].startswith("-"):
            i += 1
        timer = cmd[start:i]
    if i >= len(cmd) or os.path.basename(cmd[i]) != PROGRAM:
        return None
    return env, launcher, timer, cmd[i], cmd[i + 1:]


def runs_coshard(items):
    for item in items:
        if item[0] == "cmd" and split_command(item[1]) is not None:
            return True
        if item[0] == "for" and runs_coshard(item[3]):
            return True
    return False


def expand(items, variables):
    """The simple commands in order, `$NAME` and `${NAME}` substituted; assignments update variables."""
    for item in items:
        if item[0] == "for":
            _, var, values, body = item
            for value in [w for v in values for w in substitute(v, variables)]:
                yield from expand(body, dict(variables, **{var: value}))
            continue
        cmd = [w for word in item[1] for w in substitute(word, variables)]
        if cmd and all(ASSIGNMENT.match(w) for w in cmd):
            for w in cmd:
                name, value = w.split("=", 1)
                variables[name] = value
            continue
        yield cmd


def substitute(word, variables):
    whole = re.fullmatch(r"\$(\w+)|\$\{(\w+)\}", word)
    if whole:  # unquoted in the docs: split into words as the shell does
        return variables.get(whole.group(1) or whole.group(2), "").split()
    return [re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: variables.get(m.group(1) or m.group(2), ""), word)]


# ---- the rule -----------------------------------------------------------------------------------

class Fixtures:
    def __init__(self, root, work, binary):
        self.root, self.work, self.binary = root, work, binary

    def text(self, path):
        source = self.root / "data" / "coshard_docs.txt"
        if not source.is_file():
            source = self.root / "README.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(source.read_bytes()[:TEXT_BYTES])

    def tokens(self, path):
        rng = random.Random(path.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(rng.randrange(SHAPE["--vocab"]).to_bytes(2, "little") for _ in range(TOKENS)))

    def data(self, path):
        (self.tokens if path.suffix == ".bin" else self.text)(path)

    def llama_folder(self, path):
        args = [self.binary, "--model", "llama"]
        for flag in ("--layers", "--dim", "--heads", "--kv-heads", "--intermediate", "--vocab"):
            args += [flag, str(SHAPE[flag])]
        args += ["--seq", str(CAPS["--seq"]), "--batch", "4", "--world-size", "1", "--steps", "2",
                 "--freeze", "*", "--export", str(path), "--quiet"]
        path.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120, env=run_environment())
        if done.returncode != 0 or not (path / "config.json").is_file():
            raise Failure(f"making the fixture {path} failed: {shlex.join(args)}\n{done.stdout}")


def run_environment(extra=None):
    env = dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def value_of(args, flag):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def set_value(args, flag, value):
    """Replace FLAG's value where given (--flag V or --flag=V), else append it."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            args[i + 1] = str(value)
            return
        if a.startswith(flag + "="):
            args[i] = f"{flag}={value}"
            return
    args += [flag, str(value)]


def as_int(flag, value):
    try:
        return int(value)
    except ValueError:
        raise Failure(f"{flag} {value}: not a whole number, cannot shrink it")


def shrink(args, ranks):
    """The documented arguments made small (the rule in the docstring)."""
    args = list(args)
    if "--help" in args or "-h" in args:
        return args
    preset = value_of(args, "--preset")
    if preset is not None and preset not in SMALL_PRESETS and value_of(args, "--init") is None:
        for flag, small in SHAPE.items():
            if value_of(args, flag) is None:
                args += [flag, str(small)]
    for flag, most in CAPS.items():
        given = value_of(args, flag)
        if given is not None:
            set_value(args, flag, min(as_int(flag, given), most))
    heads, kv = value_of(args, "--heads"), value_of(args, "--kv-heads")
    if heads is not None and kv is not None and int(heads) % int(kv):
        set_value(args, "--kv-heads", math.gcd(int(heads), int(kv)))
    for flag in EVERY:
        given = value_of(args, flag)
        if given is not None and as_int(flag, given) > 1:
            set_value(args, flag, 1)
    for flag in ADDED:
        if value_of(args, flag) is None:
            args += [flag, str(CAPS[flag])]
    most = max(4, ranks)
    batch = value_of(args, "--batch")
    set_value(args, "--batch", most if batch is None else min(as_int("--batch", batch), most))
    return args


def outside_paths(args, root, scratch, work):
    """Paths outside the repository moved under the work folders; ~/models/NAME made on demand."""
    out = []
    for a in args:
        prefix = ""
        m = re.match(r"(nvme:)(/.*)", a)
        if m:
            prefix, a = m.group(1), m.group(2)
        if a.startswith("~/"):
            a = str(work / "home" / a[2:])
        elif a.startswith("/") and not pathlib.Path(a).resolve().is_relative_to(root):
            a = str(scratch / "root" / a.lstrip("/"))
        out.append(prefix + a)
    return out


def make_inputs(args, scratch, work, fixtures):
    i = 0
    while i < len(args):
        flag = args[i]
        values = []
        j = i + 1
        while j < len(args) and not args[j].startswith("-"):
            values.append(args[j])
            j += 1
        for v in values:
            path = pathlib.Path(v) if os.path.isabs(v) else scratch / v
            if flag in ("--data", "--val-data"):
                if any(ch in v for ch in "*?["):
                    if not list(path.parent.glob(path.name)):
                        for n in range(2):
                            fixtures.data(path.parent / re.sub(r"[*?]|\[[^]]*\]", f"{n:06d}", path.name, count=1).replace("*", ""))
                elif not path.exists():
                    fixtures.data(path)
            elif flag == "--config" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"zero_optimization": {"stage": 3}}) + "\n")
            elif flag == "--init" and not path.exists() and path.is_relative_to(work / "home" / "models"):
                fixtures.llama_folder(path)
        i = j if j > i + 1 else i + 1


def command_as_run(cmd, root, scratch, work, binary, mpiexec):
    """(argv, environment) of one documented simple command under the rule."""
    env, launcher, _timer, _program, args = split_command(cmd)
    ranks = 2
    if value_of(args, "--world-size") is not None:
        ranks = as_int("--world-size", value_of(args, "--world-size"))
    prefix = []
    extra = dict(env)
    if launcher:
        name = os.path.basename(launcher[0])
        if name in ("mpirun", "mpiexec"):
            if mpiexec is None:
                return None, None
            np = value_of(launcher, "-np") or value_of(launcher, "-n")
            if np is not None:
                ranks = as_int("-np", np)
            prefix = [mpiexec, "--oversubscribe", "--bind-to", "none"] + launcher[1:]
            extra.update(MPI_ENVIRONMENT)
        else:
            prefix = list(launcher)  # srun: runs only where Slurm is; such a line is marked
    args = shrink(outside_paths(args, root, scratch, work), ranks)
    return prefix + [str(binary)] + args, extra


# ---- running ------------------------------------------------------------------------------------

def run(argv, cwd, env, timeout):
    started = time.monotonic()
    try:
        process = subprocess.Popen(argv, cwd=cwd, env=run_environment(env), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return 127, f"{argv[0]}: {e}", 0.0
    try:
        output, _ = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n(killed after the {timeout} s timeout)".encode()
        code = 124
    return code, output.decode(errors="replace"), time.monotonic() - started


def tail(text, lines=30):
    return "\n".join("    " + l for l in text.rstrip().split("\n")[-lines:])


def shown(argv, binary, work):
    return shlex.join(argv).replace(str(binary), PROGRAM).replace(str(work), "$WORK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, type=pathlib.Path)
    parser.add_argument("--coshard-train", required=True, type=pathlib.Path)
    parser.add_argument("--mpiexec")
    parser.add_argument("--work", type=pathlib.Path, help="scratch folders (emptied first; default: a temporary one, removed after)")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--dry-run", action="store_true", help="print the commands as they would run, run nothing")
    a = parser.parse_args()
    root = a.root.resolve()
    binary = a.coshard_train.resolve()
    if not a.dry_run and not os.access(binary, os.X_OK):
        sys.exit(f"run_doc_commands: {binary}: not an executable")
    temporary = a.work is None
    work = (pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"coshard_doc_commands_{os.getpid()}") if temporary else a.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fixtures = Fixtures(root, work, binary)

    failures, ran, runs, marked, not_run = [], 0, 0, [], []
    started = time.monotonic()
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    for doc in docs:
        name = doc.relative_to(root)
        for tag, body in fenced_blocks(doc.read_text()):
            if tag not in SHELL_TAGS:
                continue
            scratch = work / re.sub(r"[^\w.]+", "_", f"{name}_{body[0][0] if body else 0}")
            variables = {}
            for number, text in logical_lines(body):
                where = f"{name}:{number}"
                mark = MARK.search(text)
                try:
                    items = parse(words(text))
                except (ValueError, Failure) as e:
                    if mark or split_command(text.split()) is not None:
                        failures.append(f"{where}: cannot read `{text}` as a shell command: {e}")
                    continue
                if not runs_coshard(items):
                    if mark:
                        failures.append(f"{where}: a docs-check mark on a line that runs no {PROGRAM}")
                    # A variable set here reaches the lines after it.
                    for cmd in expand(items, variables):
                        pass
                    continue
                if mark:
                    reason = (mark.group("reason") or "").strip()
                    if not reason:
                        failures.append(f"{where}: a docs-check mark without a reason: `docs-check: skip (REASON)`")
                    else:
                        marked.append(reason)
                        print(f"marked {where}: {reason}")
                    continue
                placeholder = [w for w in words(text) if w == "..." or w.startswith("[") or w.endswith("]")]
                if placeholder:
                    failures.append(f"{where}: a placeholder ({' '.join(placeholder)}) in `{text}`: make the line "
                                    f"runnable, or mark it `# docs-check: skip (REASON)`")
                    continue
                try:
                    commands = [c for c in expand(items, variables) if split_command(c) is not None]
                    scratch.mkdir(parents=True, exist_ok=True)
                    line_ok, line_runs, seconds, skipped = True, 0, 0.0, False
                    for cmd in commands:
                        argv, env = command_as_run(cmd, root, scratch, work, binary, a.mpiexec)
                        if argv is None:
                            skipped = True
                            continue
                        if a.dry_run:
                            print(f"would run {where}: {shown(argv, binary, work)}")
                            continue
                        make_inputs(argv, scratch, work, fixtures)
                        code, output, took = run(argv, scratch, env, a.timeout)
                        line_runs += 1
                        seconds += took
                        if code != 0:
                            line_ok = False
                            failures.append(f"{where}: exit {code} after {took:.1f} s\n  documented: {text}\n"
                                            f"  as run (in {scratch}): {shlex.join(argv)}\n  output (tail):\n{tail(output)}")
                            break
                except Failure as e:
                    failures.append(f"{where}: {e}\n  documented: {text}")
                    continue
                if skipped and not line_runs:
                    not_run.append(where)
                    print(f"not run {where}: no mpiexec in this build")
                    continue
                if a.dry_run:
                    ran += 1
                    continue
                runs += line_runs
                if line_ok:
                    ran += 1
                    print(f"ok {where} ({line_runs} run{'s' if line_runs != 1 else ''}, {seconds:.1f} s)")
                else:
                    print(f"FAIL {where}")
    if ran + len(marked) + len(not_run) == 0:
        failures.append(f"no {PROGRAM} command line found in README.md and docs/*.md: the search is broken")
    for f in failures:
        print(f"\n{f}")
    reasons = {}
    for r in marked:
        reasons[r] = reasons.get(r, 0) + 1
    listed = "; ".join(f"{r}" + (f" x{n}" if n > 1 else "") for r, n in sorted(reasons.items()))
    summary = f"{ran} command lines run ({runs} runs, {time.monotonic() - started:.1f} s), {len(marked)} marked" + \
              (f" (reasons: {listed})" if listed else "")
    if not_run:
        summary += f", {len(not_run)} not run (no mpiexec: {', '.join(not_run)})"
    print(f"\nrun_doc_commands: {summary}")
    if failures:
        print(f"run_doc_commands: {len(failures)} failure(s); the scratch folders are kept in {work}")
    elif temporary:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
