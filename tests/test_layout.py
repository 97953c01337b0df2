"""The tree's layout rules: no import cycle among hugehead's modules (imports inside functions included),
every source file under 500 lines, and the environment read in one place only."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hugehead"
MAX_LINES = 500

# The only files that read the environment: the frozen knobs (tuning.py) and the extension's loader.
READS_ENVIRONMENT = {"hugehead/tuning.py", "hugehead/_extension.py"}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _imports(path: pathlib.Path, modules: set) -> set:
    """The hugehead modules ``path`` imports, anywhere in the file (functions included); ``from . import x``
    resolves to the submodule ``x`` where there is one, else to the package."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith("hugehead"):
                continue
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found |= subs
            # a name imported from a module (not a submodule of it) is an import of that module
            if len(subs) < len(node.names):
                found.add(base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hugehead")}
    # a package's own submodules do not import the package itself by importing their siblings
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycle(graph: dict):
    """One import cycle of ``graph`` as a list of modules, or None. A package ``p`` imported by its own
    submodule ``p.x`` counts only through what ``p/__init__.py`` imports."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if node.startswith(dep + "."):  # a submodule importing its package: Python has it loaded already
                continue
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_sees_imports_inside_functions_and_relative_submodules():
    graph = import_graph()
    # (head_config.py imports the offload engine inside a function; hugehead/__init__ imports "from . import ops")
    assert "hugehead.engines.offload" in graph["hugehead.head_config"]
    assert "hugehead.ops" in graph["hugehead"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _source_files():
    files = sorted(PACKAGE.rglob("*.py"))
    for pattern in ("*.cpp", "*.cu", "*.cuh", "*.h", "*.hpp"):
        files += sorted((ROOT / "csrc").rglob(pattern))
    return files


def test_every_source_file_is_under_500_lines():
    too_long = {}
    for path in _source_files():
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines >= MAX_LINES:
            too_long[rel] = lines
    assert not too_long, f"files of {MAX_LINES} lines or more: {too_long}"


@pytest.mark.parametrize("word", ["os.environ", "getenv"])
def test_the_environment_is_read_only_by_tuning_and_the_extension_loader(word):
    readers = sorted(p.relative_to(ROOT).as_posix() for p in _source_files()
                     if word in _code(p) and p.relative_to(ROOT).as_posix() not in READS_ENVIRONMENT)
    assert not readers, f"{word} outside {sorted(READS_ENVIRONMENT)}: {readers}"


def _code(path: pathlib.Path) -> str:
    """A Python file without its docstrings and comments (their words are no environment read); other
    files whole."""
    if path.suffix != ".py":
        return path.read_text()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_gemm_instance_table():
    """csrc/cuda/gemm/instances.def, from which CMake generates one .cu per fused GEMM instantiation: every entry
    in the form CMakeLists.txt reads (its regular expression, so configure never stops on one), its header
    present, each name once, and the name saying the element type and schedule the entry instantiates (the
    dispatcher picks launchers by name)."""
    import re

    cmake = (ROOT / "CMakeLists.txt").read_text()
    pattern = re.search(r'_entry MATCHES "(.+?)"\)', cmake).group(1).replace("\\\\", "\\")
    table = ROOT / "csrc/cuda/gemm/instances.def"
    entries = [line for line in table.read_text().splitlines() if line.startswith("HUGEHEAD_GEMM(")]
    assert len(entries) >= 10
    names = []
    for line in entries:
        m = re.match(pattern, line)
        assert m, f"CMake cannot read {line!r}"
        name, header, params, gemm = m.groups()
        assert (table.parent / header).is_file(), header
        names.append(name)
        dtype = {"cutlass::bfloat16_t": "bf16", "cutlass::half_t": "fp16"}[re.search(r"<(cutlass::\w+),", gemm)[1]]
        schedule = re.search(r"Schedule::k(\w+)", gemm)[1]
        suffix = re.sub(r"(?<!^)(?=[A-Z])", "_", schedule).lower().replace("cluster_192", "cluster192")
        assert f"_{dtype}_{suffix}" in name, (name, gemm)
        assert params == ("GradGemmParams" if name.startswith("grad_") else "StatsGemmParams"), line
    assert len(set(names)) == len(names), "an instantiation named twice"
