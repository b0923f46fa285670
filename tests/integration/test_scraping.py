"""The scraper against a real local HTTP server that misbehaves in every way the issue names."""

import contextlib
import socket
import socketserver
import threading

import httpx
import pytest

from tuner.signals import engine as engine_signals
from tuner.sources import scraping

GOOD = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 3\n"


class _Handler(socketserver.StreamRequestHandler):
    routes: dict = {}

    def handle(self):
        request_line = self.rfile.readline().decode()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        path = request_line.split(" ")[1]
        action = self.routes[path]
        action(self.wfile)


def _response(status: int, body: bytes, *, content_type="text/plain; version=0.0.4", length=None):
    def send(w):
        n = len(body) if length is None else length
        w.write(f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {n}\r\n"
                "Connection: close\r\n\r\n".encode())
        # the client may stop reading (a body over its limit); the traceback socketserver would print from
        # this thread parses source while the test's thread may too, and Python 3.11's ast is not
        # thread-safe there (SystemError: AST constructor recursion depth mismatch, a crashed worker)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            w.write(body)
    return send


def _chunked_forever(w):
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    try:
        for _ in range(1000):  # 64 MB at most; the client must stop reading long before
            w.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass


@pytest.fixture(scope="module")
def server():
    _Handler.routes = {
        "/good": _response(200, GOOD.encode()),
        "/500": _response(500, b"Internal Server Error"),
        "/500-echo": _response(500, b'{"detail": "bad request from Authorization: Bearer sk-echoed-31337"}',
                               content_type="application/json"),
        "/401-echo": _response(401, b"no key sk-echoed-31337", content_type="text/plain"),
        "/echo/get_model_info": _response(200, b"oops sk-echoed-31337", content_type="text/plain"),
        "/echo/get_server_info": _response(503, b"down sk-echoed-31337", content_type="text/plain"),
        "/html": _response(200, b"<!DOCTYPE html><html><body>login</body></html>", content_type="text/html"),
        "/html-as-text": _response(200, b"<html><body>proxy error</body></html>\n"),
        "/truncated": _response(200, GOOD.encode()[:30], length=len(GOOD)),
        "/cut-mid-line": _response(200, GOOD.encode()[:-3]),
        "/big-declared": _response(200, b"x", length=50 * 1024 * 1024),
        "/big-chunked": _chunked_forever,
        "/nan": _response(200, b"vllm:num_requests_running{engine=\"0\"} NaN\n"),
        "/empty": _response(200, b""),
    }
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def client():
    with scraping.make_client(scraping.HttpSettings(read_timeout_seconds=2)) as c:
        yield c


def _scrape(client, url, limit=1024 * 1024):
    return scraping.scrape(client, url, max_body_bytes=limit, clock=lambda: 42.0)


def test_good_body_parses(server, client):
    snap = _scrape(client, server + "/good")
    assert snap.ok and snap.scraped_at == 42.0
    assert snap.samples("vllm:num_requests_running")[0].value == 3


@pytest.mark.parametrize(("path", "expected"), [
    ("/500", "HTTP 500"),
    ("/html", "HTML page"),
    ("/html-as-text", "HTML page"),
    ("/truncated", "truncated"),
    ("/cut-mid-line", "truncated"),
    ("/big-declared", "exceeds the limit"),
    ("/big-chunked", "exceeds the limit"),
    ("/empty", "empty body"),
])
def test_bad_bodies_give_a_reason_not_an_exception(server, client, path, expected):
    snap = _scrape(client, server + path)
    assert not snap.ok
    assert expected in snap.error, snap.error
    assert snap.source.endswith(path)


def test_unreachable_url(client):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    snap = _scrape(client, f"http://127.0.0.1:{port}/metrics")
    assert not snap.ok
    assert "cannot connect" in snap.error


def test_timeout(client):
    with socket.socket() as s:  # accepts (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with scraping.make_client(scraping.HttpSettings(read_timeout_seconds=0.3)) as fast:
            snap = _scrape(fast, f"http://127.0.0.1:{s.getsockname()[1]}/metrics")
    assert not snap.ok
    assert "timed out" in snap.error


def test_nan_gauge_reads_as_missing_signal(server, client):
    snap = _scrape(client, server + "/nan")
    assert snap.ok
    signals = engine_signals.compute([snap])
    assert signals["requests_running"].value is None
    assert "NaN" in signals["requests_running"].reason  # not a partial sum, not "absent"


def test_failed_scrape_marks_the_window_invalid(server, client):
    good1 = scraping.scrape(client, server + "/good", max_body_bytes=10**6, clock=lambda: 0.0)
    bad = scraping.scrape(client, server + "/500", max_body_bytes=10**6, clock=lambda: 15.0)
    good2 = scraping.scrape(client, server + "/good", max_body_bytes=10**6, clock=lambda: 30.0)
    signals = engine_signals.compute([good1, bad, good2])
    assert signals["requests_running"].value == 3  # the latest scrape is fine
    assert signals["request_rate"].value is None
    assert "window invalid" in signals["request_rate"].reason
    assert "HTTP 500" in signals["request_rate"].reason


def test_bearer_token_is_sent():
    seen = {}

    def handler(request):
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, text=GOOD)

    settings = scraping.HttpSettings(bearer_token="s3cret")
    with scraping.make_client(settings, transport=httpx.MockTransport(handler)) as c:
        assert scraping.scrape(c, "http://engine/metrics", max_body_bytes=10**6).ok
    assert seen["auth"] == "Bearer s3cret"
    assert "s3cret" not in repr(settings)


def test_base_url():
    assert scraping.base_url("http://h:8000/metrics") == "http://h:8000"
    assert scraping.base_url("https://h/vllm/metrics/") == "https://h/vllm"


@pytest.mark.parametrize(("path", "expected"), [
    ("/500-echo", "HTTP 500 (application/json, 68 bytes)"),
    ("/401-echo", "HTTP 401 (text/plain, 22 bytes)"),
])
def test_an_error_response_body_is_never_copied_into_the_reason(server, client, path, expected):
    """An engine's (or a proxy's) error page can echo a request, a header, a token: the reason says what
    the response was, not what it said."""
    snap = _scrape(client, server + path)
    assert snap.error == expected
    assert "sk-echoed" not in snap.error and "Bearer" not in snap.error


def test_a_body_that_is_not_json_is_not_copied_into_the_engine_info_error(server):
    from tuner.sources.engines import EngineClient

    with EngineClient() as engine:
        info = engine.info(server + "/echo", "sglang")
    assert info.error is not None and "not valid JSON" in info.error and "HTTP 503" in info.error
    assert "sk-echoed" not in info.error and "oops" not in info.error
