#!/usr/bin/env python3
"""A long `flexep plan` shows its progress on stderr (one line per tenth of the source ranks when
stderr is not a terminal) and still prints the same plan on stdout; `--quiet` and short plans print
no progress. Usage: long_plan_progress.py <path to flexep>. Exits 1 naming what failed.
"""
import subprocess
import sys

LONG = ["plan", "--ranks", "16", "--tokens", "400000", "--experts", "64", "--topk", "8"]  # 5.1e7 slots
SHORT = ["plan", "--ranks", "16", "--tokens", "4000"]


def run(flexep, args):
    r = subprocess.run([flexep] + args, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(args)} exited {r.returncode}:\n{r.stderr}")
    return r.stdout, r.stderr


def main():
    flexep = sys.argv[1]
    failures = []
    out, err = run(flexep, LONG)
    lines = [l for l in err.splitlines() if l.startswith("plan: routing")]
    if not lines or not lines[-1].startswith("plan: routing 16/16"):
        failures.append(f"long plan: no progress ending at 16/16 on stderr:\n{err}")
    if len(lines) > 16:
        failures.append(f"long plan: {len(lines)} progress lines, more than one per source rank")
    quiet_out, quiet_err = run(flexep, LONG + ["--quiet"])
    if quiet_err.strip():
        failures.append(f"--quiet: stderr not empty:\n{quiet_err}")
    if quiet_out != out:
        failures.append("--quiet: a different plan on stdout")
    if "rank 15:" not in out:
        failures.append(f"long plan: rank 15's line missing from stdout:\n{out[-500:]}")
    _, short_err = run(flexep, SHORT)
    if "plan: routing" in short_err:
        failures.append(f"short plan: progress printed:\n{short_err}")
    for f in failures:
        print("FAILED:", f)
    print("long plan progress: " + ("ok" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
