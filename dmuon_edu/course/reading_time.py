"""How long a notebook takes a learner, by one fixed estimate, and how much there is to read.

The estimate (the course's rule: an hour a notebook, none over 75 minutes):

- prose, the markdown cells' words, at 200 words a minute (an inline formula counts as a word);
- code cells at 8 non-blank lines a minute (reading them and running them);
- the exercise scripts the notebook checks (``check_script("scripts/...")``), at 15 lines a minute;
- 10 minutes per exercise, a ``### BEGIN SOLUTION`` block in the notebook or in its scripts;
- 2 minutes per "**Predict**" prompt.

Each notebook's first cell states the estimate, rounded to 5 minutes ("**About 45 minutes**"),
and the README's table repeats it; tests/test_course.py holds both to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

__all__ = ["Estimate", "estimate", "stated_minutes", "MINUTES_CAP", "WORDS_CAP"]

MINUTES_CAP = 75  # no notebook over this, by the estimate
WORDS_CAP = 4000  # prose plus the words of the scripts it checks
PROSE_WORDS_PER_MINUTE = 200
CODE_LINES_PER_MINUTE = 8
SCRIPT_LINES_PER_MINUTE = 15
MINUTES_PER_EXERCISE = 10
MINUTES_PER_PREDICTION = 2

_FORMULA = re.compile(r"\$[^$]+\$")
_CHECKED_SCRIPT = re.compile(r'check_script\(\s*"scripts/([^"]+)"')
_STATED = re.compile(r"\*\*About (\d+) minutes\*\*")


@dataclass(frozen=True)
class Estimate:
    minutes: float
    words: int  # prose, plus the words of the scripts it checks
    exercises: int

    @property
    def rounded(self) -> int:
        """The minutes as a first cell states them: to the nearest 5."""
        return 5 * round(self.minutes / 5)


def estimate(path: Path) -> Estimate:
    """The estimate (module docstring) of the solution notebook at ``path``; its scripts are read beside it."""
    notebook = nbformat.read(path, as_version=4)
    prose = code = predictions = exercises = 0
    scripts: set[str] = set()
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            prose += len(_FORMULA.sub(" x ", cell.source).split())
            predictions += cell.source.count("**Predict")
        elif cell.cell_type == "code":
            code += sum(1 for line in cell.source.splitlines() if line.strip())
            exercises += cell.source.count("### BEGIN SOLUTION")
            scripts.update(_CHECKED_SCRIPT.findall(cell.source))
    texts = [(path.parent / "scripts" / name).read_text() for name in sorted(scripts)]
    exercises += sum(text.count("### BEGIN SOLUTION") for text in texts)
    minutes = (prose / PROSE_WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE
               + sum(len(text.splitlines()) for text in texts) / SCRIPT_LINES_PER_MINUTE
               + MINUTES_PER_EXERCISE * exercises + MINUTES_PER_PREDICTION * predictions)
    return Estimate(minutes, prose + sum(len(text.split()) for text in texts), exercises)


def stated_minutes(path: Path) -> int | None:
    """The minutes the notebook's first cell states, or None."""
    found = _STATED.search(nbformat.read(path, as_version=4).cells[0].source)
    return int(found.group(1)) if found else None
