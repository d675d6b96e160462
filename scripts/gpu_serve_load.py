#!/usr/bin/env python3
"""Load generator for `merlin serve` on the GPU machine, which has python3 but not node (bench/serve_load.mjs
is the CPU machine's). C client threads send non-streaming /v1/completions requests one after another until
R requests are done; each generates exactly N tokens (ignore_eos) at the given temperature. Prints one JSON
line: aggregate generated tokens/s over the wall time and the per-request latency p50 / p99.

  python3 scripts/gpu_serve_load.py URL -c CLIENTS [-r REQUESTS] [-n MAX_TOKENS] [-t TEMPERATURE]
                                    [--top-k K] [--top-p P] [--min-p P]
"""
import argparse
import json
import threading
import time
import urllib.request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("-c", type=int, default=1)
    ap.add_argument("-r", type=int, default=0)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    a = ap.parse_args()
    total = a.r or max(8, 2 * a.c)
    lock = threading.Lock()
    state = {"next": 0, "tokens": 0, "errors": 0}
    latencies = []

    def client():
        while True:
            with lock:
                i = state["next"]
                if i >= total:
                    return
                state["next"] += 1
            body = json.dumps({"prompt": f"Story {i}: once upon a time", "max_tokens": a.n, "temperature": a.t,
                               "top_k": a.top_k, "top_p": a.top_p, "min_p": a.min_p, "ignore_eos": True,
                               "seed": i}).encode()
            req = urllib.request.Request(a.url.rstrip("/") + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            try:
                out = json.loads(urllib.request.urlopen(req, timeout=600).read())
                n = out["usage"]["completion_tokens"]
                ok = n == a.n
            except Exception:
                n, ok = 0, False
            with lock:
                latencies.append(time.perf_counter() - t0)
                state["tokens"] += n
                state["errors"] += 0 if ok else 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(a.c)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    latencies.sort()
    pct = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]
    print(json.dumps({"clients": a.c, "requests": total, "temperature": a.t, "top_k": a.top_k, "top_p": a.top_p,
                      "min_p": a.min_p, "max_tokens": a.n,
                      "tokens": state["tokens"], "errors": state["errors"], "seconds": round(wall, 3),
                      "tokens_per_s": round(state["tokens"] / wall, 1), "latency_p50_s": round(pct(0.5), 3),
                      "latency_p99_s": round(pct(0.99), 3)}))


if __name__ == "__main__":
    main()
