#!/usr/bin/env python3
"""Checks README.md and docs/*.md against the code, so that the docs cannot drift from it.

A doc may name only command-line options, configuration keys, environment variables, files and
headers that exist; docs/CLI.md must list every option of every `refit` subcommand, docs/CONFIG.md
every row of the configuration table (`refit info --keys --json`: each refit_cfg.nixl key with its
default, each backend init param, each environment variable), the table every REFIT_* variable the
product reads, README.md's YAML every key, docs/ARCHITECTURE.md every public header and every private header the
tools and the binding include. `refit plan` and `refit info` commands written in the docs are
run. Each problem is printed as FILE:LINE: what is wrong; the exit status is 1 when there is one.

Usage: check_docs.py --refit PATH/TO/refit [--docs DIR]   (DIR: where README.md and docs/ are)
       check_docs.py --refit PATH/TO/refit --self-test    (plants stale names; each must be caught)
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUBCOMMANDS = ["bench", "plan", "demo elastic", "chaos", "info"]
# Options of other programs that the docs show in their commands.
EXTERNAL_OPTIONS = {
    "pip": {"--no-deps", "--no-build-isolation"},
    "cmake": {"--install", "--prefix", "--build", "--preset", "--test-dir", "--target"},
    "ctest": {"--preset"},
    "ray start": {"--head", "--port", "--num-cpus", "--node-ip-address", "--object-store-memory",
                  "--resources", "--include-dashboard", "--system-config", "--address"},
    "googletest": {"--gtest_filter"},
    "google benchmark": {"--benchmark_filter"},
    "python": {"--version"},
}
PRODUCT_DIRS = ["src", "tools", "python/refit", "python/src"]
CODE_GLOBS = ["src/**/*", "tools/**/*", "python/**/*.py", "python/src/**/*", "scripts/**/*", "tests/**/*",
              "cmake/**/*", "fuzz/**/*", "bench/**/*", "CMakeLists.txt", "CMakePresets.json", "pyproject.toml",
              ".ci/*"]
PATH_ROOTS = r"(?:docs|scripts|include|src|tools|python|tests|data|fuzz|bench|cmake|\.ci)"


class Problems:
    def __init__(self):
        self.items = []

    def add(self, where, what):
        self.items.append(f"{where}: {what}")


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def code_files():
    seen = set()
    for pattern in CODE_GLOBS:
        for path in glob.glob(os.path.join(REPO, pattern), recursive=True):
            # Not this file: the names it plants in its self-test would count as defined.
            if os.path.isfile(path) and "/build/" not in path and path != os.path.abspath(__file__) and path not in seen:
                seen.add(path)
                yield path


def help_text(refit, subcommand):
    out = subprocess.run([refit, *subcommand.split(), "--help"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"check_docs: `refit {subcommand} --help` failed: {out.stderr}")
    return out.stdout


def help_options(text):
    return set(re.findall(r"^\s+(?:-\w,)?(--[a-z][\w-]*)", text, flags=re.M)) - {"--help"}


def config_table(refit):
    out = subprocess.run([refit, "info", "--keys", "--json"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"check_docs: `refit info --keys --json` failed: {out.stderr}")
    return json.loads(out.stdout)


def repo_defined_options():
    """Options the repository's own scripts and Python programs accept."""
    found = set()
    for path in code_files():
        if path.endswith((".sh", ".py")) or "/scripts/" in path:
            text = read(path)
            found.update(re.findall(r"""["'](--[a-z][\w-]*)["']""", text))  # argparse, comparisons
            found.update(re.findall(r"^\s*(--[a-z][\w-]*)[)|]", text, flags=re.M))  # bash case arms
            found.update(re.findall(r"\|(--[a-z][\w-]*)\)", text))
    return found


def env_reads():
    """REFIT_* environment variables the product reads."""
    names = set()
    for d in PRODUCT_DIRS:
        for path in glob.glob(os.path.join(REPO, d, "**", "*"), recursive=True):
            if os.path.isfile(path):
                text = read(path)
                names.update(re.findall(r"getenv\(\s*\"(REFIT_\w+)\"", text))
                names.update(re.findall(r"environ(?:\.get)?\s*[\[(]\s*[\"'](REFIT_\w+)", text))
                names.update(re.findall(r"os\.getenv\(\s*[\"'](REFIT_\w+)", text))
    return names


def docs_of(root):
    paths = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return {os.path.relpath(p, root): read(p) for p in paths}


def line_of(text, index):
    return text.count("\n", 0, index) + 1


def commands(text):
    """(line, command) for every shell command in fenced blocks (continuations joined) and every
    inline code span."""
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S):
        if m.group(1) not in ("", "sh", "bash", "console"):
            continue
        start = line_of(text, m.start(2))
        joined, first = "", None
        for k, line in enumerate(m.group(2).split("\n")):
            first = start + k if first is None else first
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            out.append((first, re.sub(r"(^|\s)#.*$", "", joined + line)))
            joined, first = "", None
    for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
        out.append((line_of(text, m.start()), m.group(1)))
    return out


