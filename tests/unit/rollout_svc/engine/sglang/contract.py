"""Check an `ApiUse` table against sglang's source (read from its wheel with `ast`, never imported),
and find what the adapter modules actually use of sglang."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from rollout_svc.engine.sglang_api import ApiUse
from tests.support.sglang_site import cache_lock, pypi_reachable

CACHE_DIR = Path.home() / ".cache" / "weightsync" / "sglang"
# sglang 0.5.2x ships cp311 manylinux wheels only (compiled Rust extensions inside); ask pip for
# that exact tag so the download does not depend on the interpreter running the tests.
_PIP_TAGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--platform",
    "manylinux_2_34_x86_64",
]


class WheelUnavailable(Exception):
    """PyPI cannot be reached: the contract cannot be checked here (a skip, not a pass)."""


@cache_lock()  # another xdist worker may be downloading it right now
def fetch_wheel(version: str, cache_dir: Path = CACHE_DIR) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    have = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if have:
        return have[0]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-q",
        *_PIP_TAGS,
        "-d",
        str(cache_dir),
        f"sglang=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    have = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if proc.returncode == 0 and have:
        return have[0]
    if not pypi_reachable():
        raise WheelUnavailable(f"PyPI unreachable; cannot download sglang=={version} to check the adapter contract")
    raise RuntimeError(f"pip download sglang=={version} failed (PyPI is reachable):\n{proc.stderr[-2000:]}")


class SglangSource:
    """The Python source of one sglang wheel, parsed on demand."""

    def __init__(self, wheel: Path):
        self.wheel = wheel
        self._zip = zipfile.ZipFile(wheel)
        self._names = set(self._zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def path_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self._names:
                return cand
        return None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.path_of(module)
            self._trees[module] = ast.parse(self._zip.read(path), path) if path else None
        return self._trees[module]

    def files_under(self, module: str) -> list[str]:
        base = module.replace(".", "/")
        return sorted(n for n in self._names if n.endswith(".py") and (n == base + ".py" or n.startswith(base + "/")))

    def tree_of_file(self, path: str) -> ast.Module:
        return ast.parse(self._zip.read(path), path)

    # ---- class lookup with base classes (resolved through `from x import Y`) --------------
    def find_class(self, module: str, name: str, _depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        tree = self.module(module)
        if tree is None or _depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        src = _resolve_from(module, node, self.path_of(module) or "")
                        if src:
                            return self.find_class(src, alias.name, _depth + 1)
        return None

    def class_chain(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its (transitively resolvable) bases, nearest first."""
        out, todo, seen = [], [(module, name)], set()
        while todo:
            mod, nm = todo.pop(0)
            found = self.find_class(mod, nm)
            if not found or (found[0], nm) in seen:
                continue
            seen.add((found[0], nm))
            out.append(found)
            for b in found[1].bases:
                if isinstance(b, ast.Name):
                    todo.append((found[0], b.id))
        return out


def _resolve_from(module: str, node: ast.ImportFrom, path: str) -> str | None:
    if node.level == 0:
        return node.module
    pkg = module.split(".")
    if not path.endswith("__init__.py"):
        pkg = pkg[:-1]
    pkg = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(pkg + ([node.module] if node.module else []))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return names, a.kwarg is not None


def _class_fields(cls: ast.ClassDef) -> set[str]:
    out = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for n in cls.body:
        if isinstance(n, ast.FunctionDef) and n.name == "__init__":
            out |= _params(n)[0] - {"self"}
    return out


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def _set_literal(cls: ast.ClassDef, name: str):
    for n in cls.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return ast.literal_eval(n.value)
    return None


def _attribute_use_problems(where: str, cls: ast.ClassDef, name: str, allowed: set[str]) -> list[str]:
    """Every read of `self.<name>` in `cls`'s methods is `self.<name>.<one of allowed>`; assignments are free, and
    so is `__init__` (it makes the attribute, before anyone can replace it)."""
    parents = {id(c): n for n in ast.walk(cls) for c in ast.iter_child_nodes(n)}
    init = {id(n) for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__" for n in ast.walk(f)}
    problems, seen = [], 0
    for node in ast.walk(cls):
        if id(node) in init:
            continue
        if not (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name)):
            continue
        if node.value.id != "self" or isinstance(node.ctx, ast.Store):
            continue
        seen += 1
        parent = parents.get(id(node))
        if not (isinstance(parent, ast.Attribute) and parent.attr in allowed):
            problems.append(f"{where}: line {node.lineno} uses self.{name} other than as .{'/.'.join(sorted(allowed))}")
    return problems if seen else [f"{where}: {cls.name} never reads self.{name}"]


