"""Which pipeline option values are secrets, and how they are shown.

The status page, its JSON, the Job API's GetJobs and the job server's
logs show a job's options with the values of secret-looking ones
replaced by ``REDACTED``; the job itself still gets them verbatim.

The rule, on an option's name (``beam:option:NAME:v1`` or plain):

* the name is cut into words at every character that is not a letter or
  digit (``_ - . :``) and at camelCase humps: ``s3_secret_access_key`` is
  s3 / secret / access / key, ``spark.ssl.keyStorePassword`` is spark /
  ssl / key / store / password;
* it is secret if a word is one of ``SECRET_WORDS`` (secret, password,
  passwd, passphrase, token, credential(s), signature, authorization,
  apikey...), or if ``key`` follows one of ``KEY_QUALIFIERS`` (api key,
  access key, private key, account key, encryption key, ...), or the name
  ends in ``auth``, or says ``connection string`` (Azure's holds the
  account key).

So ``s3_access_key_id``, ``s3_secret_access_key``, ``s3_session_token``,
``api_key``, ``hf_token``, ``credentials_file``,
``azure_connection_string``, ``spark.hadoop.fs.s3a.secret.key`` and
``spark.authenticate.secret`` are redacted, while ``key_coder``,
``hot_key_logging``, ``sort_key``, ``dataflow_kms_key`` (a key's resource
name, not the key), ``max_tokens`` and ``tokenizer`` are not: a bare
``key`` word, or ``tokens``, names a kind of data far more often than a
secret (Spark's own ``spark.redaction.regex``, a substring match on
secret|password|token|access.key, would hide ``max_tokens`` too).

Values are searched too: a list item or string ``NAME=VALUE`` (as
``--spark_conf`` takes them) by NAME, a JSON object in a string (as
``--environment_config`` holds a PROCESS command's environment) key by
key, dicts and lists throughout, and in any URL its password
(``https://user:PASSWORD@host``) and the values of secret-looking query
parameters (a presigned URL's ``X-Amz-Signature``, a SAS's ``sig``).
Messages are not redacted: what a job logs is the job's to choose.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

REDACTED = '********'

SECRET_WORDS = frozenset({
    'secret', 'secrets', 'password', 'passwords', 'passwd', 'passphrase',
    'pwd', 'token', 'credential', 'credentials', 'creds', 'signature',
    'authorization', 'apikey', 'privatekey', 'accesskey', 'secretkey',
    'sessionkey', 'clientsecret', 'cookie',
})
KEY_QUALIFIERS = frozenset({
    'api', 'access', 'secret', 'private', 'account', 'encryption', 'signing',
    'client', 'sas', 'ssh', 'storage', 'master', 'session', 'shared', 'auth',
    'app', 'license', 'subscription', 'service', 'hmac', 'aes',
})
# Query parameters of URLs that carry a signature under a short name.
_URL_SECRET_PARAMS = frozenset({'sig', 'x-amz-signature', 'signature'})

_WORDS = re.compile(r'[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+')
_URL = re.compile(r'\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s"\'<>]+')
_ASSIGNMENT = re.compile(r'^\s*([A-Za-z_][\w.:-]*)\s*=(.*)$', re.DOTALL)


def words(name: str) -> list[str]:
  """The words of an option name, lower case."""
  return [w.lower() for w in _WORDS.findall(name)]


def is_secret_name(name: str) -> bool:
  """Whether the value of an option (or setting) so named is a secret."""
  parts = words(_plain(name))
  if not parts:
    return False
  if parts == ['key'] or parts[-1] == 'auth':
    return True
  for i, word in enumerate(parts):
    if word in SECRET_WORDS:
      return True
    if word == 'key' and i > 0 and parts[i - 1] in KEY_QUALIFIERS:
      return True
    if word == 'connection' and parts[i + 1:i + 2] == ['string']:
      return True
  return False


def _plain(name: str) -> str:
  if name.startswith('beam:option:') and name.endswith(':v1'):
    return name[len('beam:option:'):-len(':v1')]
  return name


def redact_options(options: dict) -> dict:
  """A copy of a job's options with secret values replaced."""
  return {name: redact(name, value) for name, value in options.items()}


def redact(name: str, value: Any) -> Any:
  """``value`` of the option ``name``, as it may be shown."""
  if value is None or value == '' or value == []:
    return value
  if is_secret_name(name):
    return REDACTED
  return redact_value(value)


def redact_value(value: Any) -> Any:
  """Secrets inside a value whose own name is not secret."""
  if isinstance(value, dict):
    return {k: redact(str(k), v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [redact_value(v) for v in value]
  if isinstance(value, str):
    return _redact_string(value)
  return value


def _redact_string(text: str) -> str:
  stripped = text.strip()
  if stripped.startswith('{') and stripped.endswith('}'):
    try:
      parsed = json.loads(stripped)
    except ValueError:
      parsed = None
    if isinstance(parsed, dict):
      redacted = redact_value(parsed)
      return text if redacted == parsed else json.dumps(redacted)
  assignment = _ASSIGNMENT.match(text)
  if assignment and is_secret_name(assignment.group(1)):
    return f'{assignment.group(1)}={REDACTED}'
  return redact_urls(text)


def redact_urls(text: str) -> str:
  """``text`` with every URL's password and secret query values replaced."""
  return _URL.sub(lambda m: _redact_url(m.group(0)), text)


def _redact_url(url: str) -> str:
  try:
    parts = urllib.parse.urlsplit(url)
  except ValueError:
    return url
  netloc = parts.netloc
  if '@' in netloc:
    userinfo, _, hostport = netloc.rpartition('@')
    if ':' in userinfo:
      netloc = f'{userinfo.split(":", 1)[0]}:{REDACTED}@{hostport}'
  query = parts.query
  if query:
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    if any(_secret_param(k) for k, _ in pairs):
      query = '&'.join(
          f'{urllib.parse.quote(k, safe="")}='
          f'{REDACTED if _secret_param(k) else urllib.parse.quote(v, safe="")}'
          for k, v in pairs)
  if netloc == parts.netloc and query == parts.query:
    return url
  return urllib.parse.urlunsplit(
      (parts.scheme, netloc, parts.path, query, parts.fragment))


def _secret_param(name: str) -> bool:
  return name.lower() in _URL_SECRET_PARAMS or is_secret_name(name)
