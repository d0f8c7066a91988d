"""The GPU bench's report as RESULT lines for scripts/gpu-check.sh; exits 1 unless it ran on a GPU and every path's
loaded bytes were verified.

    python scripts/gpu/bench_report.py results.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    with open(path) as f:
        doc = json.load(f)
    gpu = doc["machine"].get("gpu") or {}
    paths = ", ".join(doc["paths"])
    print(f"RESULT gpu: {gpu.get('name')} driver {gpu.get('driver')} CUDA {gpu.get('cuda')}; paths {paths}")
    for row in doc.get("headline", []):
        met = {True: "met", False: "NOT met", None: "-"}[row["met"]]
        value = "-" if row["value"] is None else f"{row['value']}{row['unit']}"
        print(f"RESULT {row['goal']} | {row['metric']} | {value} | target {row['target']} | {met}")
    problems = []
    if doc["settings"].get("device") != "cuda" or not gpu:
        problems.append("the report does not say it ran on a GPU")
    if not doc["throughput"]:
        problems.append("no data-path results")
    for shape in doc["throughput"]:
        verified = shape["verified"]
        bad = [p for p, ok in verified.items() if not ok] + [p for p in doc["paths"] if p not in verified]
        if bad:
            problems.append(f"{shape['shape']}: bytes not verified for {', '.join(bad)}")
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print(f"PASS: every path ({', '.join(doc['paths'])}) loaded the bytes it saved on the GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
