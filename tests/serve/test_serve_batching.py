"""Continuous batching through the real ``openai`` client: concurrent clients with mixed prompt and
completion lengths are batched together and each gets what it gets when served alone (greedy); a
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
         "FIRST CITIZEN:\nBefore we proceed any further, hear me speak. " * 12,     # > 256 tokens: two chunks
         "HAMLET:\nTo be, or not to be", "import numpy as np\n", "MACBETH:\nIs this a dagger " * 5,
         "PORTIA:\nThe quality of mercy is not strained", "LEAR:\nBlow, winds"]


@pytest.fixture(scope="module")
def srv():
    with running(load_model(None, log=lambda _m: None), max_batch=8, max_len=512) as r:
        yield r


def _ask(srv, i: int):
    r = srv.client.completions.create(model=MODEL, prompt=LINES[i], max_tokens=3 + i % 5, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens


def test_concurrent_clients_get_what_they_get_alone(srv):
    assert len(LINES) > srv.scheduler.max_batch          # some wait in the queue for a free slot
    assert len(srv.scheduler.gen.encode(LINES[4])) > srv.scheduler.engine.prefill_chunk   # a chunked prefill
    alone = [_ask(srv, i) for i in range(len(LINES))]
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], srv.scheduler.active_count)
            time.sleep(0.005)

    w = threading.Thread(target=watch)
    w.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(LINES)) as pool:
            together = list(pool.map(lambda i: _ask(srv, i), range(len(LINES))))
    finally:
        stop.set()
        w.join()
    assert together == alone
    assert peak[0] > 1                                      # they really were decoded together
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