class CodeFacts:
    """What the code has, read once: the docs of any tree (the self-test's planted copies too) are
    checked against it."""

    def __init__(self, refit):
        self.refit = refit
        self.help = {s: help_text(refit, s) for s in SUBCOMMANDS}
        self.options = {s: help_options(text) for s, text in self.help.items()}
        every_refit_option = set().union(*self.options.values()) | {"--version", "--help"}
        self.known_options = every_refit_option | repo_defined_options() | set().union(*EXTERNAL_OPTIONS.values())
        self.table = config_table(refit)
        self.defaults = {row["name"]: row["default"] for row in self.table if row["scope"] == "nixl"}
        self.env_named = set()  # REFIT_* anywhere in the code
        for path in code_files():
            self.env_named.update(re.findall(r"REFIT_\w+", read(path)))
        self.env_read = env_reads()
        # Named as they are included after refit/: "tensor.h", "ext/transport.h".
        self.public_headers = {os.path.relpath(p, os.path.join(REPO, "include", "refit"))
                               for p in glob.glob(os.path.join(REPO, "include", "refit", "*.h")) +
                               glob.glob(os.path.join(REPO, "include", "refit", "ext", "*.h"))}


def check(root, facts, run_commands=True):
    problems = Problems()
    docs = docs_of(root)
    options, known_options, defaults = facts.options, facts.known_options, facts.defaults
    env_known, public_headers, refit = facts.env_named, facts.public_headers, facts.refit

    for name, text in docs.items():
        # Options: each `refit <subcommand>` command uses only that subcommand's options ...
        runs = []
        for line, command in commands(text):
            for m in re.finditer(r"(?:^|[\s/(])refit (bench|plan|demo elastic|chaos|info)\b([^#;|&`]*)", command):
                sub, rest = m.group(1), m.group(2)
                for opt in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):
                    if opt not in options[sub]:
                        problems.add(f"{name}:{line}", f"option {opt} of `refit {sub}` does not exist "
                                                       f"(refit {sub} --help)")
                if sub in ("plan", "info") and "--cluster" not in rest and ".." not in rest and "PATH" not in rest:
                    runs.append((line, sub, rest))
        # ... and every option named anywhere exists somewhere.
        for m in re.finditer(r"(?<![\w/.=-])(--[a-z][\w-]*[\w])(?![\w*-])", text):
            opt = m.group(1)
            if opt not in known_options and not (opt.startswith("--no-") and "--" + opt[5:] in known_options):
                problems.add(f"{name}:{line_of(text, m.start())}", f"option {opt} exists in no refit "
                                                                   f"command, script or known tool")
        # Configuration keys.
        for m in re.finditer(r"refit_cfg\.nixl\.(\w+)", text):
            if m.group(1) not in defaults:
                problems.add(f"{name}:{line_of(text, m.start())}", f"configuration key refit_cfg.nixl.{m.group(1)} "
                                                                   f"does not exist")
        # Environment variables.
        for m in re.finditer(r"\bREFIT_\w+", text):
            if m.group(0) not in env_known:
                problems.add(f"{name}:{line_of(text, m.start())}", f"environment variable or build option "
                                                                   f"{m.group(0)} appears nowhere in the code")
        # Files named from the repository root, and relative links.
        for m in re.finditer(r"(?<![\w/.-])(" + PATH_ROOTS + r"/[\w./+<>-]*[\w+])", text):
            path = m.group(1)
            if "<" not in path and not os.path.exists(os.path.join(REPO, path)):  # <tag>: a placeholder
                problems.add(f"{name}:{line_of(text, m.start())}", f"file {path} does not exist")
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            target = m.group(1)
            if not re.match(r"\w+://", target) and not os.path.exists(os.path.join(root, os.path.dirname(name), target)):
                problems.add(f"{name}:{line_of(text, m.start())}", f"link target {target} does not exist")
        # Public headers.
        for m in re.finditer(r"(?:include/)?refit/((?:ext/)?\w+\.h)\b", text):
            if m.group(1) not in public_headers:
                problems.add(f"{name}:{line_of(text, m.start())}", f"header refit/{m.group(1)} does not exist")
        # The commands that are cheap to run (plans of the repository's models, info) run.
        for line, sub, rest in runs if run_commands else []:
            argv = [refit, *sub.split(), *rest.split()]
            out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                problems.add(f"{name}:{line}", f"`refit {sub}{rest}` failed ({out.returncode}): "
                                               f"{(out.stderr or out.stdout).strip().splitlines()[-1:]}")

    check_cli_tables(docs.get("docs/CLI.md", ""), options, facts.help, problems)
    check_config_docs(docs, facts.table, facts.env_read, problems)
    check_architecture(docs.get("docs/ARCHITECTURE.md", ""), public_headers, problems)
    return problems.items


