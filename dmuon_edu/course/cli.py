"""The course's command line.

    python -m dmuon_edu.course build        # solutions/ -> notebooks/
    python -m dmuon_edu.course sync-check   # fail if notebooks/ is out of date
    python -m dmuon_edu.course execute [NN] # re-run solutions, store clean outputs
    python -m dmuon_edu.course check [NN]   # grade notebooks/ (also: python -m dmuon_edu check)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dmuon_edu.course.grading import format_table, grade, grade_script
from dmuon_edu.course.notebooks import NOTEBOOKS, ROOT, SOLUTIONS, build, execute


def select(folder: Path, selector: str | None, pattern: str = "*.ipynb") -> list[Path]:
    """Files of ``folder`` whose name starts with ``selector`` (e.g. "01"), or the path ``selector`` itself."""
    if selector and Path(selector).suffix in (".ipynb", ".py"):
        path = Path(selector)
        if not path.exists():
            raise SystemExit(f"no file at {selector}")
        return [path] if path.match(pattern) else []
    return [p for p in sorted(folder.glob(pattern)) if selector is None or p.name.startswith(selector)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmuon_edu.course", description="Build and grade the course's notebooks.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="write notebooks/ from solutions/")
    commands.add_parser("sync-check", help="fail if notebooks/ is not what build would write")
    for name, help_text in [("execute", "re-run solution notebooks and store clean outputs"),
                            ("check", "grade your notebooks: one row per exercise")]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("selector", nargs="?", help="a notebook number such as 01, or a notebook path")
    args = parser.parse_args(argv)

    if args.command in ("build", "sync-check"):
        changed = build(check_only=args.command == "sync-check")
        for path in changed:
            print(f"{'out of date' if args.command == 'sync-check' else 'wrote'}: {path.relative_to(ROOT)}")
        if args.command == "sync-check" and changed:
            print("notebooks/ is out of date with solutions/: run `make notebooks`", file=sys.stderr)
            return 1
        return 0
    if args.command == "execute":
        for path in select(SOLUTIONS, args.selector):
            print(f"executing {path.relative_to(ROOT)}", flush=True)
            execute(path)
        return 0
    notebooks = select(NOTEBOOKS, args.selector)
    scripts = select(NOTEBOOKS / "scripts", args.selector, "*.py")
    if not notebooks and not scripts:
        raise SystemExit(f"nothing in {NOTEBOOKS} starts with {args.selector!r}")
    statuses = [status for path in notebooks for status in grade(path)]
    statuses += [grade_script(path) for path in scripts]
    print(format_table(statuses))
    return 0 if all(s.status == "passed" for s in statuses) else 1
