#!/usr/bin/env python3
"""Regenerates the results table of docs/performance.md from bench/results/*.json.

The table sits between the markers <!-- perf-table:begin --> and <!-- perf-table:end -->; everything
else in the file is left as written. For every (case, routing, phase, timing, sms) of the newest run
that has it, it lists each backend's median time and bandwidth, and the ratio to the baseline
measured in the same run: for dispatch/combine the speed-up over the `alltoall` backend, for expert
GEMMs the fraction of the dense cuBLAS GEMM's TFLOP/s, for permute/unpermute the fraction of the
device copy's HBM bandwidth.
"""
import glob
import json
import os
import sys

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"


def fmt(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def pass_of(r):
    """The record's pass (experts: forward/backward), or for a hybridep dispatch call its mode and for
    a deepep record its layout, which the bench states in the note: blocking and budget calls,
    rank-major and expert-major calls are separate rows; a call started on a
    busy stream with the ranks lined up (`"start": "aligned"`) is a row of its own too."""
    if r.get("pass"):
        return r["pass"]
    note = r.get("note", "")
    mode = ""
    if r["phase"] == "dispatch" and r["timing"] == "call" and r["backend"] == "hybridep":
        mode = "budget" if "budget mode" in note else "blocking"
    if r["backend"] == "deepep":  # its notes start with the layout
        mode = note.split(":", 1)[0]
    if r.get("start"):
        mode = f"{mode}, {r['start']} start" if mode else f"{r['start']} start"
    return mode


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
            key = (r["case"], r["routing"], r["phase"], pass_of(r), r["timing"], r["backend"], r["sms"],
                   r["tokens_per_rank"])
            latest[key] = (run, r)
    lines = ["| case | routing | phase | pass | timing | backend | SMs | median us | algo GB/s | NVLink GB/s | TFLOP/s | HBM GB/s | saved MB | vs baseline | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def baseline(run, r):
        same_run = [x for x in run["records"] if x["case"] == r["case"]]
        if r["phase"] in ("dispatch", "combine", "dispatch+combine") and r["backend"] != "alltoall":
            for x in same_run:
                if (x["backend"] == "alltoall" and x["phase"] == r["phase"] and x["routing"] == r["routing"]
                        and x["timing"] == r["timing"] and x["tokens_per_rank"] == r["tokens_per_rank"]
                        and x.get("start") == r.get("start")):
                    return f"{x['time_us']['median'] / r['time_us']['median']:.2f}x faster than alltoall"
        if r.get("tflops") and r["phase"] == "experts":
            for x in same_run:
                if x["phase"] == "dense_gemm" and x.get("tflops"):
                    return f"{100 * r['tflops'] / x['tflops']:.0f}% of dense GEMM"
        if r["case"] == "gather-gemm" and r.get("tflops") and r["backend"] != "cublas-dense":
            # The gathered kernel against itself on contiguous rows (same A load), the rest against dense.
            kernel = next((k for k in ("gather", "wgrad") if r["backend"].startswith(k)), None)
            gathered = kernel is not None and not r["backend"].startswith(kernel + "-contiguous")
            ref = r["backend"].replace(kernel, kernel + "-contiguous", 1) if gathered else "cublas-dense"
            for x in same_run:
                if x["backend"] == ref and x["phase"] == r["phase"] and (ref == "cublas-dense" or x["routing"] == r["routing"]):
                    return f"{100 * r['tflops'] / x['tflops']:.1f}% of {ref}"
        if r.get("hbm_gbps") and r["phase"] in ("permute", "unpermute"):
            for x in same_run:
                if x["phase"] == "copy" and x.get("hbm_gbps") and x["routing"] == r["routing"]:
                    return f"{100 * r['hbm_gbps'] / x['hbm_gbps']:.0f}% of copy"
        return "-"

    for key in sorted(latest, key=lambda k: tuple(str(x) for x in k)):
        run, r = latest[key]
        lines.append(f"| {r['case']} | {r['routing']} | {r['phase']} | {pass_of(r) or '-'} | {r['timing']} | "
                     f"{r['backend']} | {r['sms'] if r['sms'] is not None else '-'} | {fmt(r['time_us']['median'])} | "
                     f"{fmt(r.get('algo_gbps'))} | {fmt(r.get('nvlink_gbps'))} | {fmt(r.get('tflops'))} | "
                     f"{fmt(r.get('hbm_gbps'))} | {fmt(r.get('saved_mb'))} | {baseline(run, r)} | {run['run_id']} ({run['device']}) |")
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
