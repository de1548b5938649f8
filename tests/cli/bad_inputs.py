#!/usr/bin/env python3
"""The `flexep` program on bad input: every case must exit with the documented code (2: invalid
input) within its deadline and print an error that names the field or option, the value as given
and what is allowed. Usage: bad_inputs.py <path to flexep>. Exits 1 listing the cases that failed.
"""
import json
import os
import subprocess
import sys
import tempfile

# (command line, config file body or None, words the error must contain)
CASES = [
    ("train --steps 0", None, ["--steps", "from 1 to 1000000000", "got 0"]),
    ("train --steps abc", None, ["--steps", "whole number", "'abc'"]),
    ("train --dim 0", None, ["--dim", "from 1 to 1048576"]),
    ("train --seed -1", None, ["--seed", "from 0 to", "got -1"]),
    ("train --ranks 2.7", None, ["--ranks", "from 1 to 64", "'2.7'"]),
    ("train --lr nan", None, ["--lr", "finite number above 0", "nan"]),
    ("train --lr inf", None, ["--lr", "finite number above 0", "inf"]),
    ("train --lr -1", None, ["--lr", "finite number above 0", "-1"]),
    ("plan --budget -5", None, ["--budget", "from 0 to", "-5"]),
    ("plan --ranks 0", None, ["--ranks", "from 1 to 1024"]),
    ("bench --reps 0", None, ["--reps", "from 1 to 1000000"]),
    ("bench --backend bogus", None, ["--backend", "bogus", "all,alltoall,torch,hybridep,deepep"]),
    ("bench --plot missing.json", None, ["--plot", "does not exist", "missing.json"]),
    ("bench --sms 16,x", None, ["--sms", "from 1 to 1024", "'x'"]),
    ("bench --sms 16,32 bogus-case", None, ["'bogus-case' is not a benchmark case", "known:"]),
    ("bogus", None, ["unknown command 'bogus'", "train, plan, bench"]),
    ("train --set train.steps=ten", None, ["train.steps", "whole number", "\"ten\""]),
    ("train --set train.bogus=1", None, ["train.bogus", "is not a train option"]),
    ("train --set moe.bogus=1", None, ["moe.bogus"]),
    ("train --config {cfg}", {"train": {"steps": "ten"}}, ["train.steps", "string \"ten\""]),
    ("train --config {cfg}", {"train": {"steps": True}}, ["train.steps", "boolean true"]),
    ("train --config {cfg}", {"train": {"device": 5}}, ["train.device", "number 5"]),
    ("train --config {cfg}", {"train": {"lr": None}}, ["train.lr", "above 0", "got null"]),
    ("train --config {cfg}", {"train": {"ranks": 2.7}}, ["train.ranks", "from 1 to 64", "2.7"]),
    ("train --config {cfg}", {"train": {"ranks": 3000000000}}, ["train.ranks", "3000000000"]),
    ("train --config {cfg}", {"train": {"teacher_std": -1}}, ["train.teacher_std", "-1"]),
    ("train --config {cfg}", {"train": {"padding_fraction": 1}}, ["train.padding_fraction", "[0, 1)"]),
    ("train --config {cfg}", "{\"moe\": {\"route_scale\": 1e400}}", ["out of range", "1e400"]),
    ("train --config {cfg}", "{\"moe\": {\"dim\": ", ["JSON syntax error", "line 1"]),
    ("train --config {cfg} --print-config", {"train": {"tokens": 2, "ranks": 4}}, ["train.tokens", ">= train.ranks"]),
    ("train --set moe.moe_inter_dim=2000000000", None, ["moe.moe_inter_dim", "1 to 16777216"]),
    ("train --set moe.n_shared_experts=100000", None, ["moe.n_shared_experts", "0 to 1024"]),
    ("train --set moe.dim=100000 --set moe.moe_inter_dim=100000", None,
     ["'moe'", "GiB of host memory", "allowed: sizes that fit"]),
    # Nesting that would overflow the stack when echoed, keys given twice, bytes after a NUL, a
    # device read forever, a field set twice, an empty name, null named once.
    ("train --config {cfg}", "[" * 100000 + "]" * 100000, ["JSON nested deeper than 64 levels"]),
    ("train --config {cfg}", "{\"train\": {\"steps\": 3, \"steps\": 5}}", ["key 'steps' appears twice"]),
    ("train --config {cfg}", "{\"train\": {\"steps\": 3}}\0garbage", ["NUL byte at byte 23"]),
    ("train --config /dev/zero", None, ["config_file", "not a regular file"]),
    ("train --set moe.dim=32 --dim 16", None, ["--set", "'moe.dim' is also set by its own option (--dim)"]),
    ("train --set train.steps=9 --steps 7", None, ["'train.steps' is also set by its own option (--steps)"]),
    ("train --topk 2 --set moe.n_activated_experts=3", None, ["'moe.n_activated_experts' is also set by its own option (--topk)"]),
    ("train --set moe.train_gate=null", None, ["moe.train_gate", "got null"]),
    # Finite values whose products overflow downstream.
    ("train --set moe.route_scale=1e308", None, ["moe.route_scale", "up to 10000"]),
    ("train --lr 1e308", None, ["train.lr", "up to 10"]),
    ("train --set train.teacher_std=1e308", None, ["train.teacher_std", "up to 1000"]),
    # plan options that mean something only beside another, and seeds out of range.
    ("train --config {cfg}", {"bench": {"reps": 3}}, ["'bench'", "allowed: moe, backend, train"]),
    ("train --set train.padding_fraction=0.999999", None, ["train.padding_fraction", "valid tokens of 256"]),
    ("bench --tokens 1.5", None, ["--tokens", "whole number from 0 to", "'1.5'"]),
    ("bench dsv3-ep2 --routing bogus", None, ["--routing", "'bogus'", "uniform, zipf, hot"]),
    ("bench dsv3-ep2 --sweep tokens=-1", None, ["--sweep", "tokens=-1", "from 0 to"]),
    ("plan --drop", None, ["--drop", "give --budget too"]),
    ("plan --zipf-s 2", None, ["--zipf-s", "--routing zipf", "'uniform'"]),
    ("plan --seed -1", None, ["--seed", "from 0 to", "-1"]),
    ("plan --budget 99999999999", None, ["--budget", "from 0 to 2147483647"]),
]


def main():
    flexep = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "config.json")
        for args, body, words in CASES:
            if body is not None:
                with open(cfg, "w") as f:
                    f.write(body if isinstance(body, str) else json.dumps(body))
            argv = [flexep] + args.format(cfg=cfg).split()
            try:
                r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired:
                failures.append(f"{args} {body}: no answer within 60 s")
                continue
            out = r.stdout + r.stderr
            missing = [w for w in words if w not in out]
            if r.returncode != 2 or missing:
                failures.append(f"{args} {body}: exit {r.returncode} (want 2), missing {missing} in:\n{out.strip()}")
    for f in failures:
        print("FAILED:", f)
    print(f"{len(CASES) - len(failures)} of {len(CASES)} bad inputs gave a named error and exit code 2")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
