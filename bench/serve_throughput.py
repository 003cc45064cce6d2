"""Aggregate decode tok/s and expert bytes per generated token at several concurrencies.

Usage: python bench/serve_throughput.py URL [--levels 1,2,4,8] [--requests 2] [--max-tokens 64]
       [--out bench/results/serve-throughput-cpu] [--command TEXT]
Writes OUT.json (device, commit, command, one row per level) and OUT.svg (matplotlib).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from common import client, evidence, greedy_chat, metrics, percentile, run_concurrent  # noqa: E402

PROMPT = "Explain in two sentences what a mixture-of-experts model is."


def level(url, c, model, clients, requests, max_tokens):
    """One concurrency level: every client sends `requests` greedy requests back to back."""
    before = metrics(url)
    jobs = [lambda: greedy_chat(c, model, PROMPT, max_tokens) for _ in range(clients * requests)]
    results, wall = run_concurrent(jobs, clients)
    after = metrics(url)
    tokens = sum(r[1].completion_tokens for r in results)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {
        "concurrent_requests": clients,
        "requests": len(results),
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall,
        "latency_p50_s": percentile([r[2] for r in results], 50),
        "expert_bytes_read": delta("qmoe_expert_bytes_read_total"),
        "expert_bytes_per_generated_token": delta("qmoe_expert_bytes_read_total") / max(1.0, delta("qmoe_generated_tokens_total")),
        "experts_read_per_moe_call": delta("qmoe_experts_read_total") / max(1.0, delta("qmoe_expert_calls_total")),
        "prompt_tokens": delta("qmoe_prompt_tokens_total"),
    }


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    x = [r["concurrent_requests"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["aggregate_tokens_per_s"] for r in rows], "o-", color="tab:blue")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate decode tok/s", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax2 = ax.twinx()
    ax2.plot(x, [r["expert_bytes_per_generated_token"] / 1e6 for r in rows], "s--", color="tab:red")
    ax2.set_ylabel("expert MB read per generated token", color="tab:red")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/serve-throughput-cpu")
    ap.add_argument("--command", default=" ".join(sys.argv))
    ap.add_argument("--bandwidth", help="the machine's read/copy bandwidth probe (mem_bandwidth's JSON line)")
    args = ap.parse_args()
    url = args.url.rstrip("/")
    c = client(url)
    model = c.models.list().data[0].id
    greedy_chat(c, model, PROMPT, 4)  # warm-up, not measured
    rows = []
    for n in [int(v) for v in args.levels.split(",")]:
        rows.append(level(url, c, model, n, args.requests, args.max_tokens))
        r = rows[-1]
        print(f"{n} concurrent: {r['aggregate_tokens_per_s']:.2f} tok/s, {r['expert_bytes_per_generated_token'] / 1e6:.1f} MB of experts per generated token")
    report = {
        **evidence(),
        "command": args.command,
        "memory_bandwidth": json.loads(args.bandwidth) if args.bandwidth else None,
        "model": model,
        "slots": metrics(url).get("qmoe_slots"),
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests,
        "note": "aggregate tok/s = completion tokens / wall time of the level (prefill included); expert bytes per generated token = routed-expert bytes read (prefill included) / tokens generated",
        "levels": rows,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    plot(rows, args.out + ".svg", f"{model}, {report['cpu']}, commit {report['commit']}")
    print(f"wrote {args.out}.json and {args.out}.svg")


if __name__ == "__main__":
    main()
