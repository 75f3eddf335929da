"""Resolve the README's install commands as a machine outside this workplace would.

Each command runs as ``pip install --dry-run --report`` in a fresh scratch venv with an
isolated pip configuration (no config file, no find-links, no constraints), so only PyPI
and the indexes on the command line are used; the summary says what it would install:
how many packages, the torch family, any CUDA wheels, and from which hosts.

1. ``torch==2.13.0`` from PyPI alone: what a bare ``pip install torch==2.13.0`` gets;
2. README step 1: ``torch==2.13.0`` from PyTorch's CPU index;
3. README step 2 (``-e '.[dev,vllm]'``) in a venv where step 1 was really installed
   (from the CPU index, or from ``--torch-wheel``, the same wheel file, where that
   index cannot be reached);
4. README step 2 without step 1, which shows why step 1 comes first.

    python tools/plain_pypi_dry_run.py [--torch-wheel PATH]

Nothing is installed but step 1's torch, into the scratch venv, which is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

STEP1 = ["torch==2.13.0", "--index-url", CPU_INDEX]
STEP2 = ["-e", f"{ROOT}[dev,vllm]"]


def isolated_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_CONSTRAINT="")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def summarize(report: dict[str, object]) -> dict[str, object]:
    install = report["install"]
    assert isinstance(install, list)
    names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in install}
    cuda = sorted(n for n in names if n.startswith(("nvidia-", "cuda-")))
    hosts = sorted(
        {
            i["download_info"]["url"].split("/")[2]
            for i in install
            if "url" in i.get("download_info", {})
        }
    )
    return {
        "packages": len(names),
        "torch": names.get("torch"),
        "torch family": {n: v for n, v in names.items() if n.startswith("torch")},
        "cuda wheels": cuda,
        "hosts": hosts,
    }


def dry_run(pip: list[str], cmd: list[str], tmp: Path, title: str) -> None:
    out = tmp / "report.json"
    proc = subprocess.run(
        [*pip, "install", "--dry-run", "--quiet", "--report", str(out), *cmd],
        capture_output=True, text=True, env=isolated_env(), cwd=tmp, check=False,
    )  # fmt: skip
    shown = " ".join(c.replace(str(ROOT), ".") for c in cmd)
    print(f"\n## {title}\n$ pip install --dry-run {shown}")
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        retries = sum("Retrying" in line for line in proc.stderr.splitlines())
        print(f"FAILED ({proc.returncode}), after {retries} retries:\n" + "\n".join(errors))
        return
    print(json.dumps(summarize(json.loads(out.read_text())), indent=1))


def scratch_venv(python: str, where: Path) -> list[str]:
    subprocess.run([python, "-m", "venv", str(where)], check=True)
    pip = [str(where / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True, env=isolated_env())
    return pip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the Python of the scratch venv")
    parser.add_argument(
        "--torch-wheel",
        help="the CPU wheel of torch 2.13.0, for step 3 if the index is unreachable",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        pip = scratch_venv(args.python, tmp / "venv")
        version = subprocess.run([*pip, "--version"], capture_output=True, text=True, check=True)
        print(version.stdout.strip())
        dry_run(pip, ["torch==2.13.0"], tmp, "1. torch from PyPI alone")
        dry_run(pip, STEP1, tmp, "2. README step 1: torch from PyTorch's CPU index")
        dry_run(pip, STEP2, tmp, "4. README step 2 without step 1")
        installed = subprocess.run(
            [*pip, "install", "--quiet", *STEP1], env=isolated_env(), check=False
        )
        how = "from the CPU index"
        if installed.returncode != 0 and args.torch_wheel:
            subprocess.run(
                [*pip, "install", "--quiet", args.torch_wheel], env=isolated_env(), check=True
            )
            how = f"from {Path(args.torch_wheel).name} (the CPU index was unreachable)"
        elif installed.returncode != 0:
            print("\nstep 1 could not be installed; pass --torch-wheel to run step 3")
            return 1
        dry_run(pip, STEP2, tmp, f"3. README step 2 after step 1 (torch installed {how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
