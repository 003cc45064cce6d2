"""Load test: 16 concurrent clients × 8 greedy chat requests against a running server.

Every request must complete exactly once and equal its prompt's solo answer (taken first, one
request at a time); p50/p99 latency and aggregate tok/s go to a JSON evidence file.

Usage: python tests/server/load_test.py URL [--json PATH] [--command TEXT]
"""

import argparse
import json
import sys

from common import client, evidence, greedy_chat, metrics, percentile, run_concurrent

PROMPTS = [
    "What is a mixture of experts?",
    "Explain top-k routing in one sentence.",
    "Write a haiku about memory bandwidth.",
    "List three prime numbers.",
    "Why quantize weights to four bits?",
    "Translate 'good morning' into French.",
    "What does a KV cache store?",
    "Name a sorting algorithm and its complexity.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--command", default=" ".join(sys.argv))
    args = ap.parse_args()
    url = args.url.rstrip("/")
    c = client(url)
    model = c.models.list().data[0].id

    solo = {p: greedy_chat(c, model, p, args.max_tokens)[0] for p in PROMPTS}

    def job(i, j):
        prompt = PROMPTS[(i + j) % len(PROMPTS)]
        return lambda: (i, j, prompt) + greedy_chat(c, model, prompt, args.max_tokens)

    jobs = [job(i, j) for i in range(args.clients) for j in range(args.requests)]
    before = metrics(url)
    results, wall = run_concurrent(jobs, args.clients)
    after = metrics(url)

    assert len(results) == len(jobs) and len({(r[0], r[1]) for r in results}) == len(jobs), "a request was lost or repeated"
    mismatched = [(r[2], r[3], solo[r[2]]) for r in results if r[3] != solo[r[2]]]
    tokens = sum(r[4].completion_tokens for r in results)
    latencies = [r[5] for r in results]
    report = {
        **evidence(),
        "command": args.command,
        "model": model,
        "slots": after.get("qmoe_slots"),
        "clients": args.clients,
        "requests_per_client": args.requests,
        "requests": len(results),
        "max_tokens": args.max_tokens,
        "greedy_equal_to_solo": len(results) - len(mismatched),
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "server_generated_tokens": after["qmoe_generated_tokens_total"] - before["qmoe_generated_tokens_total"],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    for prompt, got, want in mismatched[:3]:
        print(f"MISMATCH for {prompt!r}: batched {got!r} != solo {want!r}", file=sys.stderr)
    assert not mismatched, f"{len(mismatched)} greedy answers differ from their solo answer"
    assert report["server_generated_tokens"] == tokens, "the server counted other tokens than the clients got"
    print(f"load test OK: {len(results)} requests, {tokens / wall:.1f} tok/s, p50 {report['latency_p50_s']:.3f} s, p99 {report['latency_p99_s']:.3f} s")


if __name__ == "__main__":
    main()
