"""A small HTTP server for the status page: asyncio in a thread of its own.

The standard library's ThreadingHTTPServer gave each connection a thread
and never timed a read out, with a listen backlog of 5: 500 sockets that
sent half a request and then nothing held 500 threads for good, and a
burst of 200 GETs overflowed the listen queue (421 overflows, replies
after up to 60 s; issue 26). Here:

* connections are accepted, and their request line, headers and (small)
  body read, in one event loop: an idle or slow client costs a socket and
  a coroutine, never a thread, and is answered 408 and closed once
  ``header_timeout`` passes without a whole request (nginx's
  ``client_header_timeout``, 60 s there; 15 s here, where requests are a
  line and a few headers);
* at most ``max_connections`` are open at once; past that a new one is
  answered 503 and closed at once;
* a complete request runs on a pool of ``workers`` threads (routes read
  the job registry and take its locks: they must not run in the loop), so
  a burst queues for the pool instead of starting a thread per request;
* the listen backlog is ``backlog`` (the kernel caps it at somaxconn);
* one request per connection (``Connection: close``), as the standard
  library's server did by default: the pages' script and Prometheus open
  a connection per request anyway, and no idle keep-alive socket lingers;
* a response the client does not read within ``write_timeout`` is
  abandoned.

It knows nothing of the routes: ``app(Request) -> Response``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import email.utils
import http
import http.client
import io
import logging
import socket
import threading
from typing import Callable
from typing import Optional

_LOGGER = logging.getLogger(__name__)

# A request line longer than this is refused (414) before any lookup.
MAX_REQUEST_LINE = 2048
# The request's header lines, all together, at most (431 past it).
MAX_HEADER_BYTES = 16 << 10
HEADER_TIMEOUT_SECS = 15.0
WRITE_TIMEOUT_SECS = 30.0
LINGER_SECS = 2.0
BACKLOG = 512
MAX_CONNECTIONS = 512
WORKERS = 8


@dataclasses.dataclass
class Request:
  method: str
  path: str  # the request target as sent: path and query
  version: str  # 'HTTP/1.1'
  headers: http.client.HTTPMessage  # case-insensitive .get()
  body: bytes = b''


@dataclasses.dataclass
class Response:
  status: int
  content_type: str
  body: bytes
  headers: dict = dataclasses.field(default_factory=dict)


def plain(status: int, text: str) -> Response:
  return Response(status, 'text/plain; charset=utf-8',
                  (text.rstrip('\n') + '\n').encode('utf-8'))


class _Refused(Exception):
  """The request cannot be read: answer this and close."""
  def __init__(self, response: Response):
    super().__init__(response.status)
    self.response = response


def _encode(response: Response) -> bytes:
  try:
    reason = http.HTTPStatus(response.status).phrase
  except ValueError:
    reason = ''
  lines = [f'HTTP/1.1 {response.status} {reason}',
           'Server: beam-pyspark',
           f'Date: {email.utils.formatdate(usegmt=True)}',
           'Connection: close',
           f'Content-Type: {response.content_type}',
           f'Content-Length: {len(response.body)}']
  for name, value in response.headers.items():
    # Header values are ours (a job page's path at most): no line breaks.
    lines.append(f'{name}: {str(value).replace(chr(13), "").replace(chr(10), "")}')
  head = '\r\n'.join(lines) + '\r\n\r\n'
  return head.encode('latin-1', 'replace') + response.body


def _listening_socket(host: str, port: int, backlog: int) -> socket.socket:
  """Bound and listening now, so that the caller learns the port, or why
  not, before the loop starts. IPv4 first for a name (as the standard
  library's server did: 'localhost' is 127.0.0.1 there)."""
  infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                             flags=socket.AI_PASSIVE)
  infos.sort(key=lambda info: info[0] != socket.AF_INET)
  error: Optional[OSError] = None
  for family, kind, proto, _, address in infos:
    sock = socket.socket(family, kind, proto)
    try:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      sock.bind(address)
      sock.listen(backlog)
      sock.setblocking(False)
      return sock
    except OSError as exn:
      sock.close()
      error = exn
  raise error or OSError(f'cannot listen on {host}:{port}')


