"""Run a script under torchrun from a notebook cell or a test: never hang, never leave a process behind.

    result = torchrun("train.py", nproc=2, args=["--steps", "10"])

torchrun (``python -m torch.distributed.run``) starts ``nproc`` ranks on this
machine (``--standalone`` picks a free port). Each rank's output is printed as
it arrives, tagged ``[rank r]``. If a rank fails, :class:`RankFailedError`
names the rank torchrun saw fail first (or the one gloo aborted on a collective
mismatch: the other ranks' errors follow from it) and carries its exception.
Python's faulthandler is on in every rank (``PYTHONFAULTHANDLER``, unless set
otherwise), so a rank that crashes natively (a segfault) is named with the
Python frames it was in.

However the call ends (the job finished or failed, it outlived ``timeout``,
torchrun itself died, Ctrl-C), no process of the job is left when it returns or
raises. Each launch marks the job's environment with a variable of its own, which
torchrun, its ranks and their children inherit, so that they are found in
``/proc`` even after torchrun died and its ranks (each in a session of its own)
lost their parent. Where there is no ``/proc`` (not Linux), torchrun's process
group is signalled, and torchrun passes SIGTERM on to its ranks.

Scripts choose their backend with :func:`dmuon_edu.distributed.session`: gloo
on CPU, NCCL when there is a GPU for every rank. A notebook must not
``mp.spawn`` functions it defines: spawned processes re-import ``__main__``,
which a notebook does not have as a file.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
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
# The output is waited for in pieces: a single wait cannot be longer than threading.TIMEOUT_MAX.
_WAIT_PIECE_S = 1.0
# Set, with a value unique to the launch, in the environment of every process of the job.
_JOB_VARIABLE = "DMUON_EDU_LAUNCH"
# gloo: "Timed out waiting 5000ms for recv operation", or, where another of the rank's waits timed out first
# and closed the connection, "Application timeout caused pair closure"; NCCL: "Watchdog caught collective
# operation timeout".
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting|timeout caused pair closure|collective operation timeout", re.I)
_SOURCE_LOCATION = re.compile(r"\[[^\]]+\.(?:cc|cpp|h):\d+\] ")
# gloo's words on a rank whose peer process ended (returned early, exited) while it waited for that peer.
_PEER_CLOSED = re.compile(r"Connection (?:closed|reset) by peer")
# An exception thrown on one of gloo's own threads reaches std::terminate, which prints these two lines and aborts:
#   terminate called after throwing an instance of 'gloo::EnforceNotMet'
#     what():  [enforce fail at .../gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4.
#     Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
_NATIVE_ABORT = re.compile(r"^terminate called after throwing an instance of '(gloo::\w+)'")
_ABORT_WHAT = re.compile(r"^\s*what\(\):\s*(.*)$")
_COLLECTIVE_MISMATCH = re.compile(r"collective mismatch|doesn't match expected size", re.I)
# A script that does not compile: Python prints where and the error, without a "Traceback" line above them.
_COMPILE_ERROR = re.compile(r"^(?:SyntaxError|IndentationError|TabError): ")
_FILE_LINE = re.compile(r'^\s*File "(.+)", line (\d+)')
# faulthandler's frames: '  File "/path/script.py", line 12 in train' (no comma before "in")
_FAULT_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')
_ENDPOINT = re.compile(r"^[\w.\-\[\]:]+:\d{1,5}$")


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
        elif _PEER_CLOSED.search(exception):
            others = (f"rank{'s' * (len(silent_ranks) > 1)} {', '.join(map(str, silent_ranks))} raised nothing"
                      if silent_ranks else "no other rank raised")
            message = (f"{who} failed: a peer closed its connection while {who} waited in a collective "
                       f"({_SOURCE_LOCATION.sub('', exception)}). {others}: a rank that ended first, returning early "
                       "(a rank-0-only branch that returns, a loop of fewer steps) or exiting, left it waiting. "
                       f"The failing rank is not the cause: make every rank run the same collectives to the end")
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
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
) -> LaunchResult:
    """Run ``script`` on ``nproc`` local ranks with torchrun; return their output, or raise naming the failed rank.

    Every argument is checked before anything starts. However the call ends, every
    process of the job (torchrun, its ranks and their children) has been stopped
    when it returns or raises: SIGTERM, then SIGKILL for any still there after 5 s.

    Args:
        script: path of the Python file to run on every rank.
        nproc: number of ranks (processes) on this machine, an int >= 1.
        args: command-line arguments for the script, a list (``["--steps", "3"]``) of
            strings, paths or numbers.
        timeout: seconds, finite and > 0, after which the whole job is killed.
        env: environment variables (str to str) to add for the ranks. ``OMP_NUM_THREADS``
            defaults to the number of cores divided by ``nproc``.
        echo: print each rank's lines as they arrive, tagged ``[rank r]``; a traceback
            shows as its last frame and its exception.
        nnodes: the number of machines (torchrun agents) of the job; this call starts
            one agent, this machine's. With more than one, start the same call on each
            machine (or several on one, for a test) with the same ``rdzv_endpoint``;
            the agents take node ranks in the order they join, and ranks are numbered
            node rank * ``nproc`` + local rank. Ranks in the output and in errors are
            this agent's local ranks.
        rdzv_endpoint: ``"host:port"`` of torchrun's c10d rendezvous, which every
            agent can reach (the first agent on that host serves it); required with
            ``nnodes`` > 1. None with one node: ``--standalone`` picks a free port.

    Returns:
        A :class:`LaunchResult` with every rank's output lines.

    Raises:
        TypeError: ``script`` is not a path (a str or an os.PathLike).
        FileNotFoundError: there is no file at ``script``.
        ValueError: ``nproc`` or ``nnodes`` is not an int >= 1, ``timeout`` is not a finite
            number > 0, or ``nnodes`` > 1 comes without a ``"host:port"`` ``rdzv_endpoint``.
        TypeError: ``args`` is one string rather than a list, or holds something other
            than strings, paths and numbers; ``env`` is not a dict of strings to
            strings; ``echo`` is not a bool.
        RankFailedError: a rank failed; the error names it and its exception (a
            script that does not compile names its SyntaxError), or the signal or exit
            code that ended it (a native abort in gloo is named as such).
        TimeoutError: the job outlived ``timeout``.
        RuntimeError: torchrun itself was killed (by a signal) before its ranks ended.
    """
    if not isinstance(script, (str, os.PathLike)):
        raise TypeError(f"script must be the path of a .py file (a str or a Path), got {script!r}")
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no script at {script}: pass the path of a .py file")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, finite, e.g. timeout=300; got {timeout!r}")
    if isinstance(args, (str, bytes, os.PathLike)):
        raise TypeError(f"args must be a list of arguments, e.g. ['--steps', '3'], not one string: got {args!r}")
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"args must be a list of arguments, e.g. ['--steps', '3']; got {args!r}")
    for i, arg in enumerate(args):
        if isinstance(arg, bool) or not isinstance(arg, (str, os.PathLike, numbers.Real)):
            raise TypeError(f"args[{i}] is {arg!r}: pass every argument as a string, a path or a number")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                              for k, v in env.items())):
        raise TypeError(f"env must be a dict of strings to strings, e.g. {{'OMP_NUM_THREADS': '1'}}; got {env!r}")
    if not isinstance(echo, bool):
        raise TypeError(f"echo must be True or False, got {echo!r}")
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        raise ValueError(f"nnodes must be an int >= 1 (the number of machines), got {nnodes!r}")
    if rdzv_endpoint is None and nnodes > 1:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint='host:port', an address every machine can reach, "
                         "the same in every machine's call")
    if rdzv_endpoint is not None and not (isinstance(rdzv_endpoint, str) and _ENDPOINT.match(rdzv_endpoint)):
        raise ValueError(f"rdzv_endpoint must be 'host:port', e.g. '10.0.0.1:29400', got {rdzv_endpoint!r}")

    rendezvous = (["--standalone"] if rdzv_endpoint is None else
                  [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"])
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}",
               "--tee=3", str(script), *map(str, args)]
    job = uuid.uuid4().hex
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=_rank_environment(nproc, env, job), start_new_session=True)
    try:
        return _follow(process, script, nproc, timeout, echo)
    finally:
        _end_job(process, job)


def _follow(process: subprocess.Popen, script: Path, nproc: int, timeout: float, echo: bool) -> LaunchResult:
    """Route torchrun's output until it exits; raise for a failed rank, a dead torchrun or the timeout."""
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    result = LaunchResult(returncode=-1)
    deadline = time.monotonic() + timeout

    def timed_out() -> TimeoutError:
        return TimeoutError(f"{script.name} did not finish within {timeout} s on {nproc} ranks, so every process "
                            f"of it was killed. Last lines:\n{_tail(result)}")

    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timed_out()
        try:
            line = lines.get(timeout=min(remaining, _WAIT_PIECE_S))
        except queue.Empty:
            continue
        if line is None:  # torchrun closed its output: it has ended, or is about to
            break
        _route(line.rstrip("\n"), result, echo)
    try:
        result.returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise timed_out() from None
    if result.returncode < 0:
        raise RuntimeError(
            f"torchrun itself was killed ({_signal_name(-result.returncode)}) while running {script.name} on {nproc} "
            "ranks, so every process of the job was killed too. Something outside the job ended it: the "
            f"out-of-memory killer, or a kill command. Last lines:\n{_tail(result)}")
    if result.returncode != 0:
        rank = _failed_rank(result)
        silent = tuple(r for r in range(nproc) if r != rank and not any(
            line.startswith("Traceback") for line in result.output.get(r, [])))
        raise RankFailedError(rank, _exception_of(result, rank), _tail(result, 40), silent)
    return result


