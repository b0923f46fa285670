"""HTTP scraping of Prometheus text endpoints (engines, dcgm-exporter) with httpx.

``scrape()`` never raises: every failure — refused connection, timeout, HTTP 500, an HTML page, a
truncated or oversized body, an exposition Prometheus would refuse — comes back as a Snapshot whose
``error`` says what happened, so the window that holds it is marked invalid and the cycle says why.
A reason names the status, the content type and the size of a bad response, never its body.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx

from tuner.errors import SourceError
from tuner.model import snapshots

ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"
ACCEPT_ENCODING = "gzip, identity"
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


@dataclass(frozen=True)
class HttpSettings:
    connect_timeout_seconds: float = 2.0
    read_timeout_seconds: float = 5.0
    max_body_bytes: int = 16 * 1024 * 1024
    bearer_token: str | None = field(default=None, repr=False)
    verify: bool | str = True  # False, True, or a CA bundle path
    client_cert: str | None = None

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.read_timeout_seconds, connect=self.connect_timeout_seconds)


def make_client(settings: HttpSettings, *, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    headers = {"Accept": ACCEPT, "Accept-Encoding": ACCEPT_ENCODING, "User-Agent": "vllm-tuner"}
    if settings.bearer_token:
        headers["Authorization"] = f"Bearer {settings.bearer_token}"
    return httpx.Client(
        timeout=settings.timeout(), headers=headers, verify=settings.verify, cert=settings.client_cert,
        transport=transport, follow_redirects=False,
    )


def fetch_text(client: httpx.Client, url: str, *, max_body_bytes: int) -> str:
    """GET ``url`` and return its body as text; raises SourceError with a clear reason."""
    try:
        with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise SourceError(url, f"HTTP {response.status_code}{_shape(response)}")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
                raise SourceError(url, f"body of {int(declared)} bytes exceeds the limit of {max_body_bytes}")
            body = _read_bounded(response, url, max_body_bytes)
            content_type = response.headers.get("content-type", "")
    except SourceError:
        raise
    except httpx.TimeoutException as exc:
        raise SourceError(url, f"timed out ({type(exc).__name__})") from exc
    except httpx.ConnectError as exc:
        raise SourceError(url, f"cannot connect: {exc}") from exc
    except httpx.RemoteProtocolError as exc:
        raise SourceError(url, f"connection broke mid-response (truncated body?): {exc}") from exc
    except httpx.HTTPError as exc:
        raise SourceError(url, f"{type(exc).__name__}: {exc}") from exc
    if "html" in content_type.lower() or body.lstrip()[:15].lower().startswith((b"<!doctype", b"<html")):
        raise SourceError(url, f"got an HTML page (content-type {content_type or 'unset'}), not metrics")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(url, f"body is not UTF-8 text: {exc}") from exc
    return text


def _read_bounded(response: httpx.Response, url: str, limit: int) -> bytes:
    """The body, decoded, with the *decoded* bytes bounded as they are produced: a 2 KB doubly-gzipped
    answer must not allocate a gibibyte before a limit is checked. One ``gzip`` or ``deflate`` layer is
    decoded (``ACCEPT_ENCODING`` asks for nothing else); stacked or other encodings are refused."""
    if response.is_stream_consumed:  # an answer built in memory (a test's transport): already decoded
        if len(response.content) > limit:
            raise SourceError(url, f"body exceeds the limit of {limit} bytes (decoded); stopped reading")
        return response.content
    encodings = [e.strip().lower() for e in response.headers.get("content-encoding", "").split(",") if e.strip()]
    encodings = [e for e in encodings if e != "identity"]
    if len(encodings) > 1 or (encodings and encodings[0] not in _WBITS):
        raise SourceError(url, f"Content-Encoding {', '.join(encodings)[:60]} refused (the tuner asks for "
                               f"{ACCEPT_ENCODING} and decodes one layer)")
    inflate = zlib.decompressobj(_WBITS[encodings[0]]) if encodings else None
    chunks: list[bytes] = []
    size = 0
    for raw in response.iter_raw():
        pending = raw
        while pending:
            if inflate is None:
                out, pending = pending, b""
            else:
                try:
                    out = inflate.decompress(pending, limit + 1 - size)
                except zlib.error as exc:
                    raise SourceError(url, f"body does not decode as {encodings[0]} ({exc})") from None
                pending = inflate.unconsumed_tail
            size += len(out)
            if size > limit:
                raise SourceError(url, f"body exceeds the limit of {limit} bytes (decoded); stopped reading")
            chunks.append(out)
            if inflate is not None and inflate.eof:
                break
    return b"".join(chunks)


def _shape(response: httpx.Response) -> str:
    """What an error response was, never what it said: its body is not copied into a reason or a log
    (an engine's error page can echo a request, a header, a token). The content type and declared size."""
    content_type = response.headers.get("content-type", "").split(";")[0].strip()[:60]
    length = response.headers.get("content-length", "")
    shape = ", ".join(x for x in (content_type, f"{length} bytes" if length.isdigit() else "") if x)
    return f" ({shape})" if shape else ""


def scrape(
    client: httpx.Client,
    url: str,
    *,
    max_body_bytes: int,
    keep_prefixes: tuple[str, ...] | None = None,
    clock: Callable[[], float] = time.time,
    limits: snapshots.SeriesLimits = snapshots.DEFAULT_LIMITS,
) -> snapshots.Snapshot:
    """One scrape of a Prometheus text endpoint; never raises. The body is validated by
    ``snapshots.parse`` (the same checks as for a saved file); ``limits`` caps its series."""
    scraped_at = clock()
    try:
        text = fetch_text(client, url, max_body_bytes=max_body_bytes)
    except SourceError as exc:
        return snapshots.Snapshot.failed(scraped_at, exc.reason, source=url)
    # An empty or cut body, duplicate series, too many series…: validated where saved files are too.
    return snapshots.parse(text, scraped_at, source=url, keep_prefixes=keep_prefixes, limits=limits)


def base_url(metrics_url: str) -> str:
    """``http://h:8000/metrics`` → ``http://h:8000``."""
    parts = urlsplit(metrics_url)
    path = parts.path
    for suffix in ("/metrics/", "/metrics"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))
