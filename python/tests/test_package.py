"""The installed package as its users see it: `from refit import *` exports exactly the names
docs/PYTHON.md documents, and the extension's types reach a type checker (its stub and the
py.typed marker are installed, and mypy --strict uses them)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import refit
from helpers import REPO

DOC = Path(REPO, "docs", "PYTHON.md").read_text(encoding="utf-8")
PACKAGE = Path(refit.__file__).parent


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from refit import *", namespace)
    namespace.pop("__builtins__")
    assert len(refit.__all__) == len(set(refit.__all__)), "a name listed twice"
    assert sorted(namespace) == sorted(refit.__all__)


def test_every_name_in_all_exists_and_none_is_a_module():
    missing = [n for n in refit.__all__ if not hasattr(refit, n)]
    modules = [n for n in refit.__all__ if isinstance(getattr(refit, n, None), types.ModuleType)]
    assert missing == [] and modules == []
    assert not any(n.startswith("_") for n in refit.__all__)


def test_all_is_what_docs_python_documents():
    # Every exported name is documented, and every top-level `refit.NAME` the page shows (not a
    # submodule such as refit.ray) is exported.
    undocumented = [n for n in refit.__all__ if not re.search(rf"(?<![\w.]){n}\b|\brefit\.{n}\b", DOC)]
    shown = set(re.findall(r"\brefit\.([A-Za-z]\w*)", DOC))
    submodules = {n for n in shown if (PACKAGE / f"{n}.py").exists()}
    assert undocumented == []
    assert sorted(shown - submodules - set(refit.__all__)) == []


def test_the_stub_declares_every_public_name_of_the_extension():
    # Generated from the built module at build time (nanobind's stubgen), installed beside it.
    assert (PACKAGE / "py.typed").is_file()
    stub = ast.parse((PACKAGE / "_refit.pyi").read_text(encoding="utf-8"))
    declared = {node.name for node in stub.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    declared |= {node.target.id for node in stub.body if isinstance(node, ast.AnnAssign)}
    public = {n for n in dir(refit._refit) if not n.startswith("_")}
    assert sorted(public - declared) == []
    # The error classes, with their bases and kind, as the runtime has them.
    classes = {node.name: node for node in stub.body if isinstance(node, ast.ClassDef)}
    assert [ast.unparse(b) for b in classes["ConfigError"].bases] == ["RefitError", "ValueError"]
    assert [ast.unparse(b) for b in classes["RefitError"].bases] == ["RuntimeError"]


USER_SCRIPT = '''\
import refit

config = refit.as_config({"timeout_s": 30, "bucket_bytes": 1 << 20})
size = refit.resolve_bucket_size(config, [refit.total_host_memory_bytes()])
line: str = refit.bucket_size_line(size, config)
inventory = refit.load_model_inventory("builtin:refit-tiny-moe")
shapes: list[tuple[int, ...]] = [t.shape for t in inventory.tensors]
gpus, why = refit.cuda_device_count()
layout = refit.Layout({}, ["lm_head."])
kind = ""
try:
    refit.parse_config("", ["refit_cfg.nixl.timeout_s=soon"])
except refit.ConfigError as e:
    kind = e.kind


def names(batches: refit.BatchIterator) -> list[str]:
    return [name for batch in batches for name, _ in batch]


print(line, len(shapes), gpus + 1, why.upper(), layout.fallback, kind)
'''


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory):
    pytest.importorskip("mypy")
    folder = tmp_path_factory.mktemp("mypy")

    def run(source: str) -> subprocess.CompletedProcess:
        (folder / "user.py").write_text(source)
        # In a folder of its own, so that mypy finds the installed refit (not python/refit).
        return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(folder / "cache"),
                               "user.py"], cwd=folder, capture_output=True, text=True, timeout=600)
    return run


def test_mypy_strict_accepts_a_correct_user_script(mypy_run, tmp_path):
    result = mypy_run(USER_SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    # The types it was checked against are the ones the package has.
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    run = subprocess.run([sys.executable, "user.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("[checkpoint engine] Bucket size: 1 MiB") and run.stdout.rstrip().endswith(" config")


def test_mypy_strict_names_a_type_error_in_a_call_to_the_extension(mypy_run):
    source = USER_SCRIPT + "swapped = refit.bucket_size_line(config, size)\n"
    result = mypy_run(source)
    line = len(source.splitlines())
    assert result.returncode == 1, result.stdout + result.stderr
    assert (f'user.py:{line}: error: Argument 1 to "bucket_size_line" has incompatible type "RefitConfig"; '
            f'expected "BucketSize"') in result.stdout, result.stdout
    assert result.stdout.count(": error:") == 2  # both arguments, nothing else


def test_version_is_the_extensions():
    assert refit.__version__ == refit._refit.__version__ and re.fullmatch(r"\d+\.\d+\.\d+", refit.__version__)
