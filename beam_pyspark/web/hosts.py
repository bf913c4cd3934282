"""Which requests the status page answers: its own host names only.

DNS rebinding: a web page the user visits points its own name at
127.0.0.1 (or at the job server's address) and its script then reads the
status page as a page of its own origin; the one trace of it is the Host
header, which names the attacker's domain. So every request, GET and POST,
must name in Host one of the names this server is reached by:

* an IP address literal (``127.0.0.1``, ``[::1]``, the address of
  ``--job-host $(hostname -i)``, an ssh tunnel's): a page of another site
  cannot make a browser send one for a request that reaches this server,
  since a browser sends the host of the URL it loads;
* ``localhost``, the name the server listens on, this machine's host name
  and fully qualified name;
* names the operator adds (``--status-allowed-host``, repeatable; a name
  with a leading dot, ``.example.com``, allows its subdomains; ``*``
  turns the check off, e.g. behind a proxy that checks Host itself).

A request without Host is answered only in HTTP/1.0 (no browser sends one
without it; HTTP/1.1 makes it mandatory). The port is not checked: a
proxy or tunnel may forward another port.

POSTs (Cancel, Drain) must also come from a page of this server: their
``Origin`` (or, without one, ``Referer``) names the Host they were sent to.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from typing import Iterable
from typing import Optional


def local_names(host: str) -> set[str]:
  """Names a request to this server may carry in Host, besides IP
  literals: localhost, the listening name, this machine's names."""
  names = {'localhost', host.lower().strip('[]'), socket.gethostname().lower()}
  try:
    names.add(socket.getfqdn().lower())
  except OSError:
    pass
  return names


def host_name(host_header: str) -> str:
  """The name in a Host header, without its port or brackets."""
  host = host_header.strip().lower()
  if host.startswith('['):  # [::1]:8090
    return host[1:host.find(']')] if ']' in host else host[1:]
  return host.rsplit(':', 1)[0] if host.count(':') == 1 else host


def _is_ip(name: str) -> bool:
  try:
    ipaddress.ip_address(name)
  except ValueError:
    return False
  return True


class HostPolicy:
  """The names a status page answers to (see the module)."""
  def __init__(self, listening_host: str, allowed: Iterable[str] = ()):
    self.names = local_names(listening_host)
    self.suffixes: list[str] = []
    self.any = False
    for name in allowed:
      name = name.strip().lower()
      if name == '*':
        self.any = True
      elif name.startswith('.'):
        self.suffixes.append(name)
      elif name:
        self.names.add(host_name(name))

  def allows(self, host_header: Optional[str], version: str = 'HTTP/1.1'
             ) -> bool:
    if host_header is None:
      return version == 'HTTP/1.0'
    if self.any:
      return True
    name = host_name(host_header).rstrip('.')
    if not name:
      return False
    return (_is_ip(name) or name in self.names or
            any(name.endswith(s) or name == s[1:] for s in self.suffixes))


def same_origin(headers, policy: HostPolicy) -> bool:
  """Whether a POST comes from a page of this server: it names an
  allowed Host, and its Origin (or, without one, its Referer) is that
  host."""
  host = headers.get('Host')
  if not host or not policy.allows(host):
    return False
  origin = headers.get('Origin')
  if origin is not None:
    return origin.lower() == f'http://{host.lower()}'
  referer = urllib.parse.urlsplit(headers.get('Referer') or '')
  return referer.scheme == 'http' and referer.netloc.lower() == host.lower()
