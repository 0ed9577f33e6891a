"""The docs say what the code does: docs/jobs.md's key reference is what docs/gen_jobs.py generates from the
declarations; every `batchrun ...` line of a console block names a command and options that exist; the cheap
ones run (--help, --version, models, validate of the job files shown); the Python blocks parse and import names
that exist; every relative link resolves; the README links every docs page. No model is loaded: seconds."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from batchrun.cli import main
from batchrun.config import SCHEMA, parse_job

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", *DOCS.glob("*.md")])
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _generator():
    spec = importlib.util.spec_from_file_location("gen_jobs", DOCS / "gen_jobs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks(page: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(page.read_text(encoding="utf-8")) if kind == lang]


def console_commands() -> list[tuple[str, list[str]]]:
    """(page, argv after `batchrun`) of every `$ batchrun ...` line (with its continuation lines)."""
    found = []
    for page in PAGES:
        for body in blocks(page, "console"):
            lines = body.splitlines()
            for i, line in enumerate(lines):
                if not line.startswith("$ batchrun"):
                    continue
                text = line[2:]
                while text.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text.rstrip()[:-1] + " " + lines[i]
                argv = shlex.split(text, comments=True)
                found.append((page.name, argv[1:]))
    return found


def test_jobs_md_is_what_the_generator_writes():
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    assert gen.render(page) == page, "docs/jobs.md is out of date: run python docs/gen_jobs.py"
    assert gen.main(["--check"]) == 0


def test_the_generator_follows_the_declarations(monkeypatch):
    """A changed default, a new key, a key without a meaning: the page would change (or the generator refuses)."""
    gen = _generator()
    before = gen.generate()
    rule = SCHEMA["output"]["rows_per_part"]
    monkeypatch.setitem(SCHEMA["output"], "rows_per_part", dataclasses.replace(rule, default=123))
    assert "`output.rows_per_part` | an integer >= 1 | `123` |" in gen.generate()
    monkeypatch.setitem(SCHEMA["output"], "new_key", dataclasses.replace(rule, doc=""))
    with pytest.raises(KeyError, match="output.new_key has no doc="):
        gen.generate()
    monkeypatch.undo()
    assert gen.generate() == before
    every_key = [f"`{section}.{key}`" for section in SCHEMA for key in SCHEMA[section]]
    assert all(key in before for key in every_key)


def test_the_every_key_example_is_a_valid_job_with_the_defaults():
    gen = _generator()
    text = "\n".join(gen.example_job()[1:-1])
    cfg = parse_job(text, source="docs/jobs.md")
    for section in ("model", "input", "engine", "output", "executor"):
        for key, rule in SCHEMA[section].items():
            if not rule.required:
                assert getattr(cfg, section)[key] == rule.default, f"{section}.{key}"
    assert cfg.sampling_params() == parse_job("model: {path: x}\ninput: {path: y}\noutput: {path: z}").sampling_params()


def test_console_lines_name_commands_and_options_that_exist():
    commands = console_commands()
    assert len(commands) >= 20  # README, jobs.md, cluster.md, serve.md ... (the parser found them)
    unknown = []
    for page, argv in commands:
        command: click.Command = main
        if argv and argv[0] in main.commands:
            command = main.commands[argv[0]]
        elif argv and not argv[0].startswith("-"):
            unknown.append(f"{page}: batchrun {argv[0]}: no such command")
            continue
        options = {opt for param in command.params for opt in param.opts + param.secondary_opts}
        options |= {"--help", "-h"}
        for arg in argv:
            name = arg.partition("=")[0]
            if name.startswith("-") and name not in options:
                unknown.append(f"{page}: batchrun {' '.join(argv)}: {name} is not an option of {command.name}")
    assert unknown == []


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["models"], ["run", "--help"], ["serve", "--help"]])
def test_cheap_commands_run(argv):
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_the_job_files_shown_validate(monkeypatch, tmp_path):
    """Each complete job file in a yaml block of the README and docs/jobs.md (model, input and output) passes
    `batchrun validate` from the repository root: the model and input they name exist."""
    monkeypatch.chdir(REPO)
    jobs = [body for page in (REPO / "README.md", DOCS / "jobs.md") for body in blocks(page, "yaml")
            if all(f"\n{s}:" in "\n" + body for s in ("model", "input", "output")) and "data/prompts" not in body]
    assert jobs
    for i, body in enumerate(jobs):
        path = tmp_path / f"job{i}.yaml"
        path.write_text(body)
        result = CliRunner().invoke(main, ["validate", str(path), "--set", f"output.path={tmp_path / 'out'}"])
        assert result.exit_code == 0, body + result.output


def test_python_blocks_parse_and_import_names_that_exist():
    missing = []
    for page in PAGES:
        for body in blocks(page, "python"):
            tree = ast.parse(body, str(page))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "batchrun":
                    module = importlib.import_module(node.module)
                    missing += [f"{page.name}: {node.module}.{a.name}" for a in node.names
                                if not hasattr(module, a.name)]
    assert missing == []


def test_relative_links_resolve_and_the_readme_links_every_page():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert broken == []
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [p.name for p in DOCS.glob("*.md") if f"(docs/{p.name})" not in readme] == []


def test_the_python_api_page_names_every_setting_and_sampling_field():
    """docs/python-api.md lists LLM's keyword arguments and SamplingParams' fields by name: a new one must be added."""
    from batchrun.engine_args import EngineArgs
    from batchrun.sampling_params import SamplingParams

    page = (DOCS / "python-api.md").read_text(encoding="utf-8")
    names = [f.name for f in dataclasses.fields(EngineArgs) if f.metadata["job_key"] and f.name != "model"]
    names += ["seed", *SamplingParams.field_names()]
    assert [n for n in names if f"`{n}`" not in page] == []


def _kernel_generator():
    spec = importlib.util.spec_from_file_location("gen_kernels", DOCS / "gen_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_kernels_md_is_what_the_generator_writes():
    gen = _kernel_generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    assert gen.render(page) == page, "docs/cpu-kernels.md is out of date: run python docs/gen_kernels.py"
    assert gen.main(["--check"]) == 0


def test_the_kernel_table_follows_the_signatures_and_the_imports(monkeypatch):
    """A kernel added to a family's SIGNATURES shows in its row; the callers are the modules that import it."""
    from batchrun.kernels.cpu import sampling

    gen = _kernel_generator()
    before = gen.generate()
    row = next(line for line in before.splitlines() if line.startswith("| sampling |"))
    assert "`model/sampling/sampler.py`" in row and "`model/sampling/grammar_mask.py`" in row
    monkeypatch.setitem(sampling.SIGNATURES, "sample_new_kernel", (None, []))
    after = gen.generate()
    assert "`sample_new_kernel`" in next(line for line in after.splitlines() if line.startswith("| sampling |"))
    monkeypatch.undo()
    assert gen.generate() == before
