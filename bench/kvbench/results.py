"""Where results go: tables on stdout, JSON (and plots) under bench/results/.

Every driver prints its results as one Markdown table on stdout (progress goes to stderr) and
writes them with write_json(), atomically (a temporary file, then a rename), so that an
interrupted run never leaves half a result file. The JSON keeps every number the table shows
and the runs behind it; docs/ quotes them beside the command that produced them.
"""
import json
import os
import pathlib
import shlex
import sys

from . import ROOT

RESULTS = ROOT / "bench" / "results"


def default_path(name):
    """bench/results/NAME."""
    return str(RESULTS / name)


def add_json_argument(parser, default=None):
    """--json PATH; with a default, the driver always writes (bench/results/... by default)."""
    if default:
        parser.add_argument("--json", default=default_path(default),
                            help="write the results here (default: %(default)s)")
    else:
        parser.add_argument("--json", help="write the results here")


def write_text(path, text):
    """Writes a file atomically, creating its folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def write_json(path, data, indent=1, quiet=False):
    """Writes `data` as indented JSON with a final newline (atomically); says where on stderr."""
    if not path:
        return
    write_text(path, json.dumps(data, indent=indent) + "\n")
    if not quiet:
        print(f"wrote {shown(path)}", file=sys.stderr)


def shown(path):
    """A path as the user would type it: relative to the repository when inside it."""
    path = pathlib.Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def command_line():
    """This driver's command line as run from the repository root (results record it), quoted
    for a shell where an argument needs it (a question with spaces)."""
    return shlex.join([shown(sys.argv[0])] + sys.argv[1:])


def relative(path):
    """A path relative to the repository root (how results name models and adapters)."""
    return os.path.relpath(path, ROOT)


class Table:
    """A Markdown table printed row by row, so that a long run shows each row as it is measured.

        table = Table(["tokens", "ms"], align="rr")
        table.row([8192, "57.1"])
    """

    def __init__(self, columns, align=None, out=None):
        self.columns = list(columns)
        self.align = align or "l" * len(self.columns)
        self.out = out or sys.stdout
        self.started = False

    def header(self):
        print("| " + " | ".join(self.columns) + " |", file=self.out)
        print("|" + "|".join("---:" if a == "r" else "---" for a in self.align) + "|",
              file=self.out, flush=True)
        self.started = True

    def row(self, cells):
        if not self.started:
            self.header()
        print("| " + " | ".join(str(c) for c in cells) + " |", file=self.out, flush=True)


def print_table(columns, rows, align=None):
    """A whole Markdown table at once."""
    table = Table(columns, align)
    table.header()
    for cells in rows:
        table.row(cells)
