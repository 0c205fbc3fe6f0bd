#!/usr/bin/env python3
"""Load for the Redis job streams: adds N small_cnn jobs (binary tensors, batch 1) to quern:jobs:small_cnn
with pipelined XADDs, waits until the consumer group has read and acknowledged all of them, and prints
jobs/s with Redis's own command counts per batch (INFO commandstats) and the batches the servers ran.

    bench/jobs_load.py REDIS_PORT N METRICS_PORT [METRICS_PORT...]
"""
import json
import re
import sys
import time
import urllib.request

import numpy as np
import redis

port, n, metrics = int(sys.argv[1]), int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
r = redis.Redis(port=port)
stream = "quern:jobs:small_cnn"


def batches():
    total = 0
    for p in metrics:
        text = urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics").read().decode()
        m = re.search(r'^quern_execution_count_total\{model="small_cnn",version="1"\} (\S+)$', text, re.M)
        total += float(m.group(1)) if m else 0
    return total


x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32).tobytes()
header = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32",
                                 "parameters": {"binary_data_size": len(x)}}]}).encode()
body = header + x
stats0 = {k: v["calls"] for k, v in r.info("commandstats").items()}
b0 = batches()
t0 = time.perf_counter()
for start in range(0, n, 200):
    p = r.pipeline(transaction=False)
    for k in range(start, min(n, start + 200)):
        p.xadd(stream, {"id": f"b{k}", "body": body, "header_length": len(header)})
    p.execute()
t_produced = time.perf_counter() - t0
while True:
    g = r.xinfo_groups(stream)[0]
    if g["entries-read"] is not None and g["entries-read"] >= n and g["pending"] == 0:
        break
    time.sleep(0.002)
elapsed = time.perf_counter() - t0
stats1 = {k: v["calls"] for k, v in r.info("commandstats").items()}
ran = batches() - b0
d = {k.removeprefix("cmdstat_"): stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}
missing = sum(1 for v in r.mget([f"results:b{k}" for k in range(n)]) if v is None)
consumer_trips = d.get("exec", 0) + d.get("xreadgroup", 0) + d.get("xautoclaim", 0) + d.get("xlen", 0)
print(json.dumps({
    "jobs": n, "jobs_per_s": round(n / elapsed, 1), "produce_s": round(t_produced, 3),
    "batches": int(ran), "jobs_per_batch": round(n / ran, 2) if ran else None,
    "exec_per_batch": round(d.get("exec", 0) / ran, 3) if ran else None,
    "xreadgroup_per_batch": round(d.get("xreadgroup", 0) / ran, 3) if ran else None,
    "consumer_round_trips_per_batch": round(consumer_trips / ran, 3) if ran else None,
    "results_missing": missing}))
r.delete(stream, *[f"results:b{k}" for k in range(n)])