def _rank_environment(nproc: int, extra: dict[str, str] | None, job: str) -> dict[str, str]:
    env = dict(os.environ)
    # Without a limit every rank starts one thread per core and they fight over the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank that crashes natively prints where, in Python
    env.update(extra or {})
    env[_JOB_VARIABLE] = job
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
    # A rank that gloo aborted on a collective mismatch is the cause; the others' errors
    # ("Connection reset by peer") follow from it, even when torchrun saw one of them first.
    mismatched = [rank for rank, lines in sorted(result.output.items())
                  if (abort := _gloo_abort(lines)) and _COLLECTIVE_MISMATCH.search(abort[1])]
    if mismatched:
        return mismatched[0]
    match = _root_cause(result)
    if match:
        return int(match.group(1))
    with_traceback = [rank for rank, lines in sorted(result.output.items()) if any(l.startswith("Traceback") for l in lines)]
    return with_traceback[0] if with_traceback else None


def _exception_of(result: LaunchResult, rank: int | None) -> str:
    """What ended the rank, one line: the exception that ends its last traceback ('ValueError: ...'), its
    SyntaxError, gloo's native abort, or the signal or exit code torchrun reported."""
    lines = result.output.get(rank, []) if rank is not None else []
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    if starts:
        # A rank's stdout and stderr reach torchrun separately, so a print may land
        # after (or inside) the traceback: look for the line that names an exception.
        after = [line for line in lines[starts[-1] + 1:] if line and not line.startswith(" ")]
        named = [line for line in after if _EXCEPTION_LINE.match(line)]
        if named or after:
            return (named or after)[0]
    compile_errors = [i for i, line in enumerate(lines) if _COMPILE_ERROR.match(line)]
    if compile_errors:
        i = compile_errors[-1]
        where = [match for line in lines[max(0, i - 4):i] if (match := _FILE_LINE.match(line))]
        return lines[i] + (f" ({where[-1].group(1)}, line {where[-1].group(2)})" if where else "")
    abort = _gloo_abort(lines)
    if abort:
        kind, what = abort
        if _COLLECTIVE_MISMATCH.search(what):
            return (f"gloo aborted it (SIGABRT, {kind}: {what}): the ranks called different collectives, or the same "
                    "collective with tensors of different sizes. Make every rank call the same collectives in the "
                    "same order with the same shapes; run again with env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'} to "
                    "have the first collective that differs named, with each rank's shapes")
        peer = " (another rank exited or crashed first: its output says why)" if "by peer" in what else ""
        return f"gloo aborted it (SIGABRT, {kind}: {what}){peer}"
    match = _root_cause(result)
    if match is None:
        return f"torchrun exited with {result.returncode} and the rank printed no Python traceback"
    code = match.group(2)
    name = match.group(3) or (f"signal {-int(code)}" if int(code) < 0 else None)  # torchrun names only the common ones
    if name == "SIGKILL":
        return f"exit code {code} (SIGKILL), no Python traceback: it was killed, most often by the out-of-memory killer"
    if name == "SIGABRT":
        return f"exit code {code} (SIGABRT), no Python traceback: it aborted in native code (its output may say where)"
    if name:
        where = _fatal_frame(lines)
        return (f"exit code {code} ({name}) in {where} (Python's faulthandler: the innermost Python frames)" if where
                else f"exit code {code} ({name}), no Python traceback: it was killed by a signal")
    return f"exit code {code}, no Python traceback: the script called sys.exit or os._exit with it"


