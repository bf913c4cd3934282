"""Which URL artifacts the job server may fetch: none unless allowed.

A URL artifact (``beam:artifact:type:url:v1``) names something the job
server fetches itself: at retrieval, and on the driver when the job runs.
Whoever can submit a job would otherwise make the server read any URL its
network reaches (a cloud's metadata service, an internal site) or any
local file (``file:///etc/...``, a plain path): a server-side request
forgery. So none is fetched unless the operator lists where they may come
from (``--artifact-url-allowlist``); a job naming another is refused at
Prepare, and at staging if its client resolves an artifact to one.

An allowlist entry is a URL prefix: its scheme, host and port must match,
and its path is a prefix of the URL's, whole segments only
(``https://repo.example.com/jars`` allows ``.../jars/a.jar``, not
``.../jars2/a.jar``). ``SCHEME://`` alone allows every URL of that
scheme. A plain path is a file URL; file URLs and paths are compared after
resolving ``..`` and symbolic links, so none leaves its prefix.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import urllib.parse
import urllib.request
from typing import Iterable
from typing import Optional
from typing import Sequence

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2

FLAG = '--artifact-url-allowlist'

_DEFAULT_PORTS = {'http': 80, 'https': 443, 'ftp': 21}


class UrlNotAllowedError(ValueError):
  """A URL artifact this job server is not allowed to fetch."""


@dataclasses.dataclass(frozen=True)
class _Prefix:
  scheme: str
  host: Optional[str]  # None: any host
  port: Optional[int]
  path: str  # normalized; '/' allows every path

  def __str__(self) -> str:
    if self.host is None:
      return f'{self.scheme}://'
    port = '' if self.port in (None, _DEFAULT_PORTS.get(self.scheme)) else (
        f':{self.port}')
    return f'{self.scheme}://{self.host}{port}{self.path}'


def _split(url: str, what: str) -> _Prefix:
  """(scheme, host, port, normalized path) of a URL or a plain path."""
  parts = urllib.parse.urlsplit(url)
  scheme = parts.scheme.lower()
  # 'C:\\x' parses as scheme 'c': one letter is a drive, not a scheme.
  if not scheme or len(scheme) == 1:
    return _Prefix('file', '', None, _real_path(url))
  try:
    port = parts.port
  except ValueError as exn:
    raise UrlNotAllowedError(f'{what} {url!r} has a bad port: {exn}') from exn
  if scheme == 'file':
    if parts.netloc not in ('', 'localhost'):
      raise UrlNotAllowedError(
          f'{what} {url!r} names host {parts.netloc!r}; file URLs are '
          'local files (file:///path)')
    return _Prefix('file', '', None,
                   _real_path(urllib.request.url2pathname(parts.path)))
  path = posixpath.normpath(
      '/' + urllib.parse.unquote(parts.path or '/').lstrip('/'))
  return _Prefix(scheme, (parts.hostname or '').lower(),
                 port or _DEFAULT_PORTS.get(scheme), path)


def _real_path(path: str) -> str:
  # realpath: '..' and symbolic links resolved, where the bytes really are.
  return os.path.realpath(path) if path else ''


def _under(path: str, prefix: _Prefix) -> bool:
  """Whether ``path`` is ``prefix``'s path or below it, whole segments."""
  if path == prefix.path:
    return True
  sep = os.sep if prefix.scheme == 'file' else '/'
  return path.startswith(prefix.path.rstrip('/' + sep) + sep)


class UrlPolicy:
  """The URL prefixes the job server may fetch artifacts from; none by
  default."""
  def __init__(self, entries: Iterable[str] = ()):
    self._prefixes: list[_Prefix] = []
    for entry in entries:
      for item in entry.split(','):
        item = item.strip()
        if item:
          self._prefixes.append(self._parse(item))

  @staticmethod
  def _parse(entry: str) -> _Prefix:
    parts = urllib.parse.urlsplit(entry)
    if (not parts.scheme or len(parts.scheme) == 1) and not os.path.isabs(
        entry):
      raise ValueError(
          f'{FLAG} entry {entry!r} is neither a URL (SCHEME://HOST[/PATH]) '
          'nor an absolute path')
    if parts.scheme and len(parts.scheme) > 1 and parts.scheme != 'file' \
        and not parts.netloc:
      if parts.path:
        raise ValueError(
            f'{FLAG} entry {entry!r} has no host: give SCHEME://HOST[/PATH], '
            'SCHEME:// for every URL of a scheme, or file:///DIR')
      return _Prefix(parts.scheme.lower(), None, None, '/')
    if parts.scheme.lower() == 'file' and not parts.path.strip('/'):
      return _Prefix('file', None, None, '/')
    try:
      return _split(entry, f'{FLAG} entry')
    except UrlNotAllowedError as exn:
      raise ValueError(str(exn)) from exn

  @property
  def prefixes(self) -> Sequence[str]:
    return [str(p) for p in self._prefixes]

  def allows(self, url: str) -> bool:
    try:
      self.check(url)
    except UrlNotAllowedError:
      return False
    return True

  def check(self, url: str, what: str = 'URL artifact') -> None:
    """Raises UrlNotAllowedError naming ``what``, the URL and the flag
    unless an allowlist entry covers the URL."""
    target = _split(url, what)
    for prefix in self._prefixes:
      if prefix.scheme != target.scheme:
        continue
      if prefix.host is None:
        return
      if (prefix.host, prefix.port) == (target.host, target.port) and _under(
          target.path, prefix):
        return
    if not self._prefixes:
      raise UrlNotAllowedError(
          f'{what} {url!r} is refused: this job server fetches no URL '
          f'artifacts unless its operator allows them ({FLAG}, e.g. '
          f"'https://repo.example.com/jars,file:///opt/jars'). Stage the "
          'file itself instead (a FILE artifact, which the client uploads).')
    raise UrlNotAllowedError(
        f'{what} {url!r} is refused: it is under none of the prefixes this '
        f'job server may fetch from ({FLAG}: '
        f'{", ".join(self.prefixes)}). Stage the file itself instead, or '
        'ask its operator to allow it.')


def artifact_url(artifact: beam_runner_api_pb2.ArtifactInformation
                 ) -> Optional[str]:
  """A URL artifact's URL; None for other types."""
  if artifact.type_urn != common_urns.artifact_types.URL.urn:
    return None
  try:
    return beam_runner_api_pb2.ArtifactUrlPayload.FromString(
        artifact.type_payload).url
  except Exception as exn:  # pylint: disable=broad-except
    raise UrlNotAllowedError(
        f'A URL artifact has a malformed payload ({exn})') from exn
