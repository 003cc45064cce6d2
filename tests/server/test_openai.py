"""The server through the official `openai` client (and raw HTTP for malformed bodies).

Usage: python tests/server/test_openai.py URL   (a server on `--synthetic tiny --cpu`; the
full-queue test starts its own `--parallel 1 --queue 1` server from $QMOE_SERVER_BIN).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest

import openai

from common import client, metrics, raw

URL = None


def wait_until(condition, what, polls=300):
    """Polls `condition` every 0.1 s, `polls` times at most (counted, not timed: a paused
    machine does not use the allowance up)."""
    for _ in range(polls):
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting until {what}")


class Api(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = client(URL)
        cls.model = cls.c.models.list().data[0].id

    def chat(self, **kw):
        kw.setdefault("messages", [{"role": "user", "content": "What is a mixture of experts?"}])
        return self.c.chat.completions.create(model=self.model, **kw)

    def complete(self, **kw):
        kw.setdefault("prompt", "The capital of France is")
        return self.c.completions.create(model=self.model, **kw)

    def check_usage(self, usage, completion_tokens=None):
        self.assertGreater(usage.prompt_tokens, 0)
        self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)
        if completion_tokens is not None:
            self.assertEqual(usage.completion_tokens, completion_tokens)

    def test_models_health_metrics(self):
        models = self.c.models.list().data
        self.assertEqual(len(models), 1)
        self.assertEqual(raw(URL, "/health")[0], 200)
        self.chat(max_tokens=2, temperature=0)
        m = metrics(URL)
        for name in [
            "qmoe_prompt_tokens_total",
            "qmoe_generated_tokens_total",
            "qmoe_queue_length",
            "qmoe_slots_busy",
            "qmoe_decode_tokens_per_second",
            "qmoe_expert_bytes_read_total",
        ]:
            self.assertIn(name, m)
        self.assertGreater(m['qmoe_requests_total{endpoint="/v1/chat/completions",status="200"}'], 0)
        self.assertGreater(m["qmoe_generated_tokens_total"], 0)
        # The per-part tally is exported only with --profile (OwnServer below).
        self.assertFalse([k for k in m if k.startswith("qmoe_forward_")])

    def test_metrics_are_openmetrics_and_idle_gauges_fall_to_zero(self):
        _, headers, text = raw(URL, "/metrics")
        content_type = {k.lower(): v for k, v in headers.items()}["content-type"]
        self.assertEqual(content_type, "application/openmetrics-text; version=1.0.0; charset=utf-8")
        self.assertTrue(text.endswith("# EOF\n"))
        stream = self.complete(max_tokens=3000, temperature=0, stream=True)
        next(iter(stream))
        stream.close()
        wait_until(lambda: metrics(URL)["qmoe_slots_busy"] == 0, "the slot is freed")
        self.assertEqual(metrics(URL)["qmoe_kv_cache_bytes"], 0)
        # The rate is over the steps of the last 10 s.
        time.sleep(10.5)
        self.assertEqual(metrics(URL)["qmoe_decode_tokens_per_second"], 0)

    def test_chat_greedy_stream_equals_non_stream_with_usage(self):
        r = self.chat(max_tokens=12, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        choice = r.choices[0]
        self.assertEqual(choice.message.role, "assistant")
        self.assertIn(choice.finish_reason, ("stop", "length"))
        if choice.finish_reason == "length":
            self.check_usage(r.usage, 12)
        chunks = list(self.chat(max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        self.assertEqual(text, choice.message.content)
        finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        self.assertEqual(finals, [choice.finish_reason])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.model_dump(), r.usage.model_dump())
        # Without include_usage no chunk carries usage.
        plain = list(self.chat(max_tokens=3, temperature=0, stream=True))
        self.assertTrue(all(ch.usage is None for ch in plain))

    def test_completions_greedy_stream_equals_non_stream(self):
        r = self.complete(max_tokens=10, temperature=0)
        self.assertEqual(r.object, "text_completion")
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.check_usage(r.usage, 10)
        stream = self.complete(max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        self.assertEqual("".join(ch.choices[0].text for ch in chunks if ch.choices), r.choices[0].text)
        self.assertEqual(chunks[-1].usage.completion_tokens, 10)

    def test_max_completion_tokens_and_seeded_sampling(self):
        r = self.chat(max_completion_tokens=5, temperature=0)
        self.check_usage(r.usage, 5)
        a = self.complete(max_tokens=8, temperature=1.0, top_p=0.9, seed=7).choices[0].text
        b = self.complete(max_tokens=8, temperature=1.0, top_p=0.9, seed=7).choices[0].text
        self.assertEqual(a, b)

    def test_stop_strings_are_cut_and_not_sent(self):
        full = self.complete(max_tokens=24, temperature=0).choices[0].text
        words = re.findall(r"\S{3,}", full[4:])
        self.assertTrue(words, f"no word to stop at in {full!r}")
        stop = words[len(words) // 2]
        want = full[: full.index(stop)]
        for stops in (stop, ["never-generated-zzz", stop]):
            r = self.complete(max_tokens=24, temperature=0, stop=stops)
            self.assertEqual(r.choices[0].text, want)
            self.assertEqual(r.choices[0].finish_reason, "stop")
            self.assertLess(r.usage.completion_tokens, 24)
            streamed = "".join(ch.choices[0].text for ch in self.complete(max_tokens=24, temperature=0, stop=stops, stream=True))
            self.assertEqual(streamed, want)

    def test_multi_turn_messages_use_the_chat_template(self):
        one = self.chat(max_tokens=1, temperature=0).usage.prompt_tokens
        turns = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is a mixture of experts?"},
            {"role": "assistant", "content": "A routed network."},
            {"role": "user", "content": [{"type": "text", "text": "Say more."}]},
        ]
        r = self.chat(messages=turns, max_tokens=2, temperature=0)
        self.assertGreater(r.usage.prompt_tokens, one + 10)

    def test_a_tiny_top_p_keeps_the_most_probable_token(self):
        greedy = self.complete(max_tokens=4, temperature=0).choices[0].text
        # 1e-46 is 0 in f32.
        self.assertEqual(self.complete(max_tokens=4, temperature=1, top_p=1e-46).choices[0].text, greedy)

    def test_a_last_token_inside_a_character_is_sent(self):
        # The greedy answer's first token is the start of a UTF-8 sequence.
        kw = dict(prompt=list(range(1000, 1063)), max_tokens=1, temperature=0)
        r = self.complete(**kw)
        self.check_usage(r.usage, 1)
        self.assertEqual(r.choices[0].text, "\ufffd")
        self.assertEqual("".join(ch.choices[0].text for ch in self.complete(stream=True, **kw)), "\ufffd")

    def test_a_chat_stream_opens_with_the_role_even_when_empty(self):
        full = self.chat(max_tokens=8, temperature=0).choices[0].message.content
        self.assertTrue(full)
        # Stopping at the answer's first character leaves it empty.
        chunks = list(self.chat(max_tokens=8, temperature=0, stop=full[0], stream=True))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        self.assertEqual("".join(ch.choices[0].delta.content or "" for ch in chunks), "")
        self.assertEqual(chunks[-1].choices[0].finish_reason, "stop")
        roles = [ch.choices[0].delta.role for ch in self.chat(max_tokens=3, temperature=0, stream=True)]
        self.assertEqual(roles, ["assistant"] + [None] * (len(roles) - 1))

    def test_routes_and_bodies_outside_the_api_get_openai_errors(self):
        for method, path, status in [("GET", "/v1/nope", 404), ("POST", "/v1/models", 405), ("GET", "/v1/chat/completions", 405)]:
            code, headers, text = raw(URL, path, b"{}" if method == "POST" else None, method)
            self.assertEqual(code, status, (method, path, text))
            self.assertEqual(json.loads(text)["error"]["type"], "invalid_request_error")
        self.assertEqual(json.loads(raw(URL, "/v1/nope")[2])["error"]["message"], "Invalid URL (GET /v1/nope)")
        code, headers, text = raw(URL, "/v1/completions", {"prompt": "a " * 1_500_000, "max_tokens": 1})
        self.assertEqual(code, 413)
        self.assertEqual(json.loads(text)["error"]["type"], "invalid_request_error")
        self.assertEqual(self.c.models.retrieve(self.model).id, self.model)
        with self.assertRaises(openai.NotFoundError) as e:
            self.c.models.retrieve("no-such-model")
        self.assertEqual(e.exception.code, "model_not_found")

    def test_prompt_forms(self):
        ids = list(range(100, 110))
        want = self.complete(prompt=ids, max_tokens=3, temperature=0).choices[0].text
        self.assertEqual(self.complete(prompt=[ids], max_tokens=3, temperature=0).choices[0].text, want)
        for prompt in ([ids, ids], ["a", "b"]):
            code, _, text = raw(URL, "/v1/completions", {"prompt": prompt})
            self.assertEqual(code, 400)
            self.assertIn("2 prompts", json.loads(text)["error"]["message"])
        code, _, text = raw(URL, "/v1/completions", {"prompt": {"x": 1}})
        self.assertEqual(code, 400)
        self.assertIn("a string, a list of token ids", json.loads(text)["error"]["message"])

    def test_at_most_four_stop_strings(self):
        self.check_usage(self.complete(max_tokens=2, temperature=0, stop=["w", "x", "y", "z"]).usage)
        with self.assertRaises(openai.BadRequestError) as e:
            self.complete(max_tokens=2, stop=["v", "w", "x", "y", "z"])
        self.assertEqual(e.exception.body["param"], "stop")

    def test_unsupported_fields_are_refused(self):
        msgs = [{"role": "user", "content": "hi"}]
        self.assert_error(400, {"messages": msgs, "logprobs": True}, "logprobs")
        self.assert_error(400, {"messages": msgs, "top_logprobs": 2}, "top_logprobs")
        self.assert_error(400, {"messages": msgs, "response_format": {"type": "json_object"}}, "response_format")
        for field, value in [("echo", True), ("logprobs", 0)]:
            code, _, text = raw(URL, "/v1/completions", {"prompt": "hi", field: value})
            self.assertEqual((code, json.loads(text)["error"]["param"]), (400, field))
        # Their neutral values are accepted.
        ok = {"logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}}
        self.check_usage(self.chat(max_tokens=1, extra_body=ok).usage, 1)
        self.check_usage(self.complete(max_tokens=1, echo=False, logprobs=None).usage, 1)

    def test_unknown_fields_are_ignored(self):
        r = self.chat(max_tokens=2, temperature=0, extra_body={"frobnicate": {"x": 1}, "logit_bias": None})
        self.check_usage(r.usage, 2)

    def assert_error(self, status, body, param=None):
        code, _, text = raw(URL, "/v1/chat/completions", body)
        self.assertEqual(code, status, text)
        err = json.loads(text)["error"]
        self.assertEqual(set(err), {"message", "type", "param", "code"})
        self.assertEqual(err["type"], "invalid_request_error")
        self.assertEqual(err["param"], param)
        return err["message"]

    def test_bad_requests_are_400_naming_the_field(self):
        msgs = [{"role": "user", "content": "hi"}]
        self.assert_error(400, b'{"messages": [', None)
        self.assertIn("max_tokens", self.assert_error(400, {"messages": msgs, "max_tokens": "ten"}, "max_tokens"))
        self.assert_error(400, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content")
        self.assert_error(400, {"messages": msgs, "temperature": 3}, "temperature")
        self.assert_error(400, {"messages": msgs, "n": 2}, "n")
        self.assert_error(400, {"messages": []}, "messages")
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(n=2)
        self.assertEqual(e.exception.status_code, 400)
        with self.assertRaises(openai.BadRequestError) as e:
            self.complete(prompt="hello " * 5000, max_tokens=1)
        self.assertIn("--ctx", str(e.exception))

    def test_long_prompts_do_not_stall_other_requests(self):
        body = {"prompt": "hello " * 330_000, "max_tokens": 1}  # 2 MB of text: over --ctx, a 400
        threads = [threading.Thread(target=raw, args=(URL, "/v1/completions", body)) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # while they are tokenized (about 0.7 s each, as many at once as cores)
        self.assertEqual(raw(URL, "/health")[0], 200)
        # An order, not a time (CI machines are busy): /health did not wait for them all.
        still_running = sum(t.is_alive() for t in threads)
        for t in threads:
            t.join()
        self.assertGreater(still_running, 0, "/health waited for every long prompt")

    def test_client_disconnect_frees_the_slot(self):
        before = metrics(URL)["qmoe_generated_tokens_total"]
        stream = self.complete(max_tokens=3000, temperature=0, stream=True)
        next(iter(stream))
        stream.close()
        wait_until(lambda: metrics(URL)["qmoe_slots_busy"] == 0, "the slot is freed")
        self.assertLess(metrics(URL)["qmoe_generated_tokens_total"] - before, 3000)


def spawn_server(*flags):
    """A second server from $QMOE_SERVER_BIN on the tiny model with `flags`: (process, URL)."""
    cmd = [os.environ["QMOE_SERVER_BIN"], "--synthetic", "tiny", "--cpu", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            # Keep reading its output so that it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise AssertionError(f"the server did not start: {proc.wait()}")


def post(path, body):
    """A complete HTTP/1.1 POST of the JSON `body`, as bytes."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