def _gloo_abort(lines: list[str]) -> tuple[str, str] | None:
    """(gloo's exception type, its message without the source location) if gloo aborted the rank natively."""
    for i, line in enumerate(lines):
        match = _NATIVE_ABORT.match(line)
        if match:
            # what() comes right after, unless a line from the rank's other stream landed in between.
            what = [m.group(1) for later in lines[i + 1:i + 3] if (m := _ABORT_WHAT.match(later))]
            return match.group(1), _SOURCE_LOCATION.sub("", what[0] if what else "")
    return None


def _fatal_frame(lines: list[str]) -> str | None:
    """Where Python's faulthandler (on in every rank) saw the crashing thread: its innermost frame and the one that
    called it, or None."""
    for i, line in enumerate(lines):
        if line.startswith("Current thread"):
            frames = [m for later in lines[i + 1:i + 3] if (m := _FAULT_FRAME.match(later))]
            if frames:
                return ", called from ".join(f"{m.group(3)} ({m.group(1)}, line {m.group(2)})" for m in frames)
    return None


def _tail(result: LaunchResult, n: int = 20) -> str:
    lines = [f"[rank {rank}] {line}" for rank, rank_lines in sorted(result.output.items()) for line in rank_lines[-n:]]
    return "\n".join(lines[-n:] + result.launcher_log[-n:])


