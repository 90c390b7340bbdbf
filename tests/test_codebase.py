"""The shape of the code that the next engineers rely on (docs/architecture.md): only
``hotspare.integrations.deepspeed`` imports DeepSpeed (the megatron path and the launcher run
without it), and no module grows past the size one concept takes."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "plugin", "hotspare")
DEEPSPEED_PACKAGE = os.path.join(PACKAGE, "integrations", "deepspeed")
WORKER_SCRIPTS = os.path.join(PACKAGE, "testing", "workers")
"""Training scripts the harness runs by path (a DeepSpeed job's rank is a DeepSpeed user's script)."""
MAX_LINES = 400
# Modules still over MAX_LINES, with their size when this list was written: each may only
# shrink (issue 27 splits them); a module not listed may not pass MAX_LINES.
OVER = {"mirror.py": 424}


def modules():
    for dirpath, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def imported_roots(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_deepspeed_integration_imports_deepspeed():
    offenders = [os.path.relpath(p, PACKAGE) for p in modules()
                 if not p.startswith((DEEPSPEED_PACKAGE + os.sep, WORKER_SCRIPTS + os.sep))
                 and "deepspeed" in imported_roots(p)]
    assert offenders == [], f"move the DeepSpeed code of {offenders} into hotspare/integrations/deepspeed/"


def test_the_megatron_path_and_the_launcher_load_without_deepspeed():
    code = ("import sys\n"
            "import hotspare, hotspare.launch, hotspare.session, hotspare.mirror, hotspare.keeper\n"
            "import hotspare.integrations.megatron, hotspare.integrations.base\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_module_grows_past_one_concept():
    too_long = {}
    for path in modules():
        rel = os.path.relpath(path, PACKAGE)
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > OVER.get(rel, MAX_LINES):
            too_long[rel] = n
    assert too_long == {}, (f"modules over their limit ({MAX_LINES} lines, or their size in OVER): {too_long}; "
                            f"split by concept (docs/architecture.md)")
