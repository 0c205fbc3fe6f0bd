#!/usr/bin/env python3
"""Producer and result collector for Quern's Redis job streams, using `redis` from PyPI.

Start one or more Quern instances that take jobs from Redis:

    quern serve --model-repository examples/models --redis-url redis://127.0.0.1:6379/0 --consume

then add jobs and collect their results:

    python examples/redis/jobs.py --redis-url redis://127.0.0.1:6379/0 --jobs 100

Each job is one XADD to quern:jobs:{model} with the fields `id` and `body` (a KServe v2 infer request);
a Quern instance runs it and writes results:{id} (JSON with the KServe v2 response) and acknowledges the
entry in the same transaction. Jobs that cannot succeed end up in quern:dead:{model} with their error.
"""
import argparse
import json
import time
import uuid

import numpy as np
import redis


def outputs(r, doc):
    """The outputs of a stored result as numpy arrays; large ones are separate binary values."""
    dtypes = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "UINT8": np.uint8,
              "FP16": np.float16, "BOOL": np.bool_}
    out, binary = {}, iter(doc.get("binary_keys", []))
    for o in doc["result"]["outputs"]:
        dtype = dtypes[o["datatype"]]
        if "data" in o:
            out[o["name"]] = np.array(o["data"], dtype).reshape(o["shape"])
        else:
            out[o["name"]] = np.frombuffer(r.get(next(binary)), dtype).reshape(o["shape"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--model", default="add_sub")
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=60, help="seconds to wait for all results")
    args = ap.parse_args()
    r = redis.Redis.from_url(args.redis_url)

    # Produce: one pipelined round trip for all the jobs.
    rng = np.random.default_rng()
    expected, pipe = {}, r.pipeline(transaction=False)
    for _ in range(args.jobs):
        a = rng.standard_normal((1, 4)).astype(np.float32)
        b = rng.standard_normal((1, 4)).astype(np.float32)
        job_id = uuid.uuid4().hex
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": a.ravel().tolist()},
                           {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": b.ravel().tolist()}]}
        fields = {"id": job_id, "body": json.dumps(body),
                  "deadline_ms": int((time.time() + args.timeout) * 1000)}  # optional
        pipe.xadd(f"quern:jobs:{args.model}", fields)
        expected[job_id] = (a + b, a - b)
    t0 = time.time()
    pipe.execute()

    # Collect: results:{id} appears when the job is done (or failed).
    waiting, failed = set(expected), 0
    while waiting and time.time() - t0 < args.timeout:
        ids = list(waiting)
        for job_id, raw in zip(ids, r.mget([f"results:{i}" for i in ids])):
            if raw is None:
                continue
            waiting.discard(job_id)
            doc = json.loads(raw)
            if doc["status"] != "done":
                failed += 1
                print(f"{job_id}: {doc['status']}: {doc['error']['message']}")
                continue
            out = outputs(r, doc)
            np.testing.assert_allclose(out["OUTPUT0"], expected[job_id][0], rtol=1e-6)
            np.testing.assert_allclose(out["OUTPUT1"], expected[job_id][1], rtol=1e-6)
        if waiting:
            time.sleep(0.01)
    elapsed = time.time() - t0
    print(f"{args.jobs - len(waiting) - failed} done, {failed} failed, {len(waiting)} not finished "
          f"in {elapsed:.2f} s; dead letters: {r.xlen(f'quern:dead:{args.model}')}")
    return 1 if waiting or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
