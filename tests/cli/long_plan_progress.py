#!/usr/bin/env python3
"""A long `flexep plan` shows its progress on stderr (when stderr is not a terminal: its size, then
about one line per tenth of the routing's pieces of 65536 tokens) and still prints the same plan on
stdout; `--quiet` and short plans print no progress; a huge plan (EP1024, 10 million tokens per
rank: hours of work) says so within seconds instead of running silently. Usage:
long_plan_progress.py <path to flexep>. Exits 1 naming what failed.
"""
import re
import subprocess
import sys
import time

LONG = ["plan", "--ranks", "16", "--tokens", "400000", "--experts", "64", "--topk", "8"]  # 5.1e7 slots, 112 pieces
SHORT = ["plan", "--ranks", "16", "--tokens", "4000"]
HUGE = ["plan", "--ranks", "1024", "--experts", "1024", "--tokens", "10000000"]


def run(flexep, args):
    r = subprocess.run([flexep] + args, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(args)} exited {r.returncode}:\n{r.stderr}")
    return r.stdout, r.stderr


def huge_plan_speaks(flexep, within=30.0):
    """The huge plan's size line and its first progress line (with the time left) arrive within
    `within` seconds; then it is stopped."""
    p = subprocess.Popen([flexep] + HUGE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    start, got = time.monotonic(), []
    try:
        while len(got) < 2 and time.monotonic() - start < within:
            line = p.stderr.readline()
            if not line:
                break
            got.append(line.strip())
    finally:
        p.kill()
        p.wait()
    took = time.monotonic() - start
    if len(got) < 2 or not got[0].startswith("plan: 1024 source ranks") or not got[1].startswith("plan: routing 1/"):
        return [f"huge plan: no size and progress lines within {within:.0f} s (after {took:.1f} s: {got})"]
    if "left" not in got[1] and "pieces" not in got[1]:
        return [f"huge plan: the first progress line says nothing useful: {got[1]}"]
    print(f"huge plan: spoke within {took:.1f} s: {got[1]}")
    return []


def main():
    flexep = sys.argv[1]
    failures = []
    out, err = run(flexep, LONG)
    if not err.startswith("plan: 16 source ranks x 400000 tokens x top-8 of 64 experts to route, in 112 pieces"):
        failures.append(f"long plan: no size line first on stderr:\n{err}")
    lines = [l for l in err.splitlines() if l.startswith("plan: routing")]
    if not lines or not re.match(r"plan: routing 112/112 ", lines[-1]):
        failures.append(f"long plan: no progress ending at 112/112 on stderr:\n{err}")
    if len(lines) > 16:  # the first, the tenths, the last, and one every 10 s on a slow machine
        failures.append(f"long plan: {len(lines)} progress lines, far more than one per tenth")
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
    failures += huge_plan_speaks(flexep)
    for f in failures:
        print("FAILED:", f)
    print("long plan progress: " + ("ok" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
