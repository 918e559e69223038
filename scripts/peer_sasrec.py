#!/usr/bin/env python3
"""Runs the peer SASRec (pmixer/SASRec.pytorch, ../shared/peer/sasrec) on a
`user item` file and prints one JSON line: seconds per epoch, samples
(users) per second, and its test HR@10 and NDCG@10, for docs/results/.

usage: peer_sasrec.py PEER_DIR DATA.txt EPOCHS [PYTHON]

PEER_DIR is a writable copy of ../shared/peer/sasrec; the flags are the
comparison's (maxlen 50, 50 hidden units, 2 blocks, batch 128, dropout 0.2).
"""
import json
import os
import re
import shutil
import subprocess
import sys

peer, data, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
python = sys.argv[4] if len(sys.argv) > 4 else sys.executable
os.makedirs(os.path.join(peer, "data"), exist_ok=True)
shutil.copy(data, os.path.join(peer, "data", "syn.txt"))
train_dir = "syn_t"
shutil.rmtree(os.path.join(peer, "syn_" + train_dir), ignore_errors=True)
command = [python, "main.py", "--dataset", "syn", "--train_dir", train_dir, "--device", "cpu",
           "--maxlen", "50", "--hidden_units", "50", "--num_blocks", "2", "--batch_size", "128",
           "--num_epochs", str(epochs), "--dropout_rate", "0.2"]
out = subprocess.run(command, cwd=peer, capture_output=True, text=True, check=True).stdout
# What it prints after its last epoch (after "Evaluating", on the same
# line): the accumulated training time, then the metrics.
line = re.compile(r"epoch:\s*\d+, time: ([0-9.]+)\(s\).*test \(NDCG@10: ([0-9.]+), HR@10: ([0-9.]+)\)")
matches = line.findall(out)
if not matches:
    sys.exit("no evaluation line in the peer's output:\n" + out[-2000:])
seconds, ndcg, hr = map(float, matches[-1])
users = len({line.split()[0] for line in open(data) if line.strip()})
print(json.dumps({
    "seconds_per_epoch": seconds / epochs,
    "samples_per_s": users * epochs / seconds,
    "hit_rate": hr,
    "ndcg": ndcg,
    "epochs": epochs,
}))