def check_cli_tables(text, options, helps, problems):
    """docs/CLI.md: each subcommand's section lists exactly its options, and a value written as fields
    (`--kill ROLE:RANK:REFIT:STEP[:WHEN]`) the way --help writes it."""
    for sub in SUBCOMMANDS:
        m = re.search(r"^## `refit " + sub + r"`\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
        if not m:
            problems.add("docs/CLI.md", f"no section `## \\`refit {sub}\\``")
            continue
        listed = set()
        for row in re.findall(r"^\| (`--[^|]*)\|", m.group(1), flags=re.M):
            listed.update(re.findall(r"--[a-z][\w-]*", row))
        for opt in sorted(options[sub] - listed):
            problems.add("docs/CLI.md", f"`refit {sub}` has option {opt}, which its table does not list")
        for opt in sorted(listed - options[sub]):
            problems.add("docs/CLI.md", f"the table of `refit {sub}` lists {opt}, which it does not have")
        for opt, value in re.findall(r"^\| `(--[a-z][\w-]*) ([A-Z]+(?::[A-Z]+)+(?:\[:[A-Z]+\])*)`", m.group(1),
                                     flags=re.M):
            if value not in helps[sub]:
                problems.add("docs/CLI.md", f"the table of `refit {sub}` writes {opt} {value}, which its --help "
                                            f"does not")


def check_config_docs(docs, table, env_read, problems):
    config = docs.get("docs/CONFIG.md", "")
    defaults = {row["name"]: row["default"] for row in table if row["scope"] == "nixl"}
    rows = dict(re.findall(r"^\| `refit_cfg\.nixl\.(\w+)` \| [^|]+ \| `([^`]+)`", config, flags=re.M))
    for key in sorted(set(defaults) - set(rows)):
        problems.add("docs/CONFIG.md", f"the keys table omits refit_cfg.nixl.{key}")
    for key in sorted(set(rows) & set(defaults)):
        if rows[key] != defaults[key]:
            problems.add("docs/CONFIG.md", f"refit_cfg.nixl.{key}: the table says the default is {rows[key]}, "
                                           f"the parser's is {defaults[key]}")
    # Backend init params: each section's table lists its backends' params, and only those.
    params = [row for row in table if row["scope"] == "backend_init_params"]
    for m in re.finditer(r"^### `backend_init_params` for ([\w ]+)\n(.*?)(?=^##)", config, flags=re.M | re.S):
        backends = m.group(1).replace(" and ", " ").split()
        listed = set(re.findall(r"^\| `(\w+)` \|", m.group(2), flags=re.M))
        takes = {row["name"] for row in params if set(row["backends"].split()) & set(backends)}
        for name in sorted(listed - takes):
            problems.add("docs/CONFIG.md", f"backend_init_params for {m.group(1)} lists {name}, which the "
                                           f"configuration table does not give those backends")
        for name in sorted(takes - listed):
            if f"`{name}`" not in m.group(2):
                problems.add("docs/CONFIG.md", f"backend_init_params for {m.group(1)} omits {name}")
    python_doc = docs.get("docs/PYTHON.md", "")
    for row in params:
        if "NIXL" in row["backends"].split() and not re.search(rf"\b{row['name']}\b", python_doc):
            problems.add("docs/PYTHON.md", f"the NIXL backend's init param {row['name']} is not documented")
    # Environment variables: the doc's table is the configuration table's, which holds every one read.
    env_rows = {row["name"] for row in table if row["scope"] == "environment"}
    env = re.search(r"^## Environment\n(.*?)(?=^## |\Z)", config, flags=re.M | re.S)
    listed_env = set(re.findall(r"^\| `(\w+)`", env.group(1), flags=re.M)) if env else set()
    for var in sorted(env_rows ^ listed_env):
        problems.add("docs/CONFIG.md", f"the Environment table {'omits' if var in env_rows else 'lists'} {var}"
                                       f"{'' if var in env_rows else ', which the configuration table does not'}")
    for var in sorted(env_read - env_rows):
        problems.add("refit info --keys", f"refit reads {var}, which the configuration table does not list")
    readme = docs.get("README.md", "")
    yaml = re.search(r"^```yaml\n(.*?)^```", readme, flags=re.M | re.S)
    keys = set(re.findall(r"^ {4}(\w+):", yaml.group(1), flags=re.M)) if yaml else set()
    for key in sorted(set(defaults) ^ keys):
        problems.add("README.md", f"the configuration YAML {'omits' if key in defaults else 'has no such key'} {key}")


def check_architecture(text, public_headers, problems):
    table = re.search(r"^\| header \| what it holds \|\n(.*?)\n\n", text, flags=re.M | re.S)
    listed = set(re.findall(r"`((?:ext/)?\w+\.h)`", table.group(1))) if table else set()
    for h in sorted(public_headers ^ listed):
        problems.add("docs/ARCHITECTURE.md", f"the public header table {'omits' if h in public_headers else 'lists'} "
                                             f"{h}{'' if h in public_headers else ', which does not exist'}")
    private = set()
    for d in ("tools", "python/src"):
        for path in glob.glob(os.path.join(REPO, d, "*")):
            private.update(re.findall(r'#include "((?:core|memory|transport|engine|sync|planner)/\w+\.h)"', read(path)))
    para = re.search(r"^The tools and the Python binding build against the public headers(.*?)\n\n", text,
                     flags=re.M | re.S)
    if not para:
        problems.add("docs/ARCHITECTURE.md", "no paragraph says which headers the tools and the binding build against")
    named = set(re.findall(r"`((?:core|memory|transport|engine|sync|planner)/\w+\.h)`", para.group(1))) if para else set()
    for h in sorted(private ^ named):
        problems.add("docs/ARCHITECTURE.md", f"private header {h}: "
                                             f"{'included by the tools or the binding but not named' if h in private else 'named but included by neither'}")


def self_test(facts):
    """Plants one stale name of each kind in a copy of the docs; each must be reported, and the
    real docs must pass."""
    real = check(REPO, facts)
    if real:
        print("\n".join(real))
        return 1
    plants = [
        ("README.md", "scripts/bench.sh          #", "scripts/bench.sh --src-dpp 2  #", "--src-dpp"),
        ("docs/CLI.md", "| `--refits K` |", "| `--refitz K` |", "--refits"),
        ("docs/CLI.md", "| `--rendezvous HOST:PORT` |", "| `--rendezvous HOST:PORT[:TAG]` |", "HOST:PORT[:TAG]"),
        ("docs/CLI.md", "refit bench --sources 8", "refit bench --target-memory 1GiB --sources 8",
         "option --target-memory of `refit bench`"),
        ("docs/CLI.md", "--sources 256 --destinations 32", "--sources 255 --destinations 32", "--sources 255"),
        ("README.md", "## Configuration\n", "## Configuration\n\n`refit_cfg.nixl.bucket_size`\n", "bucket_size"),
        ("docs/CONFIG.md", "## Log lines\n", "## Log lines\n\n`REFIT_NO_SUCH_VARIABLE=1`\n", "REFIT_NO_SUCH_VARIABLE"),
        ("README.md", "docs/CLI.md (the", "docs/CLIs.md (the", "docs/CLIs.md"),
        ("docs/ARCHITECTURE.md", "| `version.h` |", "| `versions.h` |", "versions.h"),
        ("docs/ARCHITECTURE.md", "rather than call it.", "rather than call it (and `core/fail.h`).", "core/fail.h"),
        ("docs/ARCHITECTURE.md", "| `ext/box_copy.h` |", "| `ext/box_copies.h` |", "ext/box_copies.h"),
        ("docs/CONFIG.md", "| `refit_cfg.nixl.timeout_s` | number | `300`", "| `refit_cfg.nixl.timeout_s` | number | `30`",
         "timeout_s"),
        ("docs/CONFIG.md", "| `tls` |", "| `transports` |", "lists transports"),
        ("docs/CONFIG.md", "| `REFIT_RENDEZVOUS` |", "| `REFIT_RENDEZVOU` |", "omits REFIT_RENDEZVOUS"),
    ]
    failed = 0
    for doc, old, new, expect in plants:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(os.path.join(REPO, "README.md"), tmp)
            shutil.copytree(os.path.join(REPO, "docs"), os.path.join(tmp, "docs"))
            path = os.path.join(tmp, doc)
            text = read(path)
            if old not in text:
                print(f"self-test: cannot plant in {doc}: '{old}' is not there")
                failed += 1
                continue
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(old, new, 1))
            found = check(tmp, facts, run_commands=expect == "--sources 255")
            if not any(expect in p for p in found):
                print(f"self-test: a planted {expect!r} in {doc} was not reported (reported: {found})")
                failed += 1
            else:
                print(f"self-test: planted {expect!r} in {doc}: {next(p for p in found if expect in p)}")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--refit", required=True, help="the refit binary")
    parser.add_argument("--docs", default=REPO, help="where README.md and docs/ are (default: the repository)")
    parser.add_argument("--self-test", action="store_true", help="plant stale names and check they are caught")
    args = parser.parse_args()
    facts = CodeFacts(args.refit)
    if args.self_test:
        return self_test(facts)
    problems = check(args.docs, facts)
    print("\n".join(problems) if problems else "check_docs: README.md and docs/*.md match the code")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
