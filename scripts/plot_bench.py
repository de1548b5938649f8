#!/usr/bin/env python3
"""Charts of flexep benchmark results (bench/results/*.json, docs/benchmarks.md) as PNG files.

  bandwidth_vs_sms.png   algorithm GB/s of dispatch and combine against the SM count, per backend,
                         with the NVLink copy-engine line (393 GB/s one way on the 2-H200 machine)
  phase_times.png        median time of each phase by backend and case
"""
import argparse
import json
import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COPY_ENGINE_GBPS = 393.0


def load(paths):
    records = []
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        for r in run["records"]:
            r["_run"] = run["run_id"]
            r["_device"] = run["device"]
            records.append(r)
    return records


def code_version(run_id):
    """The commit a run measured: the third field of its id (date-time-commit[-pid])."""
    parts = run_id.split("-")
    return parts[2] if len(parts) > 2 else run_id


def bandwidth_vs_sms(records, out, case="dsv3-ep2", routing="uniform"):
    """Dispatch/combine algorithm bandwidth of one case against the SM count: whole blocking calls
    (solid) and the kernels alone (dashed) per backend with an SM setting; backends without one are
    horizontal dotted lines in the phase's colour. A curve joins only points of one code version:
    the newest version's in full colour, SM counts only an older version measured as a faded curve
    of their own (labelled with its commit), so that a sweep is never read across two kernels."""
    points = defaultdict(dict)  # (backend, phase, timing) -> sms -> (gbps, version), newest run wins
    newest = {}  # (backend, phase, timing) -> version of its newest run
    flat = {}
    for r in records:  # oldest first: later records overwrite earlier points
        if (r["case"] != case or r["routing"] != routing or r["timing"] not in ("call", "kernel")
                or r["phase"] not in ("dispatch", "combine") or r.get("algo_gbps") is None):
            continue
        if "budget mode" in r.get("note", "") or r.get("start"):
            continue  # the blocking call from an idle stream is the one every run measured
        if r["sms"] is None:
            if r["timing"] == "call":
                flat[f"{r['backend']} {r['phase']}"] = r["algo_gbps"]
        else:
            key = (r["backend"], r["phase"], r["timing"])
            points[key][r["sms"]] = (r["algo_gbps"], code_version(r["_run"]))
            newest[key] = code_version(r["_run"])
    series = {}  # (backend, phase, timing, version, is_newest) -> {sms: gbps}
    for key, pts in points.items():
        for sms, (gbps, version) in pts.items():
            series.setdefault((*key, version, version == newest[key]), {})[sms] = gbps
    if not series and not flat:
        return None
    colour = {"dispatch": "C1", "combine": "C0"}
    fig, ax = plt.subplots(figsize=(9, 5))
    for (backend, phase, timing, version, is_newest), pts in sorted(series.items(), key=lambda kv: (not kv[0][4], kv[0])):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", color=colour[phase], alpha=1.0 if is_newest else 0.35,
                linestyle="-" if timing == "call" else "--",
                label=f"{backend} {phase} ({timing}, {version})" if is_newest
                else f"{backend} {phase} ({timing}, earlier code {version})")
    for key, v in sorted(flat.items()):
        phase = key.split()[-1]
        ax.axhline(v, linestyle=":", color="gray" if "nccl" in key else colour[phase],
                   label=key + " (call, no SM setting)")
    ax.axhline(COPY_ENGINE_GBPS, color="black", linestyle="--", label="NVLink copy engine, one way (393)")
    ax.set_xlabel("SMs")
    ax.set_ylabel("algorithm bandwidth (GB/s)")
    ax.set_title(f"{case}, {routing} routing")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    path = os.path.join(out, "bandwidth_vs_sms.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def phase_times(records, out):
    rows = defaultdict(dict)
    for r in records:
        if r["timing"] != "call" or r["phase"] not in ("dispatch", "combine", "dispatch+combine") or r.get("start"):
            continue
        rows[(r["case"], r["routing"], r["phase"])][r["backend"]] = r["time_us"]["median"]
    if not rows:
        return None
    keys = sorted(rows)
    backends = sorted({b for v in rows.values() for b in v})
    fig, ax = plt.subplots(figsize=(max(8, len(keys) * 0.9), 5))
    width = 0.8 / max(1, len(backends))
    for i, b in enumerate(backends):
        xs = [k + i * width for k in range(len(keys))]
        ax.bar(xs, [rows[k].get(b, 0) for k in keys], width, label=b)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels(["\n".join(k) for k in keys], fontsize=7)
    ax.set_ylabel("median time (us)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    path = os.path.join(out, "phase_times.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def layer_parts(records, out):
    latest = {}
    for r in records:  # files are given oldest first: keep the newest run of each layer case
        if r["phase"] == "layer_fwd_bwd" and r.get("parts_us"):
            latest[(r["case"], r["backend"])] = r
    layers = list(latest.values())
    if not layers:
        return None
    names = sorted({n for r in layers for n in r["parts_us"]})
    colors = {n: plt.cm.tab10(i) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(8, 2.2 + 0.6 * len(layers)))
    for i, r in enumerate(layers):
        left = 0.0
        for name in names:
            us = r["parts_us"].get(name, 0.0)
            ax.barh(i, us / 1000.0, left=left, color=colors[name], label=name if i == 0 else None)
            left += us / 1000.0
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([f"{r['case']} {r['backend']}" for r in layers], fontsize=8)
    ax.set_xlabel("forward + backward time (ms), by phase")
    ax.legend(fontsize=7, loc="lower right")
    path = os.path.join(out, "layer_phases.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="docs/img")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    records = load(a.files)
    for p in (bandwidth_vs_sms(records, a.out), phase_times(records, a.out), layer_parts(records, a.out)):
        if p:
            print("wrote", p)


if __name__ == "__main__":
    main()
