"""What a pipeline's Kafka reads read: their topics and bootstrap servers.

Beam's Java KafkaIO errors do not name them ("Could not find any
partitions info" for a topic that does not exist, "Timeout expired while
fetching topic metadata" for a broker that is not there), and the
expanded pipeline keeps them in one place only: the Java-serialized DoFns
of the read (``beam:dofn:javasdk:0.1``, Java serialization under Snappy's
framing, as Beam's ``SerializableUtils.serializeToByteArray`` writes it),
whose consumer config is a ``HashMap`` of strings and whose topics are a
Guava ``ImmutableList``. Read from those bytes without a JVM: strings and
string arrays in Java's serialization format (the JDK's "Object
Serialization Stream Protocol"), best effort: anything unexpected gives
nothing, never an error.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2

JAVA_DOFN_URN = 'beam:dofn:javasdk:0.1'
_SNAPPY_FRAMING = b'\x82SNAPPY\x00'
# Java serialization: TC_STRING, a u16 length, modified UTF-8.
_STRING = re.compile(rb'\x74(..)', re.S)
# Guava's ImmutableList is written as its SerializedForm: one field,
# ``Object[] elements``, then the array (TC_ARRAY, its class or a
# reference to it, an int count, the elements).
_LIST_FORM = b'ImmutableList$SerializedForm'
# Kafka's own errors, as its consumer and Beam's KafkaIO word them.
KAFKA_SIGNS = ('org.apache.kafka.', 'KafkaIO', 'KafkaUnboundedSource',
               'Could not find any partitions info',
               'fetching topic metadata')


@dataclasses.dataclass(frozen=True)
class KafkaRead:
  transform: str  # the read's name in the pipeline
  topics: tuple[str, ...]
  bootstrap: str


def kafka_reads(pipeline: beam_runner_api_pb2.Pipeline) -> list[KafkaRead]:
  """The pipeline's KafkaIO reads, one per read (its outermost name)."""
  found: dict[str, KafkaRead] = {}
  for transform in pipeline.components.transforms.values():
    if transform.spec.urn != common_urns.primitives.PAR_DO.urn:
      continue
    if 'Kafka' not in transform.unique_name:
      continue
    try:
      payload = beam_runner_api_pb2.ParDoPayload.FromString(
          transform.spec.payload)
      if payload.do_fn.urn != JAVA_DOFN_URN:
        continue
      read = _read_config(unframe(payload.do_fn.payload))
    except Exception:  # pylint: disable=broad-except
      continue  # not what we expect: best effort
    if read is None:
      continue
    name = transform.unique_name.split('/')[0]
    topics, bootstrap = read
    if name not in found or (topics and not found[name].topics):
      found[name] = KafkaRead(name, topics, bootstrap)
  return sorted(found.values(), key=lambda r: r.transform)


def describe_kafka_failure(error: str,
                           pipeline: beam_runner_api_pb2.Pipeline) -> str:
  """For an error from Kafka: which topics from which servers the job
  read ('' for other errors, or a pipeline with no KafkaIO read)."""
  if not any(sign in error for sign in KAFKA_SIGNS):
    return ''
  reads = kafka_reads(pipeline)
  if not reads:
    return ''
  lines = [
      f'{r.transform!r} reads topic(s) '
      f'{", ".join(r.topics) or "(not found in its configuration)"} from '
      f'bootstrap servers {r.bootstrap or "(unknown)"}' for r in reads]
  return ('This failure came from Kafka: ' + '; '.join(lines) + '. Check '
          'that the topics exist and that the brokers are reachable from '
          'the executors (a consumer_config of default.api.timeout.ms '
          'shortens how long Kafka waits for them).')


def _read_config(blob: bytes) -> Optional[tuple[tuple[str, ...], str]]:
  strings = _strings(blob)
  texts = [s for _, s in strings]
  if 'bootstrap.servers' not in texts:
    return None
  at = texts.index('bootstrap.servers')
  bootstrap = texts[at + 1] if at + 1 < len(texts) else ''
  return _topics(blob, strings), bootstrap


