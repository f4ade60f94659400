"""Run a Jupyter notebook's code cells in one namespace, as a kernel would, without Jupyter: each cell's printed
text and the value of its last expression become its outputs (text/plain), written back with --write. A cell
tagged `parameters` (papermill's convention) is followed by `-p NAME=VALUE` assignments (VALUE: a Python
literal), which override its defaults. The tests run docs/api.ipynb this way on their own model and check what it computed.

    python scripts/run_notebook.py docs/api.ipynb --write          # after `make demo`: refresh its outputs
    python scripts/run_notebook.py docs/api.ipynb -p CKPT="'outputs/demo'"
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import sys
from pathlib import Path


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def run_cell(code: str, namespace: dict, name: str) -> list:
    """The cell's outputs in nbformat 4: its stdout as a stream, its last expression's repr as a result."""
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(tree, name, "exec"), namespace)
        value = eval(compile(ast.Expression(last.value), name, "eval"), namespace) if last else None
    outputs = [{"name": "stdout", "output_type": "stream", "text": printed.getvalue()}] if printed.getvalue() else []
    if value is not None:
        outputs.append({"data": {"text/plain": repr(value)}, "execution_count": None, "metadata": {},
                        "output_type": "execute_result"})
    return outputs


def run(path: Path, parameters: dict | None = None) -> tuple[dict, dict]:
    """(the notebook with fresh outputs, the namespace its cells left)."""
    notebook = json.loads(Path(path).read_text())
    namespace: dict = {"__name__": "__main__"}
    count = 0
    for i, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        code = source(cell)
        if parameters and "parameters" in cell.get("metadata", {}).get("tags", []):  # its defaults, then those given
            code += "\n" + "".join(f"{name} = {value!r}\n" for name, value in parameters.items())
        count += 1
        cell["outputs"] = run_cell(code, namespace, f"{path}[cell {i}]")
        cell["execution_count"] = count
        for output in cell["outputs"]:
            if output["output_type"] == "execute_result":
                output["execution_count"] = count
    return notebook, namespace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--write", action="store_true", help="write the outputs into the notebook")
    args = parser.parse_args(argv)
    parameters = {name: ast.literal_eval(value) for name, value in (p.split("=", 1) for p in args.parameter)}
    notebook, _ = run(args.notebook, parameters or None)
    if args.write:
        args.notebook.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            sys.stdout.write(output.get("text") or output["data"]["text/plain"] + "\n")


if __name__ == "__main__":
    main()
