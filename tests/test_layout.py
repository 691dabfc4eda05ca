"""The code's layout: no file outside tests/ imports a script, or a private name of another module.

A script is a file run as a command (it has a top-level `if __name__ == "__main__":` block):
train_dflash.py, eval_dflash.py, regenerate_data.py, bench_dflash.py, ... What another file needs
from one lives in a module (dflash_decoding.py, dflash_flops.py, ...) that both import. A private
name (`_name`) stays in its file: a name shared between files is public and has a docstring.
Tests may import scripts (they call a script's `main`) and private names (to test them alone).
"""

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIPPED_DIRS = {"tests", "__pycache__", "outputs", "runs"}


def source_files() -> list[Path]:
    """Every .py file of the repository outside tests/, hidden folders (.git, .venv) and virtual environments."""
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not (Path(folder, d) / "pyvenv.cfg").exists())
        found += [Path(folder, name) for name in sorted(files) if name.endswith(".py")]
    return found


def is_script(tree: ast.Module) -> bool:
    """Whether the module has a top-level `if __name__ == "__main__":` block."""
    for node in tree.body:
        test = getattr(node, "test", None)
        if (
            isinstance(node, ast.If)
            and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
        ):
            return True
    return False


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imports(tree: ast.Module):
    """(line, module, imported names, or the local name of `import module [as name]`) of every
    import, nested ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, alias.asname or alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def parsed() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for path in source_files()}


def test_no_file_imports_a_script():
    trees = parsed()
    scripts = {path.stem for path, tree in trees.items() if is_script(tree)}
    assert {"train_dflash", "eval_dflash", "regenerate_data", "bench_dflash"} <= scripts, scripts  # the check sees them
    problems = [
        f"{path.relative_to(REPO)}:{line}: imports the script {module.split('.')[0]}.py"
        for path, tree in trees.items()
        for line, module, _ in imports(tree)
        if module.split(".")[0] in scripts
    ]
    assert not problems, "move what these need into a module that the script imports too:\n" + "\n".join(problems)


def test_no_file_imports_a_private_name_of_another_module():
    trees = parsed()
    modules = {path.stem for path in trees}  # the project's modules: the flat files and the tools beside them
    problems = []
    for path, tree in trees.items():
        imported = {}  # local name -> project module, for `module._name`
        for line, module, names in imports(tree):
            if module.split(".")[0] not in modules:
                continue
            if isinstance(names, str):
                imported[names] = module
                continue
            problems += [f"{path.relative_to(REPO)}:{line}: imports {name} from {module}" for name in names if is_private(name)]
        problems += [
            f"{path.relative_to(REPO)}:{node.lineno}: reads {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported and is_private(node.attr)
        ]
    assert not problems, "make these names public (with a docstring) or move them to where they are used:\n" + "\n".join(problems)
