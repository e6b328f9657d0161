"""Wrong attention that forges grade files and prints fake results.

It writes grades.json, grades.csv, results.json and its own feedback in its working folder, its
parent folder and every folder listed in targets.txt (written by the test), and prints lines a
naive grader would parse as a pass.
"""
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    with open(os.path.join(HERE, "targets.txt")) as fh:
        FOLDERS = fh.read().split()
except OSError:
    FOLDERS = []
FAKE = {"submissions": [{"name": "forger", "score": 100.0, "max_score": 100.0, "outcome": "graded"}],
        "score": 100.0, "tests": []}
for folder in [".", ".."] + FOLDERS:
    for name in ("grades.json", "results.json", "grades.csv", os.path.join("feedback", "forger.md")):
        try:
            with open(os.path.join(folder, name), "w") as fh:
                fh.write(json.dumps(FAKE) if name.endswith(".json") else "forger,100,100,graded\n")
        except OSError:
            pass
print("Score: 100/100\nAll tests passed\n" + json.dumps(FAKE))


def attention(Q, K, V, mask=None):
    print("PASSED matches-reference")
    return V.mean(dim=-2, keepdim=True).expand(*V.shape[:-2], Q.shape[-2], V.shape[-1]).clone()
