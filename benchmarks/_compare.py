"""Run a benchmark script on two checkouts, alternating, in one invocation.

A script that supports ``--measure`` (print one run's figures as a JSON object of numbers)
calls :func:`compare` to run it on its own checkout and on ``--baseline PATH``, each run in a
fresh process whose ``PYTHONPATH`` is that checkout, alternating so that drift on a shared
machine hits both alike. The medians come back, with every run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # this checkout


def run_tree(script: str, tree: Path, args: list[str]) -> dict[str, float]:
    # the tree first; whatever the caller's path held (e.g. wheels unpacked for this machine) after
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
    )
    cmd = [sys.executable, script, "--measure", *args]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed on {tree}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def compare(
    script: str, baseline: Path | None, args: list[str], rounds: int, json_path: str | None
) -> dict[str, dict[str, float]]:
    """Run ``script`` ``rounds`` times on each checkout; write every run and the medians to
    ``json_path`` (if given); return the medians keyed by ``baseline`` / ``this checkout``."""
    trees = {"this checkout": HERE}
    if baseline is not None:
        trees = {"baseline": baseline.resolve(), "this checkout": HERE}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            runs[name].append(run_tree(script, tree, args))
    medians = {
        name: {case: statistics.median(r[case] for r in rs) for case in rs[0]}
        for name, rs in runs.items()
    }
    if json_path:
        report = {
            "date": date.today().isoformat(),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "python": sys.version.split()[0],
            "command": " ".join(sys.argv),
            "rounds": rounds,
            "trees": {name: str(tree) for name, tree in trees.items()},
            "median": medians,
            "runs": runs,
        }
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return medians


def print_table(medians: dict[str, dict[str, float]], unit: str, width: int = 34) -> None:
    names = list(medians)
    header = f"{'case':<{width}}" + "".join(f"{n + f' ({unit})':>24}" for n in names)
    print(header + (f"{'ratio':>8}" if len(names) == 2 else ""))
    for case in medians[names[-1]]:
        row = f"{case:<{width}}" + "".join(
            f"{medians[n].get(case, float('nan')):>24,.2f}" for n in names
        )
        if len(names) == 2 and medians[names[0]].get(case):
            row += f"{medians[names[1]][case] / medians[names[0]][case]:>8.2f}"
        print(row)
