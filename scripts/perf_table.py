#!/usr/bin/env python3
"""Regenerates the results table of docs/performance.md from bench/results/*.json.

The table sits between the markers <!-- perf-table:begin --> and <!-- perf-table:end -->; everything
else in the file is left as written. For every (case, routing, phase, timing, sms) of the newest run
that has it, it lists each backend's median time and bandwidth, and the ratio to the `alltoall`
baseline measured in the same run.
"""
import glob
import json
import os
import sys

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"


def fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for p in sorted(glob.glob(os.path.join(root, "bench", "results", "*.json"))):
        with open(p) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda r: r["date"])
    latest = {}
    for run in runs:
        for r in run["records"]:
            key = (r["case"], r["routing"], r["phase"], r["timing"], r["backend"], r["sms"], r["tokens_per_rank"])
            latest[key] = (run, r)
    lines = ["| case | routing | phase | timing | backend | SMs | median us | algo GB/s | NVLink GB/s | TFLOP/s | HBM GB/s | vs alltoall | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(latest, key=lambda k: tuple(str(x) for x in k)):
        run, r = latest[key]
        base = None
        for k2, (run2, r2) in latest.items():
            if run2 is run and r2["backend"] == "alltoall" and k2[:4] == key[:4] and k2[6] == key[6]:
                base = r2["time_us"]["median"]
        ratio = f"{base / r['time_us']['median']:.2f}x" if base and r["backend"] != "alltoall" and r["time_us"]["median"] else "-"
        lines.append(f"| {r['case']} | {r['routing']} | {r['phase']} | {r['timing']} | {r['backend']} | "
                     f"{r['sms'] if r['sms'] is not None else '-'} | {fmt(r['time_us']['median'])} | "
                     f"{fmt(r.get('algo_gbps'))} | {fmt(r.get('nvlink_gbps'))} | {fmt(r.get('tflops'))} | "
                     f"{fmt(r.get('hbm_gbps'))} | {ratio} | {run['run_id']} ({run['device']}) |")
    doc = os.path.join(root, "docs", "performance.md")
    text = open(doc).read() if os.path.exists(doc) else f"# Performance\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    open(doc, "w").write(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)
    print(f"docs/performance.md: {len(lines) - 2} rows from {len(runs)} runs", file=sys.stderr)


if __name__ == "__main__":
    main()
