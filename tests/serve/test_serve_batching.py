"""Continuous batching through the real ``openai`` client: 8 (16: slow) concurrent clients with mixed
prompt and completion lengths are batched together and each gets what it gets when served alone (greedy); a
client that disconnects mid-stream (or hangs up on a non-streaming request) has its sequence cancelled
and its slot and pages freed."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import pytest

from minimax_jax.infer.loading import load_model
from tests.serve.serving import running

MODEL = "demo"
LINES = ["ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou", "def main(",
         "KING HENRY:\nOnce more unto the breach, dear friends, once more; " * 3,
         "FIRST CITIZEN:\nBefore we proceed any further, hear me speak. " * 12,     # 276 tokens: five chunks
         "HAMLET:\nTo be, or not to be", "import numpy as np\n", "MACBETH:\nIs this a dagger " * 5,
         "PORTIA:\nThe quality of mercy is not strained", "LEAR:\nBlow, winds"]


@pytest.fixture(scope="module")
def srv():
    with running(load_model(None, log=lambda _m: None), max_batch=4, max_len=512, prefill_chunk=64) as r:
        yield r


def _client(i: int) -> tuple[str, int]:
    """Client ``i``'s prompt and max_tokens: the lines, short ones repeated more for later clients
    (5 to 276 tokens; the longest needs two prefill chunks), 2 to 12 tokens out."""
    line = LINES[i % len(LINES)]
    reps = 1 if len(line) > 200 else 1 + i // len(LINES)
    return f"{i}. " + line * reps, 2 + (7 * i) % 11


def _ask(srv, i: int):
    prompt, max_tokens = _client(i)
    r = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason


@pytest.mark.parametrize("clients", [8, pytest.param(16, marks=pytest.mark.slow)])
def test_concurrent_clients_get_what_they_get_alone(srv, clients):
    """``clients`` concurrent clients of mixed prompt / completion lengths (more than the engine's slots:
    some wait for a free one) are all answered, each with exactly what it gets served alone."""
    sched = srv.scheduler
    assert clients >= 2 * sched.max_batch
    lengths = [len(sched.gen.encode(_client(i)[0])) for i in range(clients)]
    assert max(lengths) > sched.engine.prefill_chunk and min(lengths) < 16       # a chunked prefill, short ones
    assert max(lengths) + 12 <= sched.max_len
    alone = [_ask(srv, i) for i in range(clients)]
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], sched.active_count)
            time.sleep(0.005)

    w = threading.Thread(target=watch)
    w.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            together = list(pool.map(lambda i: _ask(srv, i), range(clients)))
    finally:
        stop.set()
        w.join()
    assert len(together) == clients and all(t[1] >= 1 for t in together)
    assert together == alone
    assert len({t[0] for t in alone}) > clients // 2                   # not one answer for everybody
    assert peak[0] > 1                                                 # they really were decoded together
    assert srv.wait_idle()


def test_a_client_that_disconnects_frees_its_slot_and_pages(srv):
    m, pool = srv.server.metrics, srv.scheduler.engine.pool
    cancelled, generated = m.finished_by["cancelled"], m.generated
    stream = srv.client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=400, temperature=0, stream=True)
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got >= 3:
            break
    assert srv.scheduler.active_count == 1
    stream.close()
    assert srv.wait_idle(timeout=30)
    assert m.finished_by["cancelled"] == cancelled + 1
    assert m.generated - generated < 400                      # stopped well before max_tokens
    assert pool.num_free == pool.num_pages - 1               # no page is referenced any more
    assert all(s is None for s in srv.scheduler.engine.seqs)


def test_a_non_streaming_client_that_hangs_up_is_cancelled_too(srv):
    m = srv.server.metrics
    cancelled = m.finished_by["cancelled"]
    body = json.dumps({"model": MODEL, "prompt": "ROMEO:", "max_tokens": 400, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    end = time.monotonic() + 30
    while srv.scheduler.active_count == 0 and time.monotonic() < end:
        time.sleep(0.02)
    assert srv.scheduler.active_count == 1
    sock.close()
    assert srv.wait_idle(timeout=30)
    assert m.finished_by["cancelled"] == cancelled + 1
