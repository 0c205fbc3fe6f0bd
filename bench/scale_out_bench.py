"""Stream jobs across 1, 2 and 3 Quern hosts of the network-namespace test bed (tests/python/netbed.py),
and what each job costs Redis. Needs root.

    build/venv/bin/python bench/scale_out_bench.py --quern build/release/src/cli/quern \\
        --models examples/models --hosts 1 2 3 --jobs 6000

For each host count: a fresh bed (Redis on R with append-only files fsynced at every write, N hosts
running `quern serve --consume`), then
- capacity: --jobs entries added at once (one pipeline) to quern:jobs:add_sub; jobs/s from the first
  XADD to the last result's finished_ms;
- what Redis did per job over that run (INFO commandstats, stats and cpu before and after):
  commands, bytes in + out, and its CPU per 1000 jobs;
- latency: jobs added one by one from host P at --latency-rate (at most half the capacity) for
  --latency-seconds; p50 and p99 from just before XADD to the result's finished_ms (whole ms).
"""
import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import netbed  # noqa: E402


def counters(r):
    stats, cpu = r.info("stats"), r.info("cpu")
    calls = sum(v["calls"] for v in r.info("commandstats").values())
    return {"calls": calls, "bytes": stats["total_net_input_bytes"] + stats["total_net_output_bytes"],
            "cpu": cpu["used_cpu_sys"] + cpu["used_cpu_user"]}


def capacity_run(cluster, jobs):
    r = cluster.client()
    before = counters(r)
    bodies = [json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [float(k)] * 4},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [0.0, 1.0, 2.0, 3.0]}]}) for k in range(jobs)]
    start = time.time()
    p = r.pipeline(transaction=False)
    for k, body in enumerate(bodies):
        p.xadd("quern:jobs:add_sub", {"id": f"cap-{k}", "body": body})
    p.execute()
    keys = [f"results:cap-{k}" for k in range(jobs)]
    last = 0.0
    waiting = keys
    deadline = time.time() + 600
    while waiting and time.time() < deadline:
        time.sleep(0.2)
        left = []
        for key, raw in zip(waiting, r.mget(waiting)):
            if raw is None:
                left.append(key)
            else:
                last = max(last, json.loads(raw)["finished_ms"] / 1000)
        waiting = left
    if waiting:
        raise SystemExit(f"{len(waiting)} jobs never finished")
    after = counters(r)
    return {"jobs_per_s": jobs / (last - start),
            "commands_per_job": (after["calls"] - before["calls"]) / jobs,
            "bytes_per_job": (after["bytes"] - before["bytes"]) / jobs,
            "redis_cpu_s_per_1000": (after["cpu"] - before["cpu"]) / jobs * 1000}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quern", default="build/release/src/cli/quern")
    ap.add_argument("--models", default="build/ci/test_models")
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--jobs", type=int, default=6000)
    ap.add_argument("--latency-seconds", type=float, default=5)
    ap.add_argument("--latency-rate", type=float, default=1000,
                    help="jobs/s for the latency run (at most half the capacity): one producer adds them one by one")
    args = ap.parse_args()
    why = netbed.available()
    if why:
        raise SystemExit(why)
    print("| hosts | jobs/s | Redis commands/job | Redis bytes/job | Redis CPU s/1000 jobs | rate for latency | "
          "p50 ms | p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.hosts:
        with tempfile.TemporaryDirectory() as d:
            cluster = netbed.Cluster(pathlib.Path(d), os.path.abspath(args.quern), os.path.abspath(args.models),
                                     hosts=n, haproxy=False, batch_delay_us=0)
            try:
                cap = capacity_run(cluster, args.jobs)
                rate = min(cap["jobs_per_s"] / 2, args.latency_rate)
                lat = cluster.report(cluster.jobs(count=int(rate * args.latency_seconds), rate=rate, prefix="lat"))
                if lat["missing"] or lat["wrong"]:
                    raise SystemExit(f"lost or wrong jobs: {lat['missing'][:5]} {lat['wrong'][:2]}")
                ms = sorted(x * 1000 for x in lat["latency_s"])
                p50, p99 = ms[len(ms) // 2], ms[min(len(ms) - 1, int(len(ms) * 0.99))]
                print(f"| {n} | {cap['jobs_per_s']:.0f} | {cap['commands_per_job']:.2f} | {cap['bytes_per_job']:.0f} | "
                      f"{cap['redis_cpu_s_per_1000']:.3f} | {lat['rate']:.0f} | {p50:.0f} | {p99:.0f} |", flush=True)
            finally:
                cluster.close()


if __name__ == "__main__":
    main()
