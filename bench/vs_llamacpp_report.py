#!/usr/bin/env python3
"""Assembles bench/results/vs-llamacpp-cpu.json from the files bench/vs-llamacpp.sh leaves in its
run folder: llama-bench's JSON, our bench example's JSON, the `/usr/bin/time -v` logs of every
timed process and of llama-quantize, and the memory-bandwidth probe.

Weight bytes read per decoded token are counted from the weight files themselves: k/E of the
routed experts' bytes, every non-expert weight, the whole output head and one embedding row.
For a GGUF from its tensor table (the `gguf` package); for ours from the checkpoint's
safetensors headers at the compute dtype of the run and the expert pack's slabs, unless our
bench JSON already reports `bytes_per_token`. Achieved GB/s = bytes per token x decode tok/s.

Needs the `gguf` package (the venv that bench/vs-llamacpp.sh builds has it).
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import gguf

EXPERT_GGUF = re.compile(r"\.ffn_(gate|up|down|gate_up)_exps\.")
EXPERT_HF = re.compile(r"\.mlp\.experts\.\d+\.")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
# The projections `--dense-weights int8` requantizes (attention, dense and shared-expert MLPs;
# lm_head by name), and its group of columns per F16 scale (kernels::dense::INT8_GROUP).
INT8_PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
INT8_GROUP = 32
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U32": 4,
                     "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def time_v(path: Path) -> dict:
    """Wall time, peak RSS and exit status from a `/usr/bin/time -v` log."""
    text = path.read_text()
    out: dict = {"elapsed_s": None, "peak_rss_bytes": None, "exit_status": None}
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    if m:
        secs = 0.0
        for part in m.group(1).split(":"):
            secs = secs * 60 + float(part)
        out["elapsed_s"] = secs
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if m:
        out["peak_rss_bytes"] = int(m.group(1)) * 1024
    m = re.search(r"Exit status: (\d+)", text)
    if m:
        out["exit_status"] = int(m.group(1))
    return out


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def checkpoint_tensors(model_dir: Path) -> dict:
    """Every tensor of a Hugging Face checkpoint folder (one file or an index of shards)."""
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    tensors = {}
    for name in files:
        tensors.update(safetensors_header(model_dir / name))
    return tensors


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gguf_bytes_per_token(path: Path) -> dict:
    """Weight bytes one decoded token reads from a GGUF, counted from its tensor table."""
    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    experts = int(reader.get_field(f"{arch}.expert_count").contents())
    top_k = int(reader.get_field(f"{arch}.expert_used_count").contents())
    parts = {"experts": 0.0, "non_expert": 0, "lm_head": 0, "embedding_row": 0.0}
    embedding = None
    for t in reader.tensors:
        n_bytes = int(t.n_bytes)
        if EXPERT_GGUF.search(t.name):
            parts["experts"] += n_bytes * top_k / experts
        elif t.name == "token_embd.weight":
            embedding = t
        elif t.name == "output.weight":
            parts["lm_head"] += n_bytes
        else:
            parts["non_expert"] += n_bytes
    if embedding is not None:
        rows = int(embedding.n_elements) // int(embedding.shape[0])
        parts["embedding_row"] = int(embedding.n_bytes) / rows
        if parts["lm_head"] == 0:  # tied embeddings: the head reads the whole table
            parts["lm_head"] = int(embedding.n_bytes)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return {
        "bytes_per_token": sum(parts.values()),
        "parts": parts,
        "experts": experts,
        "top_k": top_k,
        "file_bytes": path.stat().st_size,
        "tensor_bytes_by_type": types,
    }


def ours_bytes_per_token(model_dir: Path, pack: Path | None, run: dict) -> dict:
    """Weight bytes one decoded token reads in our run: the checkpoint's non-expert weights at
    the run's compute dtype (its projections in INT8 with `--dense-weights int8`), k/E of the
    experts (the pack's slabs, or the dense experts at the run's expert dtype)."""
    config = json.loads((model_dir / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts")
    top_k = config["num_experts_per_tok"]
    backend = run.get("backend") or {}
    compute = DTYPE_BYTES[backend.get("dtype", "f32")]
    expert_kind = backend.get("experts", "int4")
    int8 = run.get("dense_weights") == "int8"
    activations = DTYPE_BYTES.get(run.get("activations"), compute)

    def matrix(name: str, shape: list[int]) -> int:
        """A weight's bytes: norms and biases in the activations' dtype; with
        `--dense-weights int8` the projections in INT8 rows padded to whole groups of INT8_GROUP
        columns with an F16 scale per group (routers keep the compute dtype); otherwise the
        compute dtype."""
        if name.endswith("norm.weight") or name.endswith(".bias"):
            # RmsNorm keeps its weight, and DenseLinear its bias, in the activations' dtype.
            return numel(shape) * activations
        if int8 and (name == "lm_head.weight" or INT8_PROJECTION.search(name)):
            rows, cols = shape
            padded = -(-cols // INT8_GROUP) * INT8_GROUP
            return rows * padded + 2 * rows * (padded // INT8_GROUP)
        return numel(shape) * compute

    parts = {"experts": 0.0, "non_expert": 0, "lm_head": 0, "embedding_row": 0.0}
    tensors = checkpoint_tensors(model_dir)
    for name, t in tensors.items():
        n = numel(t["shape"])
        if EXPERT_HF.search(name):
            if expert_kind != "int4":
                parts["experts"] += n * DTYPE_BYTES[expert_kind] * top_k / experts
        elif name == "model.embed_tokens.weight":
            parts["embedding_row"] = t["shape"][1] * compute
            if config.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
                parts["lm_head"] = matrix("lm_head.weight", t["shape"])
        elif name == "lm_head.weight":
            parts["lm_head"] = matrix(name, t["shape"])
        else:
            parts["non_expert"] += matrix(name, t["shape"])
    if expert_kind == "int4":
        if pack is None:
            raise SystemExit("an INT4 run needs its --pack to count the expert bytes")
        for name, t in safetensors_header(pack).items():
            if name.endswith(".experts"):  # U8 [experts, slab_bytes], one slab per expert
                parts["experts"] += top_k * t["shape"][1]
    return {"bytes_per_token": sum(parts.values()), "parts": parts, "experts": experts,
            "top_k": top_k, "compute_dtype": backend.get("dtype"), "expert_storage": expert_kind}


def llama_rates(records: list[dict], prompt: int, gen: int, depth: int) -> dict:
    """Prompt and decode rates of one llama-bench JSON (its pp and tg tests at `depth`); no
    prompt rate at a depth (only tg runs there)."""
    at = [r for r in records if r.get("n_depth", 0) == depth]
    pp = next((r for r in at if r["n_prompt"] == prompt and r["n_gen"] == 0), None)
    tg = next(r for r in at if r["n_gen"] == gen and r["n_prompt"] == 0)
    return {
        "prompt_tokens_per_s": pp and pp["avg_ts"],
        "prompt_tokens_per_s_stddev": pp and pp["stddev_ts"],
        "decode_tokens_per_s": tg["avg_ts"], "decode_tokens_per_s_stddev": tg["stddev_ts"],
        "decode_samples_tokens_per_s": tg.get("samples_ts"),
        "build_commit": tg.get("build_commit"), "build_number": tg.get("build_number"),
        "cpu_info": tg.get("cpu_info"), "n_threads": tg.get("n_threads"),
        "model_type": tg.get("model_type"), "model_size": tg.get("model_size"),
        "model_n_params": tg.get("model_n_params"),
        "settings": {k: tg.get(k) for k in ("n_batch", "n_ubatch", "flash_attn", "repack",
                                             "load_mode", "poll", "type_k", "type_v")},
    }


def ratio(a, b):
    return a / b if a is not None and b else None


def median(values: list):
    """The median of the values that are not None (the mean of the middle two for an even
    count), or None."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def max_or_none(values: list):
    v = [x for x in values if x is not None]
    return max(v) if v else None


