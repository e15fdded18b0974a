"""The kv* binaries of a build: finding them, running them, reading what they report.

A driver takes `--build DIR` (default: $KV_BUILD_DIR, else the repository's build/) and finds the
tools in DIR/bin. Every run captures the tool's output; a tool that fails ends the driver with
one line naming the tool, its exit status and its last error line(s), not a traceback.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from . import ROOT

PROGRAM = os.path.basename(sys.argv[0]) or "kvbench"
MODELS = pathlib.Path(os.environ.get("KV_MODELS_DIR", ROOT.parent / "shared" / "models"))


def default_build():
    return os.environ.get("KV_BUILD_DIR", str(ROOT / "build"))


def add_build_argument(parser):
    parser.add_argument("--build", default=default_build(),
                        help="the build whose bin/ holds the tools (default: $KV_BUILD_DIR, "
                             "else build/; now %(default)s)")


def fail(message):
    """Ends the driver with `PROGRAM: message`, exit status 1."""
    sys.exit(f"{PROGRAM}: {message}")


class Tools:
    """The tools of one build: `tools.path("kvbake")`, `tools.run([...])`."""

    def __init__(self, build):
        self.build = pathlib.Path(build)
        self.bin = self.build / "bin"

    def path(self, name):
        """The binary's path; ends the driver if the build lacks it."""
        path = self.bin / name
        if not os.access(path, os.X_OK):
            fail(f"no {path}: build first (scripts/build) or pass --build DIR")
        return str(path)

    def __getitem__(self, name):
        return self.path(name)


def _command(command):
    return [str(c) for c in command]


def _failure(command, returncode, stderr, context=None):
    what = os.path.basename(str(command[0]))
    where = f" on {context}" if context else ""
    lines = [line for line in (stderr or "").strip().splitlines() if line.strip()]
    detail = "\n".join(lines[-5:]) if lines else "(no error output)"
    fail(f"{what} failed{where} (exit {returncode}): {detail}")


def run(command, context=None, **kwargs):
    """Runs a command with its stdout and stderr captured as text; returns the CompletedProcess.
    A non-zero exit ends the driver (`context` names the sample or file in the message)."""
    command = _command(command)
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        _failure(command, result.returncode, result.stderr, context)
    return result


def timed(command, context=None, **kwargs):
    """As run(); returns (CompletedProcess, wall-clock seconds)."""
    started = time.perf_counter()
    result = run(command, context, **kwargs)
    return result, time.perf_counter() - started


def measured(command):
    """Runs a command, stdout discarded; returns its stderr and its peak resident set in bytes
    (the kernel's maxrss of that process, from wait4)."""
    command = _command(command)
    with tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read().decode(errors="replace")
    if returncode != 0:
        _failure(command, returncode, text)
    return text, usage.ru_maxrss * 1024


def stats(text):
    """The JSON object of `kvserve-once --stats -` (or kvbake's --json, ...) in a tool's output:
    everything from its first "{" on, after any warnings; {} when there is none."""
    start = text.find("{")
    return json.loads(text[start:]) if start >= 0 else {}


def stats_file(path):
    """The JSON a tool wrote with `--stats FILE`."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
