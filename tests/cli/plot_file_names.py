#!/usr/bin/env python3
"""`flexep bench --plot` hands its file names to the plotting script as arguments, never through a
shell: a result file whose name holds shell syntax (quotes, `;`, `$VAR`) is only a name. Before,
such a name ran the command inside it. Usage: plot_file_names.py <path to flexep>, from any folder
(it runs flexep from the repository's root, where scripts/plot_bench.py is). Exits 1 naming what
failed.
"""
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main() -> int:
    flexep = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "ran")
        name = os.path.join(tmp, "a'; touch \"$MARKER\"; echo 'b.json")
        pathlib.Path(name).write_text("{}")
        env = dict(os.environ, MARKER=marker)
        r = subprocess.run([flexep, "bench", "--plot", name, "--plot-out", os.path.join(tmp, "plots")], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
        if os.path.exists(marker):
            print(f"FAILED: the file name ran as a shell command (exit {r.returncode}):\n{r.stdout}{r.stderr}")
            return 1
        if r.returncode not in (0, 3):
            print(f"FAILED: exit {r.returncode}, want 0 (plotted) or 3 (the script failed):\n{r.stdout}{r.stderr}")
            return 1
    print("a file name with shell syntax stayed a file name")
    return 0


if __name__ == "__main__":
    sys.exit(main())
