"""rpb's modules import each other without circles and in the direction of its three wings:
every `import rpb.x`, `from rpb.x import`, `from rpb import x` (and relative form) anywhere in a
module, inside functions and `if TYPE_CHECKING:` blocks too, is an edge of the graph.

- No cycle except the known ones below. A new cycle fails with its modules in order; a known cycle
  that is gone must be taken off the list.
- The wings (CONTRIBUTING.md, "Layout"): the library (the modules at the top of rpb/ and in
  rpb/router/) imports neither of the others; the report (rpb/report/) imports the library alone;
  the pipeline (rpb/pipeline/) imports both, since it runs the report's jobs.
- CONTRIBUTING.md's picture of the wings is the graph's: `python tests/test_import_graph.py` prints
  it afresh. It names every module but the report's job modules (those declaring REPORT_ENTRIES,
  rpb.report.registry), and draws an arrow per pair of wings with imports along it, so a new
  table (its module and its test) leaves it as it is.

(A module named in a string, `importlib.import_module("rpb.x")`, is no edge.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rpb"

# Known cycles, each written from its alphabetically first module, with the reason it stays.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _module_names() -> dict[Path, str]:
    """rpb's modules by file: `cli` for rpb/pipeline/cli.py, `pkg` for rpb/pkg/__init__.py,
    `pkg.x`."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[path] = ".".join(parts)  # "" is rpb/__init__.py
    return names


def _target(dotted: str, modules: set[str]) -> str:
    """The rpb module that `rpb.<dotted>` names: its longest prefix that is a module."""
    parts = dotted.split(".") if dotted else []
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def _edges(path: Path, name: str, modules: set[str]) -> set[str]:
    """The rpb modules that the module `name` (file `path`) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            edges |= {
                _target(a.name.removeprefix("rpb").lstrip("."), modules)
                for a in node.names
                if a.name == "rpb" or a.name.startswith("rpb.")
            }
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from this module's package, level - 1 packages up
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "rpb" or (node.module or "").startswith("rpb."):
                source = node.module.removeprefix("rpb").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from rpb import x`: x may itself be a module
                sub = f"{source}.{alias.name}" if source else alias.name
                edges.add(sub if sub in modules else _target(source, modules))
    return edges - {name}


def import_graph() -> dict[str, set[str]]:
    """module -> the rpb modules it imports (rpb/__init__.py is the module "")."""
    names = _module_names()
    modules = set(names.values())
    return {name: _edges(path, name, modules) for path, name in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Every elementary cycle, each from its alphabetically first module (small graphs only)."""
    found: list[tuple[str, ...]] = []

    def walk(start: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == start:
                found.append(tuple(path))
            elif nxt > start and nxt not in path:
                walk(start, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def _show(cycle: tuple[str, ...]) -> str:
    return " -> ".join(f"rpb.{m}" if m else "rpb" for m in (*cycle, cycle[0]))


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"d"}, "e": set()}
    assert sorted(cycles(graph)) == [("a", "b"), ("a", "b", "c"), ("d",)]


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "specs" in graph["pipeline.cli"]  # a module-level import
    assert "pipeline.jobserver" in graph["pipeline.cli"]  # imported inside main()
    assert "families" in graph["pipeline.config_check"]  # inside a function


