"""What kind of script a user hands hpar, told from its source (``ast``) without importing it:
one that follows hpar's contract (``model()``, ``data()``, ``loss()`` at top level: ``hpar
run``/``hpar profile``), a torchrun-style one that starts its own process group (``hpar
launch`` runs it unmodified), or neither. The commands share these checks.
"""

from __future__ import annotations

import ast
import os

CONTRACT = ("model", "data", "loss")


def script_kind(path: str) -> str:
    """ "contract" for a script that defines hpar's ``model``, ``data`` and ``loss`` at top level
    and never calls ``init_process_group``; "torchrun" for one that calls it; "plain" otherwise.
    Raises ValueError (one line naming the file) when it is missing or is not valid Python."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: script not found")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except SyntaxError as exc:
        raise ValueError(f"{path}:{exc.lineno}: syntax error ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the script ({exc})") from None
    calls = {
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    if "init_process_group" in calls:
        return "torchrun"
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return "contract" if set(CONTRACT) <= defined else "plain"


def not_profilable(path: str) -> str | None:
    """The message for ``hpar run``/``hpar profile`` on a torchrun-style script (None for any
    other script or one that cannot be read: the job loader reports those)."""
    try:
        kind = script_kind(path)
    except ValueError:
        return None
    if kind != "torchrun":
        return None
    return (
        f"{path}: hpar cannot profile this script: it starts its own process group (init_process_group) "
        f"and defines no model()/data()/loss(); run it as it is with `hpar launch {path} [ARGS]...`"
    )
