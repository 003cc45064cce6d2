"""Helpers shared by the server's tests and benchmark: clients, raw requests, metrics, evidence."""

import json
import math
import os
import platform
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def client(url, **kw):
    """The official client on the server at `url` (no retries: a 503 must be seen)."""
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600, **kw)


def raw(url, path, body=None, method=None):
    """(status, headers, body text) of one request; `body` bytes or a JSON-able object."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def metrics(url):
    """The /metrics samples as {'name{labels}': value}."""
    _, _, text = raw(url, "/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def greedy_chat(c, model, prompt, max_tokens):
    """One greedy chat answer: (text, usage, seconds)."""
    start = time.perf_counter()
    r = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return r.choices[0].message.content, r.usage, time.perf_counter() - start


def run_concurrent(jobs, clients):
    """Runs the callables `jobs` on `clients` threads; (results in job order, wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda job: job(), jobs))
    return results, time.perf_counter() - start


def percentile(values, q):
    """The q-th percentile (nearest rank) of `values`."""
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


def evidence():
    """Device, commit, date and load average, as the bench/results files record them."""

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "--short=12", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    return {
        "device": "cpu",
        "cpu": cpu or platform.processor() or None,
        "threads": os.cpu_count(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": list(os.getloadavg()),
        "openai_client": openai.__version__,
    }