class HttpServer:
  """Serves ``app`` on (host, port) from a daemon thread; see the module."""
  def __init__(self, app: Callable[[Request], Response], host: str,
               port: int = 0, *, max_body: int = 4096,
               workers: int = WORKERS, backlog: int = BACKLOG,
               max_connections: int = MAX_CONNECTIONS,
               header_timeout: float = HEADER_TIMEOUT_SECS,
               write_timeout: float = WRITE_TIMEOUT_SECS,
               name: str = 'beam-pyspark-http'):
    self._app = app
    self._max_body = max_body
    self._max_connections = max_connections
    self._header_timeout = header_timeout
    self._write_timeout = write_timeout
    self._backlog = backlog
    self._sock = _listening_socket(host, port, backlog)
    self.port = self._sock.getsockname()[1]
    self._pool = concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix=f'{name}-worker')
    self._loop = asyncio.new_event_loop()
    self._open = 0  # connections open now (loop thread only)
    self._server: Optional[asyncio.AbstractServer] = None
    self._ready = threading.Event()
    self._failed: Optional[BaseException] = None
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)

  @property
  def open_connections(self) -> int:
    return self._open

  def start(self) -> 'HttpServer':
    self._thread.start()
    self._ready.wait(30)
    if self._failed is not None:
      self.stop()
      raise self._failed
    return self

  def stop(self) -> None:
    if self._thread.is_alive():
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(10)
    self._pool.shutdown(wait=False, cancel_futures=True)
    self._sock.close()

  # -- the loop thread ---------------------------------------------------------

  def _run(self) -> None:
    asyncio.set_event_loop(self._loop)
    try:
      self._server = self._loop.run_until_complete(asyncio.start_server(
          self._serve, sock=self._sock, backlog=self._backlog,
          limit=MAX_HEADER_BYTES + MAX_REQUEST_LINE))
    except BaseException as exn:  # pylint: disable=broad-except
      self._failed = exn
      self._loop.close()
      return
    finally:
      self._ready.set()
    try:
      self._loop.run_forever()
    finally:
      self._server.close()
      for task in asyncio.all_tasks(self._loop):
        task.cancel()
      self._loop.run_until_complete(asyncio.sleep(0))
      self._loop.close()

  async def _serve(self, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
    if self._open >= self._max_connections:
      await self._write(writer, plain(503, 'Too many connections; try again.'))
      return
    self._open += 1
    try:
      try:
        request = await asyncio.wait_for(self._read(reader),
                                         self._header_timeout)
      except _Refused as refused:
        await self._write(writer, refused.response, reader)
        return
      except asyncio.TimeoutError:
        await self._write(writer, plain(
            408, f'No whole request within {self._header_timeout:g} s.'))
        return
      except (ConnectionError, asyncio.IncompleteReadError):
        writer.close()
        return
      response = await self._loop.run_in_executor(
          self._pool, self._call, request)
      await self._write(writer, response)
    finally:
      self._open -= 1

  async def _write(self, writer: asyncio.StreamWriter, response: Response,
                   unread: Optional[asyncio.StreamReader] = None) -> None:
    """Sends the response and closes. With ``unread``, a request we did
    not read to its end: what the client still sends is read and dropped
    for a moment first (a lingering close, as nginx does), since closing
    a socket with unread input resets the connection, and the reset can
    overtake the answer."""
    try:
      writer.write(_encode(response))
      await asyncio.wait_for(writer.drain(), self._write_timeout)
      if unread is not None and writer.can_write_eof():
        writer.write_eof()
        await asyncio.wait_for(_drain_input(unread), LINGER_SECS)
    except (ConnectionError, asyncio.TimeoutError):
      pass
    finally:
      writer.close()

  def _call(self, request: Request) -> Response:
    try:
      return self._app(request)
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('%s %s failed', request.method, request.path[:200],
                      exc_info=True)
      return plain(500, 'internal error')

  async def _read(self, reader: asyncio.StreamReader) -> Request:
    line = await _line(reader, MAX_REQUEST_LINE,
                       plain(414, 'Request line too long.'))
    if not line.strip():
      raise asyncio.IncompleteReadError(b'', None)  # nothing asked
    parts = line.decode('latin-1').split()
    if len(parts) != 3 or not parts[2].startswith('HTTP/1.'):
      raise _Refused(plain(400, 'Bad request line.'))
    method, target, version = parts
    block = bytearray()
    while True:
      header = await _line(reader, MAX_HEADER_BYTES - len(block),
                           plain(431, 'Request headers too large.'))
      if header in (b'\r\n', b'\n'):
        break
      if not header.endswith(b'\n'):
        raise asyncio.IncompleteReadError(bytes(block), None)
      block += header
    try:
      headers = http.client.parse_headers(io.BytesIO(bytes(block) + b'\r\n'))
    except http.client.HTTPException:
      raise _Refused(plain(431, 'Too many request headers.')) from None
    if headers.get('Transfer-Encoding'):
      raise _Refused(plain(413, 'Request body too large.'))
    try:
      length = int(headers.get('Content-Length') or 0)
    except ValueError:
      length = -1
    if length < 0 or length > self._max_body:
      raise _Refused(plain(413, 'Request body too large.'))
    body = await reader.readexactly(length) if length else b''
    return Request(method, target, version, headers, body)


async def _drain_input(reader: asyncio.StreamReader) -> None:
  while await reader.read(1 << 16):
    pass


async def _line(reader: asyncio.StreamReader, limit: int,
                too_long: Response) -> bytes:
  """One line, of at most ``limit`` bytes."""
  try:
    line = await reader.readuntil(b'\n')
  except asyncio.LimitOverrunError:
    raise _Refused(too_long) from None
  except asyncio.IncompleteReadError as exn:
    if exn.partial and len(exn.partial) > limit:
      raise _Refused(too_long) from None
    raise
  if len(line) > limit:
    raise _Refused(too_long)
  return line
