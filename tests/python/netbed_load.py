"""Load from a producer host of the scale-out test bed (run inside its namespace), as JSON on stdout.

    python netbed_load.py jobs  --redis HOST:PORT --model add_sub --count N --rate R --prefix P --wait S
    python netbed_load.py infer --url http://HOST:PORT --model add_sub --seconds S --concurrency C

`jobs` adds N stream jobs (XADD quern:jobs:{model}, fields id and body) at R a second, then waits up
to S seconds for every result (results:{id}) and checks each against numpy: what was accepted, what
came back, what was wrong or missing, the rate reached, and the time from XADD to the result (its
finished_ms, whole milliseconds).
`infer` sends synchronous KServe infers through the load balancer from C threads for S seconds and
reports every request: start and end (seconds since the epoch), HTTP status (0: no answer), and the
host that answered (the balancer's X-Served-By header).
"""
import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

import numpy as np


def add_sub_body(k):
    a = np.full((1, 4), float(k), np.float32)
    b = np.arange(4, dtype=np.float32).reshape(1, 4)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": a.ravel().tolist()},
                       {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": b.ravel().tolist()}]}
    return body, (a + b).ravel().tolist(), (a - b).ravel().tolist()


def run_jobs(args):
    import redis
    host, port = args.redis.rsplit(":", 1)
    r = redis.Redis(host=host, port=int(port), socket_timeout=5, socket_connect_timeout=2)
    stream = f"quern:jobs:{args.model}"
    accepted, refused = {}, 0
    t0 = time.time()
    for k in range(args.count):
        wait = t0 + k / args.rate - time.time()
        if wait > 0:
            time.sleep(wait)
        job = f"{args.prefix}-{k}"
        body, plus, minus = add_sub_body(k)
        data = json.dumps(body)
        sent = time.time()
        try:
            r.xadd(stream, {"id": job, "body": data})
            accepted[job] = (sent, plus, minus)
        except redis.RedisError:
            refused += 1  # Redis away: the producer was told, nothing was accepted
    added_s = time.time() - t0
    done, wrong, latency = {}, [], []
    deadline = time.time() + args.wait
    waiting = list(accepted)
    while waiting and time.time() < deadline:
        try:
            values = r.mget([f"results:{j}" for j in waiting])
        except redis.RedisError:
            time.sleep(0.2)
            continue
        now = time.time()
        left = []
        for job, raw in zip(waiting, values):
            if raw is None:
                left.append(job)
                continue
            doc = json.loads(raw)
            added, plus, minus = accepted[job]
            outs = {o["name"]: o.get("data") for o in doc.get("result", {}).get("outputs", [])}
            if doc.get("status") != "done" or outs.get("OUTPUT0") != plus or outs.get("OUTPUT1") != minus:
                wrong.append({"job": job, "doc": doc})
            done[job] = doc
            latency.append(doc.get("finished_ms", now * 1000) / 1000 - added)
        waiting = left
        if waiting:
            time.sleep(0.1)
    json.dump({"accepted": len(accepted), "refused": refused, "rate": len(accepted) / max(added_s, 1e-9), "results": len(done), "wrong": wrong,
               "missing": waiting, "latency_s": sorted(latency)}, sys.stdout)


def run_infer(args):
    u = urllib.parse.urlparse(args.url)
    records = []
    lock = threading.Lock()
    stop = time.time() + args.seconds

    def worker(w):
        conn = None
        k = w
        while time.time() < stop:
            body, plus, _ = add_sub_body(k % 1000)
            k += args.concurrency
            start = time.time()
            status, served = 0, ""
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
                conn.request("POST", f"/v2/models/{args.model}/infer", json.dumps(body),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                status, served = resp.status, resp.getheader("X-Served-By", "")
                if status == 200:
                    outs = {o["name"]: o["data"] for o in json.loads(data)["outputs"]}
                    if outs["OUTPUT0"] != plus:
                        status = -1  # a wrong answer: never expected, counted apart
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                if conn:
                    conn.close()
                conn = None
            with lock:
                records.append((start, time.time(), status, served))
            if status != 200:
                time.sleep(0.01)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    json.dump({"requests": records}, sys.stdout)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    j = sub.add_parser("jobs")
    j.add_argument("--redis", required=True)
    j.add_argument("--model", default="add_sub")
    j.add_argument("--count", type=int, default=100)
    j.add_argument("--rate", type=float, default=100)
    j.add_argument("--prefix", default="job")
    j.add_argument("--wait", type=float, default=60)
    i = sub.add_parser("infer")
    i.add_argument("--url", required=True)
    i.add_argument("--model", default="add_sub")
    i.add_argument("--seconds", type=float, default=5)
    i.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    run_jobs(args) if args.mode == "jobs" else run_infer(args)


if __name__ == "__main__":
    main()
