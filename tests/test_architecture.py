"""The layering, read from the source with `ast`: every import, at module level and inside functions.

- batchrun/engine/ holds no tensors: it imports no torch, and nothing of the layers above or beside it
  (model, io, job, llm, distributed).
- batchrun/model/ takes from the engine only the step contract (batchrun.engine.contract).
- the contract is a leaf: it imports nothing of batchrun.
- no import cycle among the modules of batchrun/.
- batchrun/serve/ is a top layer: only the CLI imports it; only its app and server import the ASGI stack.
- every module sits in one layer of LAYERS (docs/architecture.md) and imports nothing from a layer above its own.

Imports under `if TYPE_CHECKING:` count like any other: a type a module names is a dependency of its reader. A
package's __init__ is a module like any other (its imports are edges); importing batchrun.x.y is an edge to
batchrun.x.y, not to its parents, whose __init__ Python runs first anyway.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("batchrun",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, wherever it is (functions and `if TYPE_CHECKING:` included)."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def imports_of(module: str, source: str | None = None) -> set[str]:
    """Dotted names `module` imports: `from a.b import c` is a.b.c when that is a module, else a.b. source: the
    module's text (default: its file)."""
    path = MODULES.get(module, ROOT / (module.replace(".", "/") + ".py"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    text = path.read_text() if source is None else source
    for node in _import_nodes(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from .x import y
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in MODULES else base)
    return found


def project_imports(module: str, source: str | None = None) -> set[str]:
    return {name for name in imports_of(module, source) if name.split(".")[0] in PACKAGES}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_parser_sees_function_level_imports():
    # the runner imports the CUDA-graph module inside a method: it must be an edge
    assert "batchrun.model.runner.cuda_graphs" in project_imports("batchrun.model.runner.model_runner")
    assert "batchrun.engine.contract" in project_imports("batchrun.model.runner.model_runner")


def test_engine_imports_no_torch():
    offenders = {m: sorted(n for n in imports_of(m) if n.split(".")[0] in ("torch", "triton", "numpy"))
                 for m in MODULES if _under(m, "batchrun.engine")}
    assert {m: n for m, n in offenders.items() if n} == {}


def test_engine_imports_nothing_above_it():
    above = ("batchrun.model", "batchrun.io", "batchrun.job", "batchrun.llm", "batchrun.distributed",
             "batchrun.cli", "batchrun.config", "batchrun.plan", "batchrun.progress", "batchrun.kernels")
    bad = {m: sorted(n for n in project_imports(m) if any(_under(n, a) for a in above))
           for m in MODULES if _under(m, "batchrun.engine")}
    assert {m: n for m, n in bad.items() if n} == {}


def test_model_takes_only_the_contract_from_the_engine():
    bad = {m: sorted(n for n in project_imports(m) if _under(n, "batchrun.engine") and n != "batchrun.engine.contract")
           for m in MODULES if _under(m, "batchrun.model")}
    assert {m: n for m, n in bad.items() if n} == {}


def test_the_contract_is_a_leaf():
    assert project_imports("batchrun.engine.contract") == set()


def _cycles(modules: set[str]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import), Tarjan's way."""
    graph = {m: sorted(n for n in project_imports(m) if n in modules and n != m or n == m) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle_in_engine_and_model():
    layer = {m for m in MODULES if _under(m, "batchrun.engine") or _under(m, "batchrun.model") or _under(m, "batchrun.kernels")}
    assert _cycles(layer) == []


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    edges = {"batchrun.plan": {"batchrun.io.slicing"}, "batchrun.io.slicing": {"batchrun.plan"}}
    monkeypatch.setitem(globals(), "project_imports", lambda m, source=None: edges[m])
    assert _cycles(set(edges)) == [["batchrun.io.slicing", "batchrun.plan"]]


def test_no_import_cycle_anywhere():
    assert _cycles(set(MODULES)) == []


def test_serve_is_a_top_layer():
    """batchrun serve sits beside cli.py and job.py: only the CLI imports it, and only its HTTP modules import
    the ASGI stack (the extra batchrun[serve]), so the rest of batchrun runs without it."""
    importers = sorted(m for m in MODULES if not _under(m, "batchrun.serve") and m != "batchrun.cli"
                       and any(_under(n, "batchrun.serve") for n in project_imports(m)))
    assert importers == []
    web = ("fastapi", "starlette", "uvicorn", "python_multipart", "multipart")
    users = sorted(m for m in MODULES if any(n.split(".")[0] in web for n in imports_of(m)))
    assert users == ["batchrun.serve.app", "batchrun.serve.errors", "batchrun.serve.routes.batches",
                     "batchrun.serve.routes.files", "batchrun.serve.routes.models", "batchrun.serve.server"]


# The layers of docs/architecture.md, top to bottom. A module may import from its own layer and the layers below
# it, never from one above. Each entry is a module or a package (its modules with it); every module of batchrun/
# belongs to exactly one layer (test_every_module_has_a_layer), so a new one must be placed here.
LAYERS: list[tuple[str, ...]] = [
    # the package root serves the API names (LLM, SamplingParams, ...) lazily, from every layer below
    ("batchrun.cli", "batchrun", "batchrun.vllm_compat"),
    ("batchrun.serve",),
    ("batchrun.job", "batchrun.report", "batchrun.show"),
    ("batchrun.distributed",),
    ("batchrun.pipeline",),
    ("batchrun.plan", "batchrun.shards"),
    ("batchrun.output",),
    ("batchrun.io",),
    ("batchrun.config",),
    ("batchrun.llm", "batchrun.build", "batchrun.prompts", "batchrun.chat", "batchrun.collect", "batchrun.llm_args",
     "batchrun.pooling"),
    ("batchrun.engine", "batchrun.structured"),
    # the model's rooms, top to bottom
    ("batchrun.model.runner",),
    ("batchrun.model.weights",),
    ("batchrun.model.arch",),
    ("batchrun.model.sampling",),
    ("batchrun.model.quant",),
    ("batchrun.model.layers",),
    ("batchrun.model",),
    ("batchrun.engine_args",),
    # the kernels: C and Triton over the layouts both share
    ("batchrun.kernels.cpu", "batchrun.kernels.triton"),
    ("batchrun.kernels",),
    # leaves: plain data and helpers shared by every layer above
    ("batchrun.engine.contract", "batchrun.sampling_params", "batchrun.pooling_params", "batchrun.outputs",
     "batchrun.beam_search", "batchrun.progress", "batchrun.timeseries", "batchrun.paths", "batchrun.inputs"),
]


def _in_entry(module: str, entry: str) -> bool:
    """An entry holds its modules; the root "batchrun" holds only itself (its package __init__)."""
    return module == entry or (entry != "batchrun" and _under(module, entry))


def layer_of(module: str) -> int:
    """The layer of the longest entry holding `module` (batchrun.engine.contract before batchrun.engine)."""
    best = max(((len(entry), i) for i, layer in enumerate(LAYERS) for entry in layer if _in_entry(module, entry)),
               default=None)
    if best is None:
        raise KeyError(f"{module} is in no layer of LAYERS")
    return best[1]


def upward_imports(module: str, imported: set[str]) -> list[str]:
    return sorted(n for n in imported if layer_of(n) < layer_of(module))


def test_every_module_has_a_layer():
    entries = [entry for layer in LAYERS for entry in layer]
    assert len(entries) == len(set(entries))
    assert sorted(m for m in MODULES if not any(_in_entry(m, e) for e in entries)) == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = {m: upward_imports(m, project_imports(m)) for m in MODULES}
    assert {m: n for m, n in upward.items() if n} == {}


def test_the_layer_check_sees_an_upward_import():
    # the import this rule removed (plan.py used batchrun.distributed's Ray check) would be reported
    assert upward_imports("batchrun.plan", {"batchrun.distributed", "batchrun.io.sources"}) == ["batchrun.distributed"]
    # the model takes the contract, a leaf below it, not the engine above it
    assert upward_imports("batchrun.model.runner.model_runner", {"batchrun.engine.contract"}) == []
    assert upward_imports("batchrun.model.runner.model_runner", {"batchrun.engine.scheduler"}) == ["batchrun.engine.scheduler"]


def test_no_import_name_is_shared_with_another_distribution():
    """An import name batchrun installs must not be one another installed package owns: a top-level `kernels`
    of ours shadowed Hugging Face's `kernels`, which transformers >= 5.25 imports, and broke every import of a
    transformers model class."""
    from importlib.metadata import packages_distributions

    shared = {name: sorted(set(dists)) for name, dists in packages_distributions().items()
              if "batchrun" in dists and set(dists) - {"batchrun"}}
    assert shared == {}


def docstring_share(root: Path) -> tuple[int, int]:
    """(docstring lines, Python lines) of the modules under root: module, class and function docstrings."""
    doc = total = 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        total += len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                        isinstance(first.value.value, str):
                    doc += first.end_lineno - first.lineno + 1
    return doc, total


def test_code_states_rules_in_short_docstrings():
    """Docstrings say what holds and why in a few lines; measurements and history live in docs/ (at most 7% of
    the package's lines are docstrings)."""
    doc, total = docstring_share(ROOT / "batchrun")
    assert doc / total <= 0.07, f"docstrings are {doc} of {total} lines ({100 * doc / total:.1f}%)"


def test_the_facades_stay_thin():
    """LLM's constructor and serve's app factory hand the work to build_engine and to the routers."""
    def length(module: str, qualname: str) -> int:
        tree = ast.parse(MODULES[module].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and f"{node.name}.{item.name}" == qualname:
                        return item.end_lineno - item.lineno + 1
            if isinstance(node, ast.FunctionDef) and node.name == qualname:
                return node.end_lineno - node.lineno + 1
        raise KeyError(qualname)

    assert length("batchrun.llm", "LLM.__init__") <= 40
    assert length("batchrun.serve.app", "create_app") <= 40