def connect(url, data):
    """A socket to the server at `url` that has sent `data`."""
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(data)
    return s


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


@unittest.skipUnless(os.environ.get("QMOE_SERVER_BIN"), "QMOE_SERVER_BIN not set")
class OwnServer(unittest.TestCase):
    def test_profile_exports_time_and_calls_per_part(self):
        proc, url = spawn_server("--profile")
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
            self.assertEqual(raw(url, "/v1/completions", body)[0], 200)
            first = metrics(url)
            self.assertEqual(raw(url, "/v1/completions", body)[0], 200)
            m = metrics(url)
            for part in ["qkv_projection", "attention", "routed_experts", "lm_head"]:
                seconds = f'qmoe_forward_seconds_total{{part="{part}"}}'
                calls = f'qmoe_forward_calls_total{{part="{part}"}}'
                self.assertGreater(first[seconds], 0, part)
                # Counters: the second request adds its passes to the first's.
                self.assertGreater(m[seconds], first[seconds], part)
                self.assertGreater(m[calls], first[calls], part)
            # lm_head once per forward pass (prefill, then 3 decode steps), attention once per
            # layer and pass.
            lm_head = m['qmoe_forward_calls_total{part="lm_head"}']
            self.assertEqual(lm_head, 8)
            attention = m['qmoe_forward_calls_total{part="attention"}']
            self.assertEqual(attention % lm_head, 0)
        finally:
            stop(proc)

    def test_full_queue_is_503_with_retry_after(self):
        proc, url = spawn_server("--parallel", "1", "--queue", "1")
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
            results = [None] * 6

            def call(i):
                results[i] = raw(url, "/v1/completions", body)

            threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
                time.sleep(0.05)
            for t in threads:
                t.join()
            codes = sorted(r[0] for r in results)
            self.assertEqual(set(codes), {200, 503})
            busy = next(r for r in results if r[0] == 503)
            self.assertEqual(busy[1].get("retry-after") or busy[1].get("Retry-After"), "1")
            self.assertEqual(json.loads(busy[2])["error"]["type"], "server_error")
            proc.terminate()
            self.assertEqual(proc.wait(timeout=30), 0)
        finally:
            stop(proc)

    def test_non_streaming_disconnect_frees_the_slot(self):
        proc, url = spawn_server("--parallel", "1")
        try:
            host, port = url.split("//")[1].split(":")
            body = json.dumps({"prompt": "Hi", "max_tokens": 3000, "temperature": 0}).encode()
            with socket.create_connection((host, int(port))) as s:
                head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                s.sendall(head.encode() + body)
                wait_until(lambda: metrics(url)["qmoe_generated_tokens_total"] >= 5, "tokens come")
            wait_until(lambda: metrics(url)["qmoe_slots_busy"] == 0, "the slot is freed")
            self.assertLess(metrics(url)["qmoe_generated_tokens_total"], 3000)
        finally:
            stop(proc)

    def test_sigterm_cancels_what_the_grace_period_does_not_finish(self):
        proc, url = spawn_server("--shutdown-grace-secs", "1")
        try:
            result = []
            body = {"prompt": "Hi", "max_tokens": 3000, "temperature": 0}
            t = threading.Thread(target=lambda: result.append(raw(url, "/v1/completions", body)))
            t.start()
            wait_until(lambda: metrics(url)["qmoe_generated_tokens_total"] >= 5, "tokens come")
            proc.terminate()
            self.assertEqual(proc.wait(timeout=120), 0)
            t.join()
            status, _, text = result[0]
            self.assertEqual(status, 500)
            self.assertIn("shutting down", json.loads(text)["error"]["message"])
        finally:
            stop(proc)

    def test_sigterm_exits_although_a_client_never_finishes_its_request(self):
        proc, url = spawn_server("--shutdown-grace-secs", "1")
        try:
            held = [
                connect(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len"),
                connect(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"),
            ]
            time.sleep(0.3)
            proc.terminate()
            # The grace period, then 2 s for the connections still open.
            self.assertEqual(proc.wait(timeout=10), 0)
            for s in held:
                s.close()
        finally:
            stop(proc)

    def test_a_second_signal_cuts_the_grace_period_short(self):
        proc, url = spawn_server("--shutdown-grace-secs", "600")
        try:
            held = connect(url, b"GET /health HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.3)
            proc.terminate()
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            self.assertEqual(proc.wait(timeout=10), 0)
            held.close()
        finally:
            stop(proc)

    def test_clients_that_leave_the_queue_free_their_place(self):
        proc, url = spawn_server("--parallel", "1", "--queue", "2")
        try:
            c = client(url)
            running = c.completions.create(model="m", prompt="Hi", max_tokens=3000, temperature=0, stream=True)
            next(iter(running))
            queued = [
                connect(url, post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": stream}))
                for stream in (False, True)
            ]
            wait_until(lambda: metrics(url)["qmoe_queue_length"] == 2, "both wait")
            for s in queued:
                s.close()
            wait_until(lambda: metrics(url)["qmoe_queue_length"] == 0, "they leave the queue")
            result = []
            t = threading.Thread(target=lambda: result.append(raw(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})))
            t.start()
            wait_until(lambda: metrics(url)["qmoe_queue_length"] == 1, "a new request waits")
            running.close()
            t.join()
            self.assertEqual(result[0][0], 200, result[0][2])
        finally:
            stop(proc)


if __name__ == "__main__":
    URL = sys.argv.pop(1).rstrip("/")
    unittest.main(verbosity=2)
