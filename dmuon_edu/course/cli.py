"""The course's command line.

    python -m dmuon_edu.course build [--force]  # solutions/ -> notebooks/; refuses to replace your work unless --force
    python -m dmuon_edu.course restore NN       # start NN over from a fresh copy; yours is kept as a backup
    python -m dmuon_edu.course sync-check       # fail if build would change notebooks/
    python -m dmuon_edu.course execute [NN]     # re-run solutions, store clean outputs
    python -m dmuon_edu.course check [NN]       # grade notebooks/ (also: python -m dmuon_edu check)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dmuon_edu.course.grading import GRADE_CELL_TIMEOUT_S, called_scripts, format_table, grade, grade_script
from dmuon_edu.course.notebooks import NOTEBOOKS, ROOT, SOLUTIONS, WorkWouldBeLost, build, execute, plan, restore


def select(folder: Path, selector: str | None, pattern: str = "*.ipynb") -> list[Path]:
    """Files of ``folder`` whose name starts with ``selector`` (e.g. "01"), or the path ``selector`` itself."""
    if selector and Path(selector).suffix in (".ipynb", ".py"):
        path = Path(selector)
        if not path.exists():
            raise SystemExit(f"no file at {selector}")
        return [path] if path.match(pattern) else []
    return [p for p in sorted(folder.glob(pattern)) if selector is None or p.name.startswith(selector)]


def selection(selector: str | None) -> tuple[list[Path], list[Path]]:
    """What `check SELECTOR` grades: the notebooks it names and the exercise scripts those notebooks run.

    A notebook's scripts are read from the notebook itself, since their names need not share its prefix
    (06a runs scripts/06_owners_only.py); a selector that starts a script's name picks that script too.
    """
    notebooks = select(NOTEBOOKS, selector)
    scripts = {script for notebook in notebooks for script in called_scripts(notebook)}
    if not (selector and Path(selector).suffix == ".ipynb"):
        scripts.update(select(NOTEBOOKS / "scripts", selector, "*.py"))
    return notebooks, sorted(scripts)


def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a cell timeout is a positive, finite number of seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmuon_edu.course", description="Build and grade the course's notebooks.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="write notebooks/ from solutions/, never over your work").add_argument(
        "--force", action="store_true", help="replace the files you changed too, each after a backup")
    commands.add_parser("restore", help="start an exercise over: a fresh copy, yours kept as a backup").add_argument(
        "name", help="a notebook number such as 01, or the start of a file name in notebooks/ or notebooks/scripts/")
    commands.add_parser("sync-check", help="fail if build would change notebooks/")
    for name, help_text in [("execute", "re-run solution notebooks and store clean outputs"),
                            ("check", "grade your notebooks: one row per exercise")]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("selector", nargs="?", help="a notebook number such as 01, or a notebook path")
    commands.choices["check"].add_argument(
        "--cell-timeout", type=seconds, default=GRADE_CELL_TIMEOUT_S, metavar="SECONDS",
        help=f"stop a notebook at a cell that runs longer (default {GRADE_CELL_TIMEOUT_S} s)")
    args = parser.parse_args(argv)

    try:
        if args.command == "build":
            written, backups = build(force=args.force)
            for path in written:
                print(f"wrote: {_shown(path)}" + (f" (yours is kept in {_shown(backups[path])})" if path in backups else ""))
            return 0
        if args.command == "restore":
            for path, backup in restore(args.name).items():
                print(f"restored: {_shown(path)}" + (f" (yours is kept in {_shown(backup)})" if backup else ""))
            return 0
        if args.command == "sync-check":
            todo = plan()
            for name in todo.write:
                print(f"out of date: {_shown(NOTEBOOKS / name)}")
            for name in todo.edited:
                print(f"out of date, and changed since the last build (build refuses it): {_shown(NOTEBOOKS / name)}")
            if todo.write or todo.edited:
                print("notebooks/ is out of date with solutions/: run `make notebooks` (it never overwrites your "
                      "changes: for a file you changed, `python -m dmuon_edu.course restore NAME` starts it over, "
                      "keeping a backup, or `make notebooks FORCE=1` rebuilds all, keeping backups)", file=sys.stderr)
                return 1
            return 0
    except (WorkWouldBeLost, ValueError) as error:  # work that would be lost, a broken manifest, unknown NAME
        print(error, file=sys.stderr)
        return 1
    if args.command == "execute":
        solutions = select(SOLUTIONS, args.selector)
        if not solutions:
            raise SystemExit(f"nothing in {SOLUTIONS} starts with {args.selector!r}: name a module by its number "
                             f"({', '.join(_modules(SOLUTIONS))}), e.g. `python -m dmuon_edu.course execute 01`, or "
                             "no name to execute them all")
        for path in solutions:
            print(f"executing {_shown(path)}", flush=True)
            execute(path)
        return 0
    notebooks, scripts = selection(args.selector)
    if not notebooks and not scripts:
        raise SystemExit(f"nothing in {NOTEBOOKS} starts with {args.selector!r}: name a module by its number "
                         f"({', '.join(_modules(NOTEBOOKS))}), e.g. `python -m dmuon_edu check 01`, or no name to grade them all")
    statuses = [status for path in notebooks for status in grade(path, args.cell_timeout)]
    statuses += [grade_script(path) for path in scripts]
    print(format_table(statuses))
    # No exercise graded is no success: "0 of 0 exercises passed" must not exit 0.
    return 0 if statuses and all(s.status == "passed" for s in statuses) else 1


def _modules(folder: Path) -> list[str]:
    return sorted({path.name[:2] for path in folder.glob("[0-9][0-9]*.ipynb")})


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
