"""Beam's Java expansion services (``sql``, ``kafka``, or the tests'
``validates``) on loopback, started by scripts/expansion-service.sh as a
user starts one, from the jars `make sdk-xlang` resolved
(docs/multi-language.md)."""

from __future__ import annotations

import os

from beam_pyspark.local import processes

NAMES = {'sql': 'Beam SQL', 'kafka': 'KafkaIO',
         'validates': 'the cross-language ValidatesRunner suite'}


class ExpansionService(processes.JavaServer):
  """``address`` is where pipelines reach it (``expansion_service=``).

  ``args`` go to the script after the port (``--beam-default-environment``,
  ExpansionService options). With ``wait=False`` the caller waits with
  ``wait_ready()``, so that several start side by side.
  """

  def __init__(self, name: str, log_dir: str, *args: str, port: int = 0,
               timeout: float = 300, wait: bool = True):
    script = processes.in_clone('scripts', 'expansion-service.sh')
    processes.read_classpath(processes.in_clone(
        'sdks', 'xlang', name, 'target', 'classpath.txt'), 'sdk-xlang')
    self.name = name
    self.port = processes.port_or_free(port, f'--{name}-port')
    self.address = f'localhost:{self.port}'
    self.timeout = timeout
    os.makedirs(log_dir, exist_ok=True)
    self.log_path = os.path.join(log_dir, f'expansion-{name}.log')
    self.process = processes.start(
        [script, name, str(self.port), *args], self.log_path)
    if wait:
      self.wait_ready()

  def wait_ready(self) -> None:
    # It lists its transforms before it listens: on a busy 2-core machine
    # that took 30 s.
    try:
      processes.wait_listening(
          self.process, self.port, self.timeout,
          f'the {NAMES.get(self.name, self.name)} expansion service',
          self.log_path, every=0.5)
    except BaseException:
      self.stop()
      raise