def _end_job(process: subprocess.Popen, job: str) -> None:
    """Stop every process of the job: SIGTERM, up to _TERMINATE_GRACE_S to exit, then SIGKILL; return once
    none of them runs any more."""
    seen: set[int] = set()  # the job's pids: a dying process loses its environment (our mark) before it is dead
    _signal_job(process, job, signal.SIGTERM, seen)
    try:
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        while (process.poll() is None or _job_pids(job) or _running(seen)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:  # also after a second Ctrl-C during the grace period
        _signal_job(process, job, signal.SIGKILL, seen)
        process.wait()
        # SIGKILL cannot be refused, but a loaded machine takes moments to end a process: wait for that.
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        while _running(seen) and time.monotonic() < deadline:
            time.sleep(0.01)


def _signal_job(process: subprocess.Popen, job: str, sig: int, seen: set[int]) -> None:
    if process.poll() is None:  # until torchrun is reaped, its pid (which names its process group) is not reused
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
    for pid in _job_pids(job):
        seen.add(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _running(pids: set[int]) -> bool:
    """Whether any of ``pids`` still runs: an ended process that is not yet reaped (a zombie) does not."""
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):  # gone
            continue
    return False


def _job_pids(job: str) -> list[int]:
    """Pids of the live processes whose environment carries the job's mark; [] where there is no /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    mark = f"{_JOB_VARIABLE}={job}".encode()
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                # An exited process that is not yet reaped has an empty environment: it does not count.
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or another user's
                continue
    return pids


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
