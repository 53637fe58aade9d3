"""How the distributed check scripts hand their measurements to the tests: a file of JSON records.

The script's rank 0 appends one JSON object per check to the file named by the environment
variable CHECKS_FILE, each record with a single os.write of its whole line (O_APPEND), and
the test reads the file after the launch. Parsing rank 0's stdout instead failed under
load: torchrun merges a rank's stdout and stderr line by line, and a line printed in
pieces could take another line's text in the middle ("JSONDecodeError: Extra data").
"""

import json
import os
from pathlib import Path

ENV = "CHECKS_FILE"
DONE = "ALL CHECKS RAN"


def report(record: dict) -> None:
    """Append ``record`` to the checks file in one write (call it on one rank). Without CHECKS_FILE (a script's
    function called in the test's own process) nothing is written."""
    if ENV not in os.environ:
        return
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(os.environ[ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def done() -> None:
    """The last record: every check ran."""
    report({"name": DONE})


def read(path: Path) -> dict[str, dict]:
    """``{name: record}`` of a finished script's checks file.

    Raises:
        AssertionError: the script did not get to :func:`done`.
    """
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    names = [r["name"] for r in records]
    assert DONE in names, f"the checks stopped after {names[-3:]}"
    return {r["name"]: r for r in records if r["name"] != DONE}
