"""The server keeps idle connections open longer than the clients' pool expiry (httpx: 5 s), so a
request sent on a reused connection is never met by a server closing it (uvicorn's default, 5 s, races
with httpx's and failed a request under load as a connection error)."""

import http.client
import time

import pytest

from minimax_jax.serve.server import KEEP_ALIVE_S, in_thread

fastapi = pytest.importorskip("fastapi")


def test_a_connection_idle_past_the_client_expiry_still_serves_the_next_request():
    app = fastapi.FastAPI()

    @app.get("/ping")
    def ping():
        return {"ok": True}

    assert KEEP_ALIVE_S > 5.0
    with in_thread(app) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/ping")
        first = conn.getresponse()
        assert first.status == 200 and first.read() == b'{"ok":true}'
        sock = conn.sock
        time.sleep(6.0)                      # longer than uvicorn's default keep-alive (5 s)
        conn.request("GET", "/ping")         # http.client reuses the socket; it raises if it was closed
        second = conn.getresponse()
        assert conn.sock is sock and second.status == 200 and second.read() == b'{"ok":true}'
        conn.close()