def test_rpb_has_no_import_cycles_but_the_known_ones():
    found = cycles(import_graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycles in rpb:\n" + "\n".join(_show(c) for c in new)
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, "known cycles that are gone (take them off KNOWN_CYCLES):\n" + "\n".join(
        _show(c) for c in gone
    )


def _imported_top_level(path: Path) -> set[str]:
    """The top-level packages a Python file imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_product_never_uses_an_experiment():
    """experiments/<name>/ is a finished or running study beside the product (CONTRIBUTING.md,
    "Experiments"): no module of rpb imports it, no rule or config of the workflow reads it."""
    leaks = [p for p in sorted(PACKAGE.rglob("*.py")) if "experiments" in _imported_top_level(p)]
    workflow = [ROOT / "Snakefile", *sorted((ROOT / "workflow").rglob("*"))]
    workflow += sorted((ROOT / "config").rglob("*.yaml"))
    for path in (p for p in workflow if p.is_file()):
        lines = path.read_text(errors="ignore").splitlines()
        # A comment may say where a decision came from; code and settings may not read it.
        if any("experiments/" in ln.split("#", 1)[0] for ln in lines):
            leaks.append(path)
    assert not leaks, [str(p.relative_to(ROOT)) for p in leaks]
    # The check sees what it is for.
    probe = ROOT / "tests" / "data" / "imports_experiment.py"
    assert "experiments" in _imported_top_level(probe)


# --------------------------------------------------------------------------- the wings

LIBRARY, PIPELINE, REPORT = "library", "pipeline", "report"
# What each wing may import (its own modules included).
MAY_IMPORT = {LIBRARY: {LIBRARY}, REPORT: {LIBRARY, REPORT}, PIPELINE: {LIBRARY, REPORT, PIPELINE}}
# Entry points outside the rule, with the reason.
ENTRY_POINTS = {
    "__main__": "`python -m rpb` is the `rpb` command (rpb.cli)",
    "cli": "`python -m rpb.cli`, the training launcher that configs name, loads the pipeline's "
    "verbs by name (rpb/cli.py)",
}


def wing(module: str) -> str:
    """The wing of an rpb module by its place: rpb/pipeline/, rpb/report/, or the library."""
    top = module.split(".")[0]
    return top if top in (PIPELINE, REPORT) else LIBRARY


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Every import against the wings' direction, as `a -> b (wing -> wing)`."""
    return [
        f"rpb.{m} -> rpb.{d} ({wing(m)} -> {wing(d)})"
        for m in sorted(graph)
        if m not in ENTRY_POINTS
        for d in sorted(graph[m])
        if wing(d) not in MAY_IMPORT[wing(m)]
    ]


def test_the_wing_rule_finds_imports_against_it():
    graph = {"prior": {"report.tables"}, "report.tables": {"pipeline.cli", "prior"}, "": set()}
    assert wrong_way(graph) == [
        "rpb.prior -> rpb.report.tables (library -> report)",
        "rpb.report.tables -> rpb.pipeline.cli (report -> pipeline)",
    ]
    assert wrong_way({"pipeline.cli": {"report.tables", "prior"}, "report": {"prior"}}) == []


def test_the_wings_import_downward_only():
    """The library never imports the pipeline or the report; the report never the pipeline."""
    assert not wrong_way(import_graph()), "\n".join(wrong_way(import_graph()))


def test_what_a_router_is_imports_nothing_above_it():
    """rpb/router/ (what a router computes and its check) is the library's floor: the families,
    the registry and the methods build on it, so it imports no other module of rpb (it once
    imported rpb.families to name a family in an error)."""
    up = {
        f"rpb.{name} -> rpb.{target}"
        for name, targets in import_graph().items()
        if name.startswith("router.")
        for target in targets
        if not target.startswith("router")
    }
    assert not up, sorted(up)


def behind(graph: dict[str, set[str]], module: str) -> set[str]:
    """The rpb modules `module` imports, directly or through others (itself included)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return seen


def test_behind_follows_imports_through_other_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert behind(graph, "a") == {"a", "b", "c"} and behind(graph, "d") == {"a", "b", "c", "d"}


def test_the_people_s_commands_import_nothing_of_the_pipeline():
    """`rpb finetune` and `rpb prior` are the library's (rpb.user_cli; issue 60): no module
    behind them, directly or through others, is the pipeline's or the report's, and the entry
    point reaches the pipeline's verbs only by name (rpb.cli)."""
    graph = import_graph()
    modules = behind(graph, "user_cli")
    assert {"posttraining", "train_spec", "jsonl", "methods"} <= modules  # it sees the core
    assert "tracking" in modules  # --mlflow's runs: the library's, not rpb.pipeline.tracking
    assert sorted(m for m in modules if wing(m) != LIBRARY) == []
    assert behind(graph, "cli") == {"cli"} | modules
    assert "pipeline.training" in behind(graph, "pipeline.cli")  # it sees the pipeline's


def declares_report_jobs(path: Path) -> bool:
    """Whether a module assigns `REPORT_ENTRIES` at its top level: a report job's module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    targets = [
        t
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    ]
    return any(isinstance(t, ast.Name) and t.id == "REPORT_ENTRIES" for t in targets)


def job_modules() -> set[str]:
    """The report wing's modules that declare report jobs (`report.tables`, ...)."""
    return {name for path, name in _module_names().items() if declares_report_jobs(path)}


def picture(graph: dict[str, set[str]], jobs: set[str] = frozenset()) -> str:
    """The wings as a Mermaid flowchart: each wing's modules but the report jobs' (`jobs`: a new
    table adds one), named from the wing (`router.check` for rpb/router/check.py; a package's
    `__init__` is its modules' heading, not a module of its own), and one arrow per pair of wings
    with imports along it (imports inside a wing are left out)."""
    lines = ["flowchart TB"]
    packages = {m.rpartition(".")[0] for m in graph}
    for name, title in ((PIPELINE, "rpb.pipeline"), (REPORT, "rpb.report"), (LIBRARY, "rpb")):
        modules = [m for m in graph if wing(m) == name and m not in packages]
        members = sorted(m.removeprefix(f"{name}.") for m in modules if m not in jobs)
        members = [m for m in members if f"{m}" not in ENTRY_POINTS]
        rows = [", ".join(members[i : i + 4]) for i in range(0, len(members), 4)]
        count = f"{len(members)} modules"
        if any(m in jobs for m in modules):
            count += " and the report jobs'"
            rows.append("+ a module per table or report job (its REPORT_ENTRIES)")
        lines.append(f'    {name}["<b>{title}</b> ({count})<br/>{"<br/>".join(rows)}"]')
    pairs = {
        (wing(m), wing(d))
        for m, deps in graph.items()
        if m not in ENTRY_POINTS
        for d in deps
        if wing(m) != wing(d)
    }
    lines += [f"    {a} --> {b}" for a, b in sorted(pairs)]
    return "\n".join(lines) + "\n"


def test_the_picture_leaves_out_the_report_jobs_modules_alone():
    graph = {"report.tables": {"prior"}, "report.stats": set(), "prior": set(), "report": set()}
    shown = picture(graph, {"report.tables"})
    assert "stats<br/>+ a module per table" in shown and "tables" not in shown.split("<br/>")[1]
    # A library subpackage's modules are named from the wing, its __init__ is none of them.
    nested = picture({"": set(), "router": set(), "router.spec": set(), "routing": {"router.spec"}})
    assert '"<b>rpb</b> (2 modules)<br/>router.spec, routing"' in nested
    assert "report --> library" in shown and "library -->" not in shown
    assert "report.table1" in job_modules() and "report.registry" not in job_modules()


def test_contributing_shows_the_wings_as_they_are():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = "```mermaid\n" + picture(import_graph(), job_modules()) + "```"
    assert block in text, "refresh CONTRIBUTING.md's picture: python tests/test_import_graph.py"


if __name__ == "__main__":
    print(picture(import_graph(), job_modules()), end="")


def test_the_examples_use_the_library_alone():
    """examples/ show the library as a user installs it (`pip install rpb`, no pipeline extra):
    no example imports rpb.pipeline or rpb.report."""

    def wings_imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return {n.split(".")[1] for n in names if n.startswith("rpb.")} & {PIPELINE, REPORT}

    examples = sorted((ROOT / "examples").glob("*.py"))
    assert examples and {p.name: wings_imported(p) for p in examples} == {
        p.name: set() for p in examples
    }
    # The check sees what it is for.
    probe = ROOT / "tests" / "data" / "imports_pipeline.py"
    assert wings_imported(probe) == {PIPELINE}
