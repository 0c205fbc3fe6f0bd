"""Load from a producer host of the scale-out test bed (run inside its namespace), as JSON on stdout.

    python netbed_load.py jobs  --redis HOST:PORT --model add_sub --count N --rate R --prefix P --wait S
    python netbed_load.py jobs  --sentinel H:P,H:P,H:P --master NAME --wait-replicas 1 ...
    python netbed_load.py jobs  --redis HOST:PORT --http HOST:PORT ...
    python netbed_load.py infer --url http://HOST:PORT --model add_sub --seconds S --concurrency C

`jobs` adds N stream jobs (XADD quern:jobs:{model}, fields id and body) at R a second, then waits up
to S seconds for every result (results:{id}) and checks each against numpy: what was accepted, what
came back, what was wrong or missing, the rate reached, and the time from XADD to the result (its
finished_ms, whole milliseconds). With --sentinel the producer follows failovers (redis-py's Sentinel
client), and with --wait-replicas a job counts as accepted only once that many replicas have it;
the others are reported as unconfirmed (a failover may lose them) and their results, when they
come, are checked all the same. With --http the jobs are posted to that Quern instead
(POST /v2/models/{model}/jobs): a job counts as accepted on its 202, under the id it answered, and
the first failure to post (the host cut off) ends the posting, the rest counted as refused.
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
    if args.sentinel:
        from redis.sentinel import Sentinel
        sentinels = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in args.sentinel.split(","))]
        r = Sentinel(sentinels, socket_timeout=2, socket_connect_timeout=1).master_for(
            args.master, socket_timeout=5, socket_connect_timeout=2)
    else:
        host, port = args.redis.rsplit(":", 1)
        r = redis.Redis(host=host, port=int(port), socket_timeout=5, socket_connect_timeout=2)
    stream = f"quern:jobs:{args.model}"
    accepted, refused, unconfirmed = {}, 0, {}
    t0 = time.time()
    conn = None
    for k in range(args.count):
        if args.http:
            wait = t0 + k / args.rate - time.time()
            if wait > 0:
                time.sleep(wait)
            body, plus, minus = add_sub_body(k)
            sent = time.time()
            try:
                if conn is None:
                    host, port = args.http.rsplit(":", 1)
                    conn = http.client.HTTPConnection(host, int(port), timeout=2)
                conn.request("POST", f"/v2/models/{args.model}/jobs", body=json.dumps(body))
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 202:
                    refused += 1
                    continue
                accepted[json.loads(data)["job_id"]] = (sent, plus, minus)
            except (OSError, http.client.HTTPException):
                refused += args.count - k
                break
            continue
        wait = t0 + k / args.rate - time.time()
        if wait > 0:
            time.sleep(wait)
        job = f"{args.prefix}-{k}"
        body, plus, minus = add_sub_body(k)
        data = json.dumps(body)
        sent = time.time()
        try:
            if args.wait_replicas:
                # Accepted once `wait_replicas` replicas have it (WAIT): a failover cannot lose it then.
                p = r.pipeline(transaction=False)
                p.xadd(stream, {"id": job, "body": data})
                p.execute_command("WAIT", args.wait_replicas, 200)
                _, replicas = p.execute()
                (accepted if replicas >= args.wait_replicas else unconfirmed)[job] = (sent, plus, minus)
            else:
                r.xadd(stream, {"id": job, "body": data})
                accepted[job] = (sent, plus, minus)
        except redis.RedisError:
            refused += 1  # Redis away: the producer was told, nothing was accepted
    added_s = time.time() - t0
    done, wrong, latency = {}, [], []
    deadline = time.time() + args.wait
    # A job added but not confirmed by a replica may be lost in a failover: its result is checked
    # when it comes, and waited for while the accepted ones are.
    expected = {**unconfirmed, **accepted}
    waiting = list(expected)
    while any(j in accepted for j in waiting) and time.time() < deadline:
        try:
            values = r.mget([f"results:{j}" for j in waiting])
        except redis.RedisError:
            time.sleep(0.2)
            continue
        now = time.time()
        left = []
        for job, raw in zip(waiting, values):
            doc = json.loads(raw) if raw is not None else None
            if doc is None or doc.get("status") in ("queued", "running"):  # (an HTTP job's record, waiting)
                left.append(job)
                continue
            added, plus, minus = expected[job]
            outs = {o["name"]: o.get("data") for o in doc.get("result", {}).get("outputs", [])}
            if doc.get("status") != "done" or outs.get("OUTPUT0") != plus or outs.get("OUTPUT1") != minus:
                wrong.append({"job": job, "doc": doc})
            done[job] = doc
            latency.append(doc.get("finished_ms", now * 1000) / 1000 - added)
        waiting = left
        if waiting:
            time.sleep(0.1)
    json.dump({"accepted": len(accepted), "refused": refused, "unconfirmed": len(unconfirmed),
               "rate": len(accepted) / max(added_s, 1e-9), "results": len([j for j in done if j in accepted]),
               "unconfirmed_results": len([j for j in done if j in unconfirmed]), "wrong": wrong,
               "missing": [j for j in waiting if j in accepted], "latency_s": sorted(latency)}, sys.stdout)


def run_grpc(args):
    """KServe v2 gRPC calls (tritonclient) to --url for --seconds from --concurrency callers, each on
    its own channel: (start, end, status, "") per call, status 200 for a right answer, -1 for a wrong
    one, 0 for an error."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    records, errors = [], []
    lock = threading.Lock()
    stop = time.time() + args.seconds

    def worker(w):
        client = grpcclient.InferenceServerClient(args.url.split("://", 1)[-1])
        k = w
        while time.time() < stop:
            body, plus, _ = add_sub_body(k % 1000)
            k += args.concurrency
            inputs = []
            for t in body["inputs"]:
                x = grpcclient.InferInput(t["name"], t["shape"], t["datatype"])
                x.set_data_from_numpy(np.array(t["data"], np.float32).reshape(t["shape"]))
                inputs.append(x)
            start = time.time()
            try:
                out = client.infer(args.model, inputs, client_timeout=10).as_numpy("OUTPUT0")
                status = 200 if out.ravel().tolist() == plus else -1
            except InferenceServerException as e:
                status = 0
                with lock:
                    if len(errors) < 3:
                        errors.append(str(e))
            with lock:
                records.append((start, time.time(), status, ""))
            if status != 200:
                time.sleep(0.01)
        client.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    json.dump({"requests": records, "errors": errors}, sys.stdout)


def run_infer(args):
    if args.grpc:
        return run_grpc(args)
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
    where = j.add_mutually_exclusive_group(required=True)
    where.add_argument("--redis", help="HOST:PORT")
    where.add_argument("--sentinel", help="HOST:PORT,HOST:PORT,...: the master is asked of these")
    j.add_argument("--http", help="HOST:PORT of a Quern: post the jobs to it (results still read from --redis)")
    j.add_argument("--master", default="quern", help="the master's name, with --sentinel")
    j.add_argument("--wait-replicas", type=int, default=0, help="a job counts as accepted once this many replicas have it")
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
    i.add_argument("--grpc", action="store_true", help="KServe v2 gRPC to --url (HOST:PORT) instead of HTTP")
    args = ap.parse_args()
    run_jobs(args) if args.mode == "jobs" else run_infer(args)


if __name__ == "__main__":
    main()