def check_use(src: SglangSource, key: str, use: ApiUse) -> list[str]:
    """Problems with one table entry in this sglang source; empty means it holds."""
    where = f"{key} ({use.kind} {use.module}{'.' + use.cls if use.cls else ''}{'.' + use.name if use.name else ''})"
    if use.kind == "literal":
        files = src.files_under(use.module)
        if not files:
            return [f"{where}: no module or package {use.module}"]
        consts: set[str] = set()
        for f in files:
            consts |= {
                n.value
                for n in ast.walk(src.tree_of_file(f))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
        return [f"{where}: string {p!r} occurs nowhere in {use.module}" for p in use.params if p not in consts]
    if src.module(use.module) is None:
        return [f"{where}: module {use.module} does not exist"]
    if use.kind == "function":
        fns = {n.name: n for n in src.module(use.module).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if use.name not in fns:
            return [f"{where}: no top-level function {use.name}"]
        names, kw = _params(fns[use.name])
        return [f"{where}: no parameter {p}" for p in use.params if p not in names and not kw]
    if use.kind == "server_args":
        have: set[str] = set()
        for _, cls in src.class_chain(use.module, use.cls):
            have |= _class_fields(cls)
        for f in src.files_under("sglang.srt.arg_groups.fields"):
            for n in src.tree_of_file(f).body:
                if isinstance(n, ast.ClassDef):
                    have |= _class_fields(n)
        if not have:
            return [f"{where}: found no ServerArgs fields"]
        return [f"{where}: ServerArgs has no field {p}" for p in use.params if p not in have]
    chain = src.class_chain(use.module, use.cls)
    if not chain:
        return [f"{where}: no class {use.cls} in {use.module}"]
    if use.kind == "class":
        return []
    if use.kind == "fields":
        have = set().union(*(_class_fields(c) for _, c in chain))
        return [f"{where}: {use.cls} has no field {p}" for p in use.params if p not in have]
    if use.kind == "attribute":
        if any(use.name in _self_attrs(c) for _, c in chain):
            return []
        return [f"{where}: {use.cls} never sets self.{use.name}"]
    if use.kind == "attribute_uses":
        return _attribute_use_problems(where, chain[0][1], use.name, set(use.params))
    if use.kind == "method":
        for _, c in chain:
            for n in c.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == use.name:
                    names, kw = _params(n)
                    return [
                        f"{where}: {use.cls}.{use.name} has no parameter {p}"
                        for p in use.params
                        if p not in names and not kw
                    ]
        return [f"{where}: {use.cls} (and its bases) has no method {use.name}"]
    if use.kind == "unpickle":
        cls = chain[0][1]
        exact = _set_literal(cls, "ALLOWED_GLOBALS") or set()
        prefixes = _set_literal(cls, "ALLOWED_MODULE_PREFIXES") or set()
        deny = _set_literal(cls, "DENY_CLASSES") or set()
        if not exact and not prefixes:
            return [f"{where}: {use.cls} has neither ALLOWED_GLOBALS nor ALLOWED_MODULE_PREFIXES"]
        bad = []
        for p in use.params:
            mod, name = p.split(":")
            ok = (mod, name) in exact or any((mod + ".").startswith(pre) for pre in prefixes)
            if not ok or (mod, name) in deny:
                bad.append(f"{where}: {mod}.{name} is not allowed by {use.cls}")
        return bad
    return [f"{where}: unknown kind {use.kind!r}"]


# ---- what the adapter uses ------------------------------------------------------------------
@dataclass
class Usage:
    imports: list[tuple[str, str, int]] = field(default_factory=list)  # (module, name, line)
    toplevel_imports: list[tuple[str, int]] = field(default_factory=list)  # sglang imported at import time
    members: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)  # ("Engine.x", kwargs, line)
    probes: list[tuple[str, int]] = field(default_factory=list)  # hasattr targets
    constructs: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)  # (imported name, kwargs, line)
    sampling_keys: list[tuple[str, int]] = field(default_factory=list)
    string_keys: list[tuple[str, int]] = field(default_factory=list)


