"""Stored outputs print no floating-point noise: a number below 1e-6 is printed as a bound, never as digits.

Digits of noise (a difference of 7e-08 between two float32 results, say) change with the
processor's kernels, so a stored output that prints them fails nbval on another machine.
Print "below 1e-6" instead. Plot and widget cells (nbval-ignore-output) are not compared,
so they are not scanned.
"""

import re
from pathlib import Path

import nbformat
import pytest

SOLUTIONS = sorted((Path(__file__).resolve().parent.parent / "solutions").glob("*.ipynb"))
NOISE_BELOW = 1e-6
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])")
# A bound ("below 1e-7") is stable, and so is a setting printed as a label ("eps 1e-8").
BOUND_WORDS = re.compile(r"(below|under|within|at most|tolerance|to|<|<=|≤|eps|lr)\s*=?\s*$", re.IGNORECASE)


def printed_noise(text: str) -> list[str]:
    """The numbers in ``text`` smaller than NOISE_BELOW in magnitude but not zero, unless written as a bound."""
    found = []
    for match in NUMBER.finditer(text):
        value = abs(float(match.group()))
        if 0 < value < NOISE_BELOW and not BOUND_WORDS.search(text[max(0, match.start() - 16):match.start()]):
            found.append(match.group())
    return found


def stored_text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_the_scan_finds_noise_and_lets_bounds_and_ordinary_numbers_pass():
    assert printed_noise("Muon update changes by 7e-08") == ["7e-08"]
    assert printed_noise("max difference 3.2e-9, and 0.00000004") == ["3.2e-9", "0.00000004"]
    assert printed_noise("differences below 1e-7; within 5e-8 of the reference; tolerance 1e-08") == []
    assert printed_noise("loss 0.0312, lr 3e-4, step 12, 1e-6, P_M = 49152 bytes, layers.0.up_proj") == []
    assert printed_noise("AdamW, eps 1e-8: x1.00; eps=1e-10") == []


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_stored_output_prints_noise(path):
    notebook = nbformat.read(path, as_version=4)
    offenders = {}
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or "nbval-ignore-output" in cell.metadata.get("tags", []):
            continue
        if noise := printed_noise(stored_text(cell)):
            offenders[index] = noise
    assert not offenders, (f"{path.name}: cells print floating-point noise as digits, {offenders} (cell index: "
                           f"numbers); print a bound instead, e.g. f\"below {NOISE_BELOW:.0e}\"")
