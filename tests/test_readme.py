"""The README's Python examples run as written.

Every ```python block of README.md is a complete program (imports included). On any machine each block must
compile and name nothing it does not define or import; on a GPU (``-m gpu``) each runs in a fresh Python process
from the repository root and must exit cleanly. Blocks that import torch or jax are skipped, with the reason, where
PyTorch has no CUDA or JAX has no GPU backend.

    python -m pytest -q -m gpu tests/test_readme.py      # on a GPU machine
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

_FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks() -> list[tuple[str, str]]:
    """(label, source) of every ```python block, labelled by its place and the bold heading before it."""
    text = README.read_text()
    blocks = []
    for i, match in enumerate(_FENCE.finditer(text)):
        before = text[: match.start()]
        headings = re.findall(r"^\*\*([^*]+)\*\*", before, re.MULTILINE)
        words = re.sub(r"[^a-z0-9]+", "-", (headings[-1] if headings else "top").lower()).strip("-")
        blocks.append((f"{i}-{'-'.join(words.split('-')[:3])}", match.group(1)))
    return blocks


BLOCKS = readme_blocks()


def imported_modules(source: str) -> set[str]:
    """Top-level package names a block imports."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def undefined_names(source: str) -> set[str]:
    """Names a block reads but never binds (assignment, import, def, argument, loop or comprehension target) and
    that are not builtins: what a reader copying the block alone would find missing. Scopes are not told apart,
    which is enough for examples."""
    tree = ast.parse(source)
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound


def test_readme_has_the_examples():
    sources = [source for _, source in BLOCKS]
    assert len(sources) >= 7, f"README.md has {len(sources)} python blocks"
    everything = "\n".join(sources)
    for needed in ("fa2cupy.torch", "fa2cupy.jax", "flash_attn_with_kvcache", "flash_attn_varlen_func",
                   "merge_attention_states", "import numpy", "import cupy", "jax.grad", "jax.jit", ".backward()"):
        assert needed in everything, f"no README example shows {needed}"


@pytest.mark.parametrize("label,source", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_block_compiles_and_defines_what_it_uses(label, source):
    compile(source, f"README.md[{label}]", "exec")
    assert not undefined_names(source), f"README.md[{label}] uses names it never defines or imports"
    assert {"fa2cupy"} & imported_modules(source), f"README.md[{label}] does not import fa2cupy"


def fa2cupy_calls(source: str) -> list[tuple[str, ast.Call]]:
    """(dotted target, call) of every call in a block whose callee is a name imported from fa2cupy
    (``from fa2cupy.torch import flash_attn_func``) or an attribute of an imported fa2cupy module
    (``fa2cupy.flash_attn_with_kvcache``)."""
    tree = ast.parse(source)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fa2cupy":
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "fa2cupy"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fa2cupy":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def dotted(node):
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return base and f"{base}.{node.attr}"
        return None

    return [(target, node) for node in ast.walk(tree) if isinstance(node, ast.Call)
            for target in [dotted(node.func)] if target]


def _resolve(target: str):
    """The object a dotted fa2cupy name names (importing its module), or skip when the module cannot import here."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if module_name.startswith(exc.name or "\0"):
                continue  # not a module: an attribute further up
            pytest.skip(f"{module_name} needs {exc.name}")
        except ImportError as exc:
            pytest.skip(f"{module_name} cannot be imported here: {exc}")
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"cannot resolve {target}")


@pytest.mark.parametrize("label,source", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_block_calls_match_the_signatures(label, source):
    calls = fa2cupy_calls(source)
    # (a block of an integration calls fa2cupy through the library it registers with)
    assert calls or "fa2cupy.integrations." in source, f"README.md[{label}] calls nothing from fa2cupy"
    for target, call in calls:
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue
        function = _resolve(target)
        try:
            inspect.signature(function).bind(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as exc:
            raise AssertionError(f"README.md[{label}]: {target}(...) does not match its signature: {exc}") from exc


def _probe(code: str) -> str | None:
    """None if ``code`` runs in a fresh interpreter, else the last line of its error output."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=_child_env(), timeout=300)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


@functools.lru_cache(maxsize=None)
def missing(module: str) -> str | None:
    """Why a block importing ``module`` cannot run here, or None."""
    if module == "torch":
        why = _probe("import torch; assert torch.cuda.is_available(), 'PyTorch has no CUDA'")
        return None if why is None else f"needs PyTorch with CUDA: {why}"
    if module == "transformers":
        why = _probe("import transformers")
        return None if why is None else f"needs transformers: {why}"
    if module == "jax":
        why = _probe("import jax, jax.experimental.buffer_callback; assert jax.devices('gpu')")
        return None if why is None else f"needs JAX with a GPU backend: {why}"
    return None


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy's pool on one GPU
    return env


@pytest.mark.gpu
@pytest.mark.parametrize("label,source", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_block_runs_on_the_gpu(label, source):
    for module in sorted(imported_modules(source) & {"torch", "jax"}):
        why = missing(module)
        if why:
            pytest.skip(why)
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, cwd=ROOT,
                          env=_child_env(), timeout=600)
    assert done.returncode == 0, f"README.md[{label}] failed:\n{done.stdout}\n{done.stderr}"