def _chain(node: ast.AST) -> list[str] | None:
    """`self._sgl.a.b` -> ["a", "b"]; None if not rooted at self._sgl."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts and parts[-1] == "_sgl":
        return list(reversed(parts[:-1]))
    return None


def _member(chain: list[str]) -> str:
    """Which table entry an attribute chain below self._sgl is: loop.* is asyncio, not sglang."""
    if chain[0] == "tokenizer_manager" and len(chain) > 1:
        return f"TokenizerManager.{chain[1]}"
    return f"Engine.{chain[0]}"


def scan_adapter(source: str, filename: str = "<adapter>") -> Usage:
    tree = ast.parse(source, filename)
    u = Usage()
    top = set(map(id, tree.body))
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sglang":
                    u.imports.append((a.name, "", node.lineno))
                    if id(node) in top:
                        u.toplevel_imports.append((a.name, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang":
            for a in node.names:
                u.imports.append((node.module, a.name, node.lineno))
                imported[a.asname or a.name] = a.name
            if id(node) in top:
                u.toplevel_imports.append((node.module, node.lineno))
    sampling_fn_nodes: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "_sampling_params_dict":
            sampling_fn_nodes |= {id(n) for n in ast.walk(fn)}
    parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parent = parents.get(id(node))
            c = _chain(node)
            if c and not (isinstance(parent, ast.Attribute) and parent.value is node):
                u.members.append((_member(c), (), node.lineno))
        if not isinstance(node, ast.Call):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                u.string_keys.append((node.slice.value, node.lineno))
            elif isinstance(node, ast.Dict):
                u.string_keys += [
                    (k.value, node.lineno)
                    for k in node.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)
                ]
            continue
        kws = tuple(k.arg for k in node.keywords if k.arg)
        f = node.func
        target = None
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "_call"
            and isinstance(f.value, ast.Name)
            and f.value.id == "self"
        ):
            target = node.args[0] if node.args else None
        elif isinstance(f, ast.Attribute):
            target = f
        c = _chain(target) if target is not None else None
        if c:
            u.members.append((_member(c), kws, node.lineno))
        if isinstance(f, ast.Name) and f.id in imported:
            u.constructs.append((imported[f.id], kws, node.lineno))
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in imported:
            u.constructs.append((f"{imported[f.value.id]}.{f.attr}", kws, node.lineno))
        if (
            isinstance(f, ast.Name)
            and f.id == "hasattr"
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Constant)
        ):
            c = _chain(node.args[0])
            if c is not None:
                u.probes.append((_member(c + [node.args[1].value]), node.lineno))
        if id(node) in sampling_fn_nodes and (
            (isinstance(f, ast.Name) and f.id == "dict") or (isinstance(f, ast.Attribute) and f.attr == "update")
        ):
            u.sampling_keys += [(k, node.lineno) for k in kws]
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            u.string_keys.append((node.args[0].value, node.lineno))
    return u


def usage_problems(u: Usage, table: dict[str, ApiUse], imports: dict[tuple[str, str], str]) -> list[str]:
    """Everything the adapter uses that the table does not declare (or declares differently)."""
    bad = [
        f"line {ln}: sglang imported at module import time ({m}); import it inside the function"
        for m, ln in u.toplevel_imports
    ]
    for mod, name, ln in u.imports:
        if (mod, name) not in imports:
            bad.append(f"line {ln}: import {name or mod} from {mod} is not in SGLANG_IMPORTS")
    literals = set().union(*(set(t.params) for t in table.values() if t.kind == "literal"))
    for member, kws, ln in u.members:
        use = table.get(member)
        if use is None:
            bad.append(f"line {ln}: {member} is not in SGLANG_API_USED")
            continue
        bad += [f"line {ln}: {member}(..., {k}=) — keyword not declared" for k in kws if k not in use.params]
    for member, ln in u.probes:
        if member not in table:
            bad.append(f"line {ln}: hasattr probe {member} is not in SGLANG_API_USED")
    for name, kws, ln in u.constructs:
        key = imports.get(next(((m, n) for (m, n) in imports if n == name.split(".")[0]), ("", "")))
        use = table.get(key) if key else None
        if use is None:
            bad.append(f"line {ln}: call of {name} is not backed by SGLANG_API_USED")
            continue
        if key == "Engine":
            use = table["ServerArgs"]
        if "." in name and use.kind == "method" and name.split(".")[1] != use.name:
            bad.append(f"line {ln}: {name} is not the declared {use.cls}.{use.name}")
        bad += [f"line {ln}: {name}({k}=) — keyword not declared in {key}" for k in kws if k not in use.params]
    sp = set(table["SamplingParams"].params)
    bad += [
        f"line {ln}: sampling_params key {k!r} not in SamplingParams entry" for k, ln in u.sampling_keys if k not in sp
    ]
    bad += [
        f"line {ln}: string key {k!r} is not a declared sglang literal" for k, ln in u.string_keys if k not in literals
    ]
    return bad
