#!/usr/bin/env python3
"""Load for the Redis job streams. `produce` adds N small_cnn jobs (binary tensors, batch 1) to
quern:jobs:small_cnn with pipelined XADDs (before the consumers start, so the producer's own speed is
not measured); `drain` waits until the consumer group has read and acknowledged all of them and prints
jobs/s over the servers' own timestamps (first job started to last job finished, from results:{id}),
Redis's command counts per batch (INFO commandstats) and the batches the servers ran.

    bench/jobs_load.py produce REDIS_PORT N
    bench/jobs_load.py drain REDIS_PORT N METRICS_PORT [METRICS_PORT...]
"""
import json
import re
import sys
import time
import urllib.request

import numpy as np
import redis

mode, port, n, metrics = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(p) for p in sys.argv[4:]]
r = redis.Redis(port=port)
stream = "quern:jobs:small_cnn"


def batches():
    total = 0
    for p in metrics:
        text = urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics").read().decode()
        m = re.search(r'^quern_execution_count_total\{model="small_cnn",version="1"\} (\S+)$', text, re.M)
        total += float(m.group(1)) if m else 0
    return total


if mode == "produce":
    r.delete(stream)
    r.delete(*[f"results:b{k}" for k in range(n)])
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32).tobytes()
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(x)}}]}).encode()
    for start in range(0, n, 500):
        p = r.pipeline(transaction=False)
        for k in range(start, min(n, start + 500)):
            p.xadd(stream, {"id": f"b{k}", "body": header + x, "header_length": len(header)})
        p.execute()
    r.config_resetstat()
    sys.exit(0)

while True:
    groups = r.xinfo_groups(stream)
    if groups and groups[0]["entries-read"] is not None and groups[0]["entries-read"] >= n and groups[0]["pending"] == 0:
        break
    time.sleep(0.02)
stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
ran = batches()
started, finished, missing = [], [], 0
for k in range(0, n, 1000):
    for raw in r.mget([f"results:b{i}" for i in range(k, min(n, k + 1000))]):
        if raw is None:
            missing += 1
            continue
        doc = json.loads(raw)
        started.append(doc["started_ms"])
        finished.append(doc["finished_ms"])
window = (max(finished) - min(started)) / 1000
trips = sum(stats.get(c, 0) for c in ("exec", "xreadgroup", "xautoclaim", "xlen", "xpending"))
print(json.dumps({
    "jobs": n, "jobs_per_s": round(n / window), "batches": int(ran), "jobs_per_batch": round(n / ran, 2),
    "exec_per_batch": round(stats.get("exec", 0) / ran, 3),
    "xreadgroup_per_batch": round(stats.get("xreadgroup", 0) / ran, 3),
    "round_trips_per_batch": round(trips / ran, 3), "results_missing": missing}))
