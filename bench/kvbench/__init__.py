"""kvtools' benchmark and evaluation drivers' shared code.

    tasks    the evaluation tasks and the demo model's training text (bench/kvtasks)
    tools    the kv* binaries of a build: where they are, running them, their --stats JSON
    models   random-weight models of a given shape, written as Hugging Face folders
    results  tables on stdout and JSON under bench/results/

The drivers are the executables beside this package (bench/eval-tasks, bench/bench-runtime,
...); each imports it as `kvbench`, its own folder being first on sys.path.
"""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
