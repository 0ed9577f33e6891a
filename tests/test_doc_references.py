"""Every module the docs name exists: README.md, docs/*.md and the docstrings and comments of batchrun/ are read for
references to code (paths `batchrun/x/y.py`, `x/y.py`, `csrc/NAME.c`; dotted `batchrun.x.y.Name`; `module.py: name`;
`module.name`, `Class.name`), and each must resolve to a file or to a name the module defines (read with `ast`, never
imported). Forms that could be prose or a job-file key (`engine.max_num_seqs`) are left alone. No model: seconds."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

from batchrun.config import SCHEMA

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
SOURCES = sorted((REPO / "batchrun").rglob("*.py"))
CODE_ROOTS = ("batchrun", "benchmarks", "tests")

JOB_SECTIONS = {*SCHEMA, "sampling"}  # `engine.max_num_seqs` is a job-file key, not a module
NOT_MODULES = {"self", "cls"}
# Other systems' names that start like a batchrun module's: cgroup files, OpenAI's objects, transformers' config.
NOT_CODE = {"cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us", "memory.max", "chat.completion", "errors.data",
            "config.model_type", "llama.cpp"}
# Modules the restructure renamed: a `name.attr` under the old name is stale even where no file is named.
FORMER = {"cpu_linear": "batchrun/model/layers/linear.py", "quant_linear": "batchrun/model/quant/linear.py",
          "kv_quant": "batchrun/kernels/layouts/kv_rows.py", "sinks": "batchrun/output/{folder,sink,parquet}.py",
          "sampling_batch": "batchrun/model/sampling/batch.py", "gpu_check": "benchmarks/gpu/check.py"}
# Files of older revisions named on purpose (`benchmarks.micro.kernels --baseline REF` still builds them).
PAST_FILES = {"cpu_kernels.c"}
EXTENSIONS = {"py", "c", "h", "cpp", "md", "txt", "json", "jsonl", "yaml", "yml", "toml", "cfg", "ini", "png", "csv",
              "parquet", "gguf", "so", "log", "lock", "tmp", "whl", "html", "sh", "safetensors", "bin", "pt"}

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
URL = re.compile(r"\w+://\S+")
BRACES = re.compile(r"([\w./-]*)\{([\w,]+)\}([\w./-]*)")
PATH = re.compile(r"(?<![\w./$*{-])((?:[\w.-]+/)*[\w-]+\.(?:py|c|h))(?![\w/-])")
PATH_NAME = re.compile(r"(?<![\w./$*{-])((?:[\w.-]+/)*[\w-]+\.(?:py|c|h)):\s+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
PATH_TEST = re.compile(r"(?<![\w./$*{-])((?:[\w.-]+/)*[\w-]+\.py)::(\w+)")
DOTTED = re.compile(r"(?<![\w./-])((?:batchrun|benchmarks)(?:\.[A-Za-z_]\w*)+)")
TEST = re.compile(r"test_\w+")
CHAIN = re.compile(r"(?<![\w./$-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-])")


# ---- what exists -------------------------------------------------------------------------------------------------

@functools.cache
def files() -> tuple[str, ...]:
    """Every file of the repository (relative, '/'-separated), hidden folders and caches left out."""
    found = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if any(part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file():
            found.append(rel.as_posix())
    return tuple(found)


@functools.cache
def modules() -> dict[str, str]:
    """Dotted module name -> file, for the packages batchrun, benchmarks and tests."""
    found = {}
    for rel in files():
        if rel.endswith(".py") and rel.split("/")[0] in CODE_ROOTS:
            parts = rel[:-3].split("/")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = rel
    return found


@functools.cache
def aliases() -> dict[str, str]:
    """Names the code imports a batchrun module under (`from batchrun.kernels import cpu as cpu_kernels`)."""
    found = {}
    for dotted, rel in modules().items():
        if not dotted.startswith(("batchrun", "benchmarks")):
            continue
        for node in ast.walk(ast.parse((REPO / rel).read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [(a.asname, f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [(a.asname, a.name) for a in node.names]
            else:
                continue
            found.update({alias: target for alias, target in targets if alias and target in modules()})
    return found


def _class_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for stmt in node.body:
        names |= _bound(stmt)
    for sub in ast.walk(node):  # self.x = ... in its methods
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) \
                and sub.value.id == "self":
            names.add(sub.attr)
    return names


def _bound(stmt: ast.stmt) -> set[str]:
    """Names a statement binds in its own scope."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in stmt.names}
    targets = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    names = set()
    for target in targets:
        names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    if isinstance(stmt, (ast.If, ast.Try, ast.With)):  # TYPE_CHECKING imports, optional imports
        for block in (stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", []),
                      *[h.body for h in getattr(stmt, "handlers", [])]):
            for sub in block:
                names |= _bound(sub)
    return names