def shielded(argv: list[str]) -> list[str]:
    """argv with a space put before each value of --ours/--llama that begins with `-` and has
    no space: argparse would read such a value (an --ours label is the variant's flags, e.g.
    `--pack-in-memory`) as an option; `main` strips the space again."""
    out, values_left = [], 0
    for arg in argv:
        if values_left:
            values_left -= 1
            out.append(" " + arg if arg.startswith("-") and " " not in arg else arg)
        else:
            out.append(arg)
            values_left = 6 if arg in ("--ours", "--llama") else 0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--machine", type=Path, action="append", required=True,
                   help="the mem_bandwidth example's JSON line (once per round)")
    p.add_argument("--cores", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt", type=int, required=True, help="prompt tokens")
    p.add_argument("--gen", type=int, required=True, help="generated tokens")
    p.add_argument("--repetitions", type=int, required=True)
    p.add_argument("--depth", type=int, default=0,
                   help="tokens of context before decoding (0: prompt + decode from empty)")
    p.add_argument("--llama", nargs=6, action="append", default=[],
                   metavar=("FORMAT", "GGUF", "BENCH_JSON", "TIME_LOG", "LOADAVG", "COMMAND"))
    p.add_argument("--ours", nargs=6, action="append", default=[],
                   metavar=("LABEL", "PACK", "BENCH_JSON", "TIME_LOG", "LOADAVG", "COMMAND"))
    p.add_argument("--quantize", nargs=2, action="append", default=[],
                   metavar=("FORMAT", "TIME_LOG"))
    p.add_argument("--convert", nargs=2, metavar=("OUTTYPE", "TIME_LOG"))
    p.add_argument("--command", required=True, help="the command line that ran it all")
    p.add_argument("--llama-cpp", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="a fact about the llama.cpp build (version, commit, flags, …)")
    a = p.parse_args(shielded(sys.argv[1:]))
    a.ours = [[v.removeprefix(" ") for v in values] for values in a.ours]
    a.llama = [[v.removeprefix(" ") for v in values] for values in a.llama]

    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                            cwd=Path(__file__).parent, capture_output=True, text=True)
    machines = [json.loads(m.read_text()) for m in a.machine]
    machine = machines[0]
    runs = []
    for fmt, path, bench, log, load, command in a.llama:
        counted = gguf_bytes_per_token(Path(path))
        rates = llama_rates(json.loads(Path(bench).read_text()), a.prompt, a.gen, a.depth)
        timing = time_v(Path(log))
        runs.append({
            "system": "llama.cpp", "format": fmt, "file": path,
            "command": command,
            "load_average_1m_before": float(load),
            **rates, **counted,
            "peak_rss_bytes": timing["peak_rss_bytes"], "wall_s": timing["elapsed_s"],
        })
    for label, pack, bench, log, load, command in a.ours:
        doc = json.loads(Path(bench).read_text())
        run = doc["runs"][0]
        counted = ours_bytes_per_token(a.model_dir, Path(pack) if pack != "-" else None, run)
        reported = run.get("bytes_per_token")
        timing = time_v(Path(log))
        runs.append({
            "system": "candle-qmoe", "format": label, "file": pack if pack != "-" else None,
            "command": command, "load_average_1m_before": float(load),
            # At a depth our prompt rate is the prefill of the whole context: not comparable.
            "prompt_tokens_per_s": None if a.depth else run.get("prefill_tokens_per_s"),
            "context_prefill_tokens_per_s": run.get("prefill_tokens_per_s") if a.depth else None,
            "decode_tokens_per_s": run.get("decode_tokens_per_s"),
            "decode_block_spread": run.get("block_spread"),
            "backend": run.get("backend"), "group_size": run.get("group_size"),
            **counted,
            "bytes_per_token": reported if reported is not None else counted["bytes_per_token"],
            "bytes_per_token_source": "bench JSON" if reported is not None else "counted here",
            "bytes_per_token_counted_here": counted["bytes_per_token"],
            "peak_rss_bytes": timing["peak_rss_bytes"],
            "peak_rss_bytes_in_process": run.get("peak_rss_bytes"),
            "wall_s": timing["elapsed_s"],
            "contract": doc.get("contract"),
        })
    # Each round lists every system once, in the same order: the n-th run of a (system,
    # format) belongs to round n and is measured against that round's bandwidth probe.
    rounds = len(machines)
    seen: dict[tuple[str, str], int] = {}
    for run in runs:
        key = (run["system"], run["format"])
        run["round"] = seen.get(key, 0)
        seen[key] = run["round"] + 1
        read = machines[min(run["round"], rounds - 1)]["read_gb_per_s"]
        rate = run["decode_tokens_per_s"]
        run["achieved_gb_per_s"] = run["bytes_per_token"] * rate / 1e9 if rate else None
        run["fraction_of_read_bandwidth"] = ratio(run["achieved_gb_per_s"], read)
    read_bw = median([m["read_gb_per_s"] for m in machines])

    keys = ["decode_tokens_per_s", "prompt_tokens_per_s", "bytes_per_token",
            "achieved_gb_per_s", "peak_rss_bytes"]
    systems = []
    for key in dict.fromkeys((r["system"], r["format"]) for r in runs):
        mine = [r for r in runs if (r["system"], r["format"]) == key]
        merged = dict(mine[0])
        del merged["round"]
        for k in keys + ["fraction_of_read_bandwidth"]:
            merged[k] = median([r[k] for r in mine])
        merged["peak_rss_bytes"] = max_or_none([r["peak_rss_bytes"] for r in mine])
        if rounds > 1:
            merged["rounds"] = mine
        systems.append(merged)

    def round_ratios(o, l):
        """The ratio of each round's own measurements, then their median."""
        out = {}
        for k in keys:
            per = [ratio(x[k], y[k]) for x in runs for y in runs
                   if (x["system"], x["format"]) == (o["system"], o["format"])
                   and (y["system"], y["format"]) == (l["system"], l["format"])
                   and x["round"] == y["round"]]
            out[k] = median(per)
            if rounds > 1:
                out[k + "_by_round"] = per
        return out

    ratios = [
        {"ours": o["format"], "llama_cpp": l["format"], **round_ratios(o, l)}
        for o in systems if o["system"] == "candle-qmoe"
        for l in systems if l["system"] == "llama.cpp"
    ]
    quantize = {fmt: time_v(Path(log)) for fmt, log in a.quantize}
    convert = None
    if a.convert:
        convert = {"outtype": a.convert[0], **time_v(Path(a.convert[1]))}
    config = json.loads((a.model_dir / "config.json").read_text())
    doc = {
        "schema": "candle-qmoe/vs-llamacpp/1",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit.stdout.strip() if commit.returncode == 0 else None,
        "command": a.command,
        "machine": {
            "cpu": machine.get("cpu"), "cores": a.cores,
            "read_gb_per_s": read_bw,
            "read_gb_per_s_by_round": [m["read_gb_per_s"] for m in machines],
            "copy_gb_per_s": median([m.get("copy_gb_per_s") for m in machines]),
            "bandwidth_threads": machine.get("threads"),
            "bandwidth_probe": "cargo run --release --example mem_bandwidth (parallel XOR read "
                               "of 512 MiB, median of 5)",
        },
        "model": {
            "dir": str(a.model_dir),
            "model_type": config.get("model_type"),
            "hidden_size": config.get("hidden_size"),
            "layers": config.get("num_hidden_layers"),
            "experts": config.get("num_experts"),
            "top_k": config.get("num_experts_per_tok"),
            "vocab_size": config.get("vocab_size"),
        },
        "workload": {
            "prompt_tokens": a.prompt, "generated_tokens": a.gen, "threads": a.threads,
            "repetitions": a.repetitions, "rounds": rounds, "depth": a.depth,
        },
        "llama_cpp": dict(a.llama_cpp),
        "convert": convert,
        "quantize": quantize,
        "systems": systems,
        "ratios_ours_over_llama_cpp": ratios,
        "notes": [
            "bytes_per_token = k/E of the routed experts' bytes + every non-expert weight + the "
            "whole output head + one embedding row (KV cache and activations not counted); "
            "achieved_gb_per_s = bytes_per_token x decode tokens/s",
            "llama.cpp: llama-bench's pp (a batch of prompt_tokens) and tg (generated_tokens "
            "decoded one at a time from an empty context) tests, mean of the repetitions after "
            "its warm-up run; peak RSS of the whole llama-bench process (/usr/bin/time -v)",
            "candle-qmoe: examples/bench.rs, greedy, one request at a time, each templated "
            "prompt cut or repeated to prompt_tokens (--prompt-tokens), then generated_tokens "
            "decoded after it (context prompt_tokens .. prompt_tokens + generated_tokens); "
            "prompt rate = prompt tokens / time to first token; decode rate over the tokens "
            "after the first; peak RSS of the whole process (/usr/bin/time -v), the in-process "
            "figure after its own reset next to it",
            "depth > 0: both decode after depth tokens of context (llama-bench -p 0 -d depth; "
            "our bench --prompt-tokens depth), so the KV cache read per token grows with it (ours "
            "BF16, F32 only under --dtype f32; llama.cpp's F16 by default: "
            "settings.type_k/type_v); no prompt rates compared",
            "llama.cpp repacks Q4_0 and Q4_K weights for the CPU's SIMD at load (settings.repack): "
            "its peak RSS holds the file's mmapped pages plus the repacked copy, and decoding "
            "reads the repacked copy (the same number of bytes)",
            "rounds > 1: the timed runs were repeated in turn (probe, each llama.cpp format, each "
            "run of ours) rounds times; each system's figures are the medians over its rounds "
            "(peak RSS the largest; every round under 'rounds', its achieved bandwidth against "
            "that round's probe), and each ratio is the median of the rounds' own ratios "
            "(the per-round values under '<key>_by_round')",
            "ours reads its non-expert weights in --dense-weights (bf16 by default, the "
            "checkpoint's; int8 and f32 where the format says so) and its routed experts as INT4 "
            "g128 slabs; llama.cpp reads the GGUF's types (quantized by llama-quantize)",
        ],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'system':<12} {'format':<24} {'decode tok/s':>12} {'prompt tok/s':>12} "
          f"{'MB/token':>9} {'GB/s':>6} {'peak RSS MB':>11}")
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    for s in systems:
        print(f"{s['system']:<12} {s['format']:<24} {fmt(s['decode_tokens_per_s'], '.2f'):>12} "
              f"{fmt(s['prompt_tokens_per_s'], '.1f'):>12} "
              f"{fmt(s['bytes_per_token'] / 1e6, '.1f'):>9} "
              f"{fmt(s['achieved_gb_per_s'], '.2f'):>6} "
              f"{fmt(s['peak_rss_bytes'] and s['peak_rss_bytes'] / 1e6, '.0f'):>11}")
    for r in ratios:
        print(f"ours {r['ours']} / llama.cpp {r['llama_cpp']}: decode "
              f"{fmt(r['decode_tokens_per_s'], '.2f')}x, prompt "
              f"{fmt(r['prompt_tokens_per_s'], '.2f')}x (median of the rounds' ratios)")
    print(f"read bandwidth {read_bw:.2f} GB/s (median of {rounds} probes); wrote {a.out}")


if __name__ == "__main__":
    main()