def _strings(blob: bytes) -> list[tuple[int, str]]:
  """(offset just past it, text) of what reads as a serialized string."""
  out = []
  for match in _STRING.finditer(blob):
    (length,) = struct.unpack('>H', match.group(1))
    end = match.end() + length
    if not length or end > len(blob):
      continue
    try:
      text = blob[match.end():end].decode('utf-8')
    except UnicodeDecodeError:
      continue
    if text.isprintable():
      out.append((end, text))
  return out


def _topics(blob: bytes, strings: list[tuple[int, str]]) -> tuple[str, ...]:
  """The first ImmutableList of strings after the list form's class:
  KafkaIO.Read's ``topics`` (its ``topicPartitions`` hold no strings)."""
  at = blob.find(_LIST_FORM)
  if at < 0:
    return ()
  starts = {end - len(text.encode()) - 3: (end, text) for end, text in strings}
  pos = at
  while True:
    pos = blob.find(b'xpu', pos + 1)  # end of a class, then TC_ARRAY
    if pos < 0:
      return ()
    count_at = _after_array_class(blob, pos + 3)
    if count_at is None or count_at + 4 > len(blob):
      continue
    (count,) = struct.unpack('>i', blob[count_at:count_at + 4])
    cursor, items = count_at + 4, []
    while len(items) < count and cursor in starts:
      cursor, text = starts[cursor]
      items.append(text)
    if count > 0 and len(items) == count:
      return tuple(items)


def _after_array_class(blob: bytes, pos: int) -> Optional[int]:
  """Past an array's class: a reference (TC_REFERENCE and a handle) or a
  new class descriptor of Object[] ending in TC_ENDBLOCKDATA, null."""
  if blob[pos:pos + 1] == b'q':
    return pos + 5
  if blob[pos:pos + 1] == b'r':
    end = blob.find(b'xp', pos)
    return end + 2 if end > 0 else None
  return None


def unframe(data: bytes) -> bytes:
  """Snappy's framed stream as Beam's Java writes it (snappy-java's
  SnappyOutputStream: an 8-byte magic, two ints, then chunks of a
  big-endian length and a raw Snappy block)."""
  if not data.startswith(_SNAPPY_FRAMING):
    return data
  pos, out = 16, bytearray()
  while pos + 4 <= len(data):
    (length,) = struct.unpack('>i', data[pos:pos + 4])
    pos += 4
    out += _snappy_block(data[pos:pos + length])
    pos += length
  return bytes(out)


def _snappy_block(data: bytes) -> bytes:
  """One raw Snappy block (Snappy's format_description.txt)."""
  pos = 0
  while data[pos] & 0x80:  # the uncompressed length, a varint
    pos += 1
  pos += 1
  out = bytearray()
  while pos < len(data):
    tag = data[pos]
    pos += 1
    kind = tag & 3
    if kind == 0:  # a literal
      length = tag >> 2
      if length >= 60:
        extra = length - 59
        length = int.from_bytes(data[pos:pos + extra], 'little')
        pos += extra
      length += 1
      out += data[pos:pos + length]
      pos += length
      continue
    if kind == 1:
      length = ((tag >> 2) & 7) + 4
      offset = ((tag >> 5) << 8) | data[pos]
      pos += 1
    elif kind == 2:
      length = (tag >> 2) + 1
      offset = int.from_bytes(data[pos:pos + 2], 'little')
      pos += 2
    else:
      length = (tag >> 2) + 1
      offset = int.from_bytes(data[pos:pos + 4], 'little')
      pos += 4
    start = len(out) - offset
    if offset <= 0 or start < 0:
      raise ValueError('corrupt Snappy block')
    for i in range(length):  # copies may overlap their own output
      out.append(out[start + i])
  return bytes(out)