@functools.cache
def module_info(rel: str) -> tuple[set[str], dict[str, set[str]], dict[str, list[str]]]:
    """(top-level and class-level names, {class: its names}, {class: its bases' names}) of one .py file."""
    tree = ast.parse((REPO / rel).read_text(encoding="utf-8"))
    names: set[str] = set()
    classes: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for stmt in tree.body:
        names |= _bound(stmt)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            own = _class_names(node)
            classes.setdefault(node.name, set()).update(own)
            bases.setdefault(node.name, []).extend(
                b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute)))
            names |= own
    if rel.endswith("__init__.py"):  # a package's submodules
        prefix = rel[: -len("__init__.py")]
        names |= {f[len(prefix):].split("/")[0].removesuffix(".py") for f in files() if f.startswith(prefix)}
    return names, classes, bases


@functools.cache
def classes_by_name() -> dict[str, list[str]]:
    """Class name -> the batchrun files that define it."""
    found: dict[str, list[str]] = {}
    for dotted, rel in modules().items():
        if dotted.startswith("batchrun"):
            for name in module_info(rel)[1]:
                found.setdefault(name, []).append(rel)
    return found


def class_has(cls: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a batchrun class named `cls`, or one of its batchrun bases, defines `attr`."""
    for rel in classes_by_name().get(cls, []):
        _, classes, bases = module_info(rel)
        if attr in classes[cls]:
            return True
        if any(base not in seen and class_has(base, attr, seen | {cls}) for base in bases[cls]):
            return True
    return cls not in classes_by_name() and bool(seen)  # a base from outside batchrun: cannot tell


def has_name(rel: str, chain: list[str]) -> bool:
    """Whether the module at `rel` defines chain[0] (and, where chain[0] is a class of it, chain[1])."""
    if rel.endswith((".c", ".h")):
        return re.search(rf"\b{re.escape(chain[0])}\b", (REPO / rel).read_text(encoding="utf-8")) is not None
    names, classes, _ = module_info(rel)
    if chain[0] not in names:
        return False
    if len(chain) > 1 and chain[0] in classes:
        return class_has(chain[0], chain[1])
    return True


@functools.cache
def defined_tests() -> frozenset[str]:
    return frozenset(name for dotted, rel in modules().items() if dotted.startswith("tests")
                     for name in module_info(rel)[0] if name.startswith("test_"))


def resolve_path(ref: str, source: str) -> list[str]:
    """The files a path reference may mean: from the repository root, batchrun/, the citing file's folders, or
    any file whose path ends with it."""
    here = Path(source).parent
    bases = ["", "batchrun/"] + [f"{p.as_posix()}/" for p in [here, *here.parents] if p.as_posix() != "."]
    exact = [base + ref for base in bases if base + ref in set(files())]
    if exact:
        return exact[:1]
    return [f for f in files() if f.endswith("/" + ref)]


def resolve_chain(parts: list[str], anchored: bool) -> tuple[list[str], list[str]] | None:
    """(candidate files, the rest of the chain) for the longest prefix of `parts` naming a module: the whole dotted
    name when `anchored` (batchrun.x.y), else any module whose dotted name ends with the prefix. None: no module."""
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if anchored:
            found = [modules()[prefix]] if prefix in modules() else []
        else:
            found = [rel for dotted, rel in modules().items()
                     if dotted.startswith("batchrun") and (dotted == prefix or dotted.endswith("." + prefix))]
        if found:
            return found, parts[k:]
    return None


# ---- what a text names --------------------------------------------------------------------------------------------

def _expand_braces(text: str) -> str:
    return BRACES.sub(lambda m: " ".join(m[1] + part + m[3] for part in m[2].split(",")), text)


def _identifier_like(name: str) -> bool:
    """In running text `x.py: word` is often prose; a name with `_`, a capital or a dot is code."""
    return "_" in name or "." in name or name != name.lower()


def check_path(ref: str, source: str) -> str | None:
    return None if ref in PAST_FILES or resolve_path(ref, source) else "no such file"


def check_path_name(ref: str, name: str, source: str) -> str | None:
    found = resolve_path(ref, source)
    if not found:
        return None  # the path alone is reported
    if any(has_name(rel, name.split(".")) for rel in found if rel.endswith((".py", ".c", ".h"))):
        return None
    return f"{name} not defined there"


def check_chain(chain: str, anchored: bool) -> str | None:
    parts = chain.split(".")
    if parts[-1] in EXTENSIONS or parts[0] in NOT_MODULES or ".".join(parts[:2]) in NOT_CODE:
        return None
    if not anchored and parts[0] in JOB_SECTIONS:
        return None
    if not anchored and parts[0] in FORMER:
        return f"renamed: {FORMER[parts[0]]}"
    if not anchored and resolve_chain(parts, False) is None and parts[0] in aliases():
        parts, anchored = [*aliases()[parts[0]].split("."), *parts[1:]], True
    if not anchored and parts[0][:1].isupper():  # Class.attr
        if parts[0] in classes_by_name() and not class_has(parts[0], parts[1]):
            return f"{parts[0]} has no {parts[1]}"
        return None
    resolved = resolve_chain(parts, anchored)
    if resolved is None:
        return "no such module" if anchored else None
    candidates, rest = resolved
    if not rest or any(has_name(rel, rest) for rel in candidates):
        return None
    return f"{rest[0]} not defined in {' or '.join(candidates)}"


def references(text: str, source: str, *, markdown: bool) -> list[tuple[int, str, str]]:
    """(line, reference, why it does not resolve) for each broken reference in `text`, cited from file `source`."""
    broken = []
    text = _expand_braces(URL.sub(" ", text))
    if markdown:  # `module.name` forms count in inline code only
        prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)
        spans = [(m.start(1), m[1]) for m in SPAN.finditer(prose)]
    else:
        spans = [(0, text)]

    def line(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    def report(offset: int, ref: str, why: str | None) -> None:
        if why:
            broken.append((line(offset), ref, why))

    for m in PATH.finditer(text):
        report(m.start(1), m[1], check_path(m[1], source))
    for m in PATH_TEST.finditer(text):
        report(m.start(1), f"{m[1]}::{m[2]}", check_path_name(m[1], m[2], source))
    for m in DOTTED.finditer(text):
        report(m.start(1), m[1], check_chain(m[1], anchored=True))
    for offset, piece in spans:
        if markdown and TEST.fullmatch(piece) and piece not in defined_tests():
            report(offset, piece, "no such test")
        for m in PATH_NAME.finditer(piece):
            if markdown or _identifier_like(m[2]):
                report(offset + m.start(1), f"{m[1]}: {m[2]}", check_path_name(m[1], m[2], source))
        for m in CHAIN.finditer(piece):
            if not m[1].startswith(("batchrun.", "benchmarks.")):
                report(offset + m.start(1), m[1], check_chain(m[1], anchored=False))
    return broken


def code_text(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment of a Python file."""
    source = path.read_text(encoding="utf-8")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


@functools.cache
def all_broken() -> tuple[tuple[str, int, str, str], ...]:
    """(file, line, reference, why) for every broken reference of the pages and of batchrun/'s code."""
    broken = []
    for page in PAGES:
        rel = page.relative_to(REPO).as_posix()
        for line, ref, why in references(page.read_text(encoding="utf-8"), rel, markdown=True):
            broken.append((rel, line, ref, why))
    for path in SOURCES:
        rel = path.relative_to(REPO).as_posix()
        for first, text in code_text(path):
            for line, ref, why in references(text, rel, markdown=False):
                broken.append((rel, first + line - 1, ref, why))
    return tuple(broken)


# ---- the tests ----------------------------------------------------------------------------------------------------

def test_every_module_the_docs_and_comments_name_exists():
    broken = all_broken()
    new = [f"{rel}:{line}: {ref} ({why})" for rel, line, ref, why in sorted(set(broken))]
    assert not new, "references to code that does not exist:\n" + "\n".join(new)


def test_a_made_up_reference_is_caught():
    made_up = ("See `batchrun/model/no_such_room.py`, `batchrun.model.layers.linear.NoSuchName`, `csrc/nope.c`, "
               "`layers/linear.py: no_such_name`, `io/sinks.py`, `RowSlice.no_such_method`, "
               "`quant_linear.QuantLinear`, tests/test_docs.py::test_no_such_test, `test_nothing_here` and "
               "`batchrun.no_such_module`.")
    found = {ref for _, ref, _ in references(made_up, "docs/x.md", markdown=True)}
    assert found == {"batchrun/model/no_such_room.py", "batchrun.model.layers.linear.NoSuchName", "csrc/nope.c",
                     "layers/linear.py: no_such_name", "io/sinks.py", "RowSlice.no_such_method",
                     "quant_linear.QuantLinear", "tests/test_docs.py::test_no_such_test", "test_nothing_here",
                     "batchrun.no_such_module"}
    real = ("`batchrun/model/layers/linear.py`, `batchrun.llm.LLM`, `csrc/sampling.c`, `output/state.py: read_status`, "
            "`RowSlice.ahead`, `engine.max_num_seqs`, `torch.float8_e4m3fn`, `jobs/example.yaml`, "
            "`cpu_kernels.build`, tests/test_docs.py::test_jobs_md_is_what_the_generator_writes.")
    assert references(real, "docs/x.md", markdown=True) == []
    comment = "# see kv_rows.py: NO_SUCH_CONSTANT; batchrun/kernels/cpu/csrc/nope.c"
    assert {ref for _, ref, _ in references(comment, "batchrun/x.py", markdown=False)} == {
        "kv_rows.py: NO_SUCH_CONSTANT", "batchrun/kernels/cpu/csrc/nope.c"}
