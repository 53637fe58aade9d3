"""Run a script under torchrun from a notebook cell or a test, and never hang.

    result = torchrun("train.py", nproc=2, args=["--steps", "10"])

torchrun (``python -m torch.distributed.run``) starts ``nproc`` ranks on this
machine (``--standalone`` picks a free port). Each rank's output is printed as
it arrives, tagged ``[rank r]``. If a rank fails, :class:`RankFailedError`
names the rank torchrun saw fail first and carries its exception. If the job
outlives ``timeout`` seconds, every process of it is killed.

Scripts choose their backend with :func:`dmuon_edu.distributed.session`: gloo
on CPU, NCCL when there is a GPU for every rank. A notebook must not
``mp.spawn`` functions it defines: spawned processes re-import ``__main__``,
which a notebook does not have as a file.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["torchrun", "LaunchResult", "RankFailedError"]

# torchrun --tee prefixes "[default<local rank>]:"; torch's own excepthook adds "[rank<r>]: " to tracebacks.
_RANK_LINE = re.compile(r"^\[default(\d+)\]:(?:\[rank\d+\]: ?)?(.*)$")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
# torchrun's failure summary: "Root Cause ... rank : 1 (local_rank: 1) ... exitcode : -6 (pid: 21311)  (SIGABRT)"
_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG\w+)\))?\s*$",
    re.S | re.M)
_TERMINATE_GRACE_S = 5
# gloo: "Timed out waiting 5000ms for recv operation"; NCCL: "Watchdog caught collective operation timeout".
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting|collective operation timeout", re.I)
_SOURCE_LOCATION = re.compile(r"\[[^\]]+\.(?:cc|cpp|h):\d+\] ")


class RankFailedError(RuntimeError):
    """A rank of a torchrun job failed; ``rank`` and ``exception`` say which and why."""

    def __init__(self, rank: int | None, exception: str, output: str, silent_ranks: tuple[int, ...] = ()):
        self.rank, self.exception, self.output = rank, exception, output
        who = f"rank {rank}" if rank is not None else "a rank"
        message = f"{who} failed: {exception}"
        if _COLLECTIVE_TIMEOUT.search(exception):
            others = (f"rank{'s' * (len(silent_ranks) > 1)} {', '.join(map(str, silent_ranks))} raised nothing: "
                      "look there for the one that stopped answering" if silent_ranks else "another rank stopped answering")
            message = (f"{who} failed: a collective timed out ({_SOURCE_LOCATION.sub('', exception)}). {others} "
                       "(it hangs, or waits in a different collective); the wait limit is "
                       "distributed.session(timeout_s=...)")
        super().__init__(message)


@dataclass
class LaunchResult:
    """What a finished torchrun job printed, per rank."""

    returncode: int
    output: dict[int, list[str]] = field(default_factory=dict)
    launcher_log: list[str] = field(default_factory=list)

    def stdout(self, rank: int = 0) -> str:
        """Everything ``rank`` printed, one string (empty if it printed nothing)."""
        return "\n".join(self.output.get(rank, []))


def torchrun(
    script: str | os.PathLike,
    nproc: int = 2,
    args: tuple | list = (),
    timeout: float = 300,
    env: dict[str, str] | None = None,
    echo: bool = True,
) -> LaunchResult:
    """Run ``script`` on ``nproc`` local ranks with torchrun; return their output, or raise naming the failed rank.

    Args:
        script: path of the Python file to run on every rank.
        nproc: number of ranks (processes) on this machine, an int >= 1.
        args: command-line arguments for the script, as a list (``["--steps", "3"]``).
        timeout: seconds after which the whole job (torchrun and every rank) is killed.
        env: environment variables to add for the ranks. ``OMP_NUM_THREADS`` defaults
            to the number of cores divided by ``nproc``.
        echo: print each rank's lines as they arrive, tagged ``[rank r]``; a traceback
            shows as its last frame and its exception.

    Returns:
        A :class:`LaunchResult` with every rank's output lines.

    Raises:
        FileNotFoundError: there is no file at ``script``.
        ValueError: ``nproc`` is not an int >= 1, or ``timeout`` is not positive.
        TypeError: ``args`` is one string rather than a list.
        RankFailedError: a rank failed; the error names it and its exception, or the
            signal or exit code that ended it.
        TimeoutError: the job outlived ``timeout``; every process of it was killed.
    """
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no script at {script}: pass the path of a .py file")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(args, (str, bytes, os.PathLike)):
        raise TypeError(f"args must be a list of arguments, e.g. ['--steps', '3'], not one string: got {args!r}")

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--tee=3", str(script), *map(str, args)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=_rank_environment(nproc, env), start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()

    result = LaunchResult(returncode=-1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _kill_tree(process)
            raise TimeoutError(
                f"{script.name} did not finish within {timeout} s on {nproc} ranks, so every process of it "
                f"was killed. Last lines:\n{_tail(result)}"
            ) from None
        if line is None:
            break
        _route(line.rstrip("\n"), result, echo)
    result.returncode = process.wait()
    if result.returncode != 0:
        rank = _failed_rank(result)
        silent = tuple(r for r in range(nproc) if r != rank and not any(
            line.startswith("Traceback") for line in result.output.get(r, [])))
        raise RankFailedError(rank, _exception_of(result, rank), _tail(result, 40), silent)
    return result


def _rank_environment(nproc: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # Without a limit every rank starts one thread per core and they fight over the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _route(line: str, result: LaunchResult, echo: bool) -> None:
    match = _RANK_LINE.match(line)
    if match is None:
        result.launcher_log.append(line)
        return
    rank, text = int(match.group(1)), match.group(2)
    lines = result.output.setdefault(rank, [])
    lines.append(text)
    if echo:
        for shown in _shown_lines(lines):
            print(f"[rank {rank}] {shown}", flush=True)


def _shown_lines(lines: list[str]) -> list[str]:
    """What to echo for the newest line: a traceback shrinks to its last frame and its exception.

    Every rank of a failing job prints a traceback; in a notebook a screenful
    of frames per rank hides the one line that matters. The full text stays
    in the result and in RankFailedError.output.
    """
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    if not starts:
        return [lines[-1]]
    traceback = lines[starts[-1]:]
    ends = [i for i, line in enumerate(traceback) if i > 0 and line and not line.startswith(" ")]
    if not ends:
        return []  # inside the traceback: wait for the exception line that ends it
    if ends[0] < len(traceback) - 1:
        return [lines[-1]]  # the traceback ended earlier; this is ordinary output
    frames = [line.strip() for line in traceback if line.lstrip().startswith("File ")]
    return frames[-1:] + [traceback[-1]]


def _root_cause(result: LaunchResult) -> re.Match | None:
    return _ROOT_CAUSE.search("\n".join(result.launcher_log))


def _failed_rank(result: LaunchResult) -> int | None:
    match = _root_cause(result)
    if match:
        return int(match.group(1))
    with_traceback = [rank for rank, lines in sorted(result.output.items()) if any(l.startswith("Traceback") for l in lines)]
    return with_traceback[0] if with_traceback else None


def _exception_of(result: LaunchResult, rank: int | None) -> str:
    """The exception line that ends the rank's last traceback: 'ValueError: ...'."""
    lines = result.output.get(rank, []) if rank is not None else []
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    if starts:
        # A rank's stdout and stderr reach torchrun separately, so a print may land
        # after (or inside) the traceback: look for the line that names an exception.
        after = [line for line in lines[starts[-1] + 1:] if line and not line.startswith(" ")]
        named = [line for line in after if _EXCEPTION_LINE.match(line)]
        if named or after:
            return (named or after)[0]
    match = _root_cause(result)
    if match is None:
        return f"torchrun exited with {result.returncode} and the rank printed no Python traceback"
    code = match.group(2)
    signal = match.group(3) or (f"signal {-int(code)}" if int(code) < 0 else None)  # torchrun names only the common ones
    if signal:
        return (f"exit code {code} ({signal}), no Python traceback: it was killed by a signal or aborted in "
                "native code (SIGKILL often means out of memory)")
    return f"exit code {code}, no Python traceback: the script called sys.exit or os._exit with it"


def _tail(result: LaunchResult, n: int = 20) -> str:
    lines = [f"[rank {rank}] {line}" for rank, rank_lines in sorted(result.output.items()) for line in rank_lines[-n:]]
    return "\n".join(lines[-n:] + result.launcher_log[-n:])


def _kill_tree(process: subprocess.Popen) -> None:
    # torchrun starts each rank in a session of its own, so killing torchrun's
    # process group is not enough: find every descendant first.
    victims = [process.pid, *_descendants(process.pid)]
    for pid in victims:
        _signal(pid, signal.SIGTERM)
    try:
        process.wait(timeout=_TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in victims + _descendants(process.pid):
        _signal(pid, signal.SIGKILL)
    process.wait()


def _descendants(pid: int) -> list[int]:
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: torchrun forwards SIGTERM to its ranks itself
        return []
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
