"""A fast-path chain's functions, unpickled and checked, and its loop.

``load`` unpickles each step as Beam's ``bundle_processor`` does
(``create_par_do``: the DoFnInfo tuple; ``create_combine_per_key_precombine``:
``CombineFn.from_runner_api``) and keeps only what Beam itself would run
with its ``SimpleInvoker``: a ``CallableWrapperDoFn`` (the exact type, so
not a DoFn of the user's own nor the runtime type check's wrapper), no
extra arguments, no defaults in its process method, no runtime output
constraints. A combine must be one of Beam's own CombineFns, whose
``add_input`` neither updates metrics nor fails halfway for a well-typed
input.

``compile_loop`` writes the loop for one chain as Python source, once per
stage and Python worker: the per-element work is then the user's calls,
a type check of each output, and the combine's ``add_input`` (inlined for
Beam's callable, count and mean combiners, exactly as they are written),
with no function call per step that the chain does not need.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable
from typing import Optional

from apache_beam.internal import pickler
from apache_beam.io import iobase
from apache_beam.internal.util import ArgumentPlaceholder
from apache_beam.internal.util import insert_values_in_args
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.pvalue import TaggedOutput
from apache_beam.runners.common import DoFnSignature
from apache_beam.transforms import sideinputs
from apache_beam.transforms import combiners
from apache_beam.transforms import core
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.windowed_value import PANE_INFO_UNKNOWN
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.fastpath import GLOBAL_WINDOW
from beam_pyspark.planning.fastpath import PARDO
from beam_pyspark.planning.fastpath import FastPath

# Outputs whose meaning the loop cannot keep: Beam re-windows, re-stamps or
# re-routes them (common._OutputHandler).
SPECIAL_OUTPUTS = (WindowedValue, TimestampedValue, TaggedOutput)

# (PGBKCVOperation) keys held before the oldest tenth is emitted.
MAX_KEYS = 100 * 1000
MAX_KEYS_TINY = 1000 * 1000


class NotEligible(Exception):
  """A step's unpickled function is not one the fast path runs."""


class SpecialOutput(Exception):
  """A callable returned a value only the harness handles."""


def _code_key(code) -> tuple:
  return (code.co_code, code.co_consts, code.co_names, code.co_varnames,
          code.co_freevars, code.co_filename, code.co_firstlineno)


# ``beam.Map``'s wrappers, ``lambda x: [fn(x)]`` and, with arguments,
# ``lambda x, *args, **kwargs: [fn(x, *args, **kwargs)]``, as their code
# reads: a pickled lambda comes back with a code object of its own.
_MAP_CODES = frozenset(
    _code_key(m.fn._fn.__code__)  # pylint: disable=protected-access
    for m in (core.Map(len), core.Map(lambda x, y: x, None)))


@dataclasses.dataclass
class Call:
  """How the loop calls one ParDo's function: ``fn(element, *args,
  **kwargs)``, the side inputs' values put in the placeholders of
  ``args`` and ``kwargs`` (``with_side_inputs``)."""
  fn: Optional[Callable]
  single: bool  # Map's wrapper unwrapped: one output, not an iterable
  args: tuple = ()
  kwargs: Optional[dict] = None
  side_inputs: tuple = ()  # planning.fastpath.SideInput, in Beam's order
  # WindowInto(GlobalWindows()) over the global window: no call at all.
  identity: bool = False
  # Beam's own file writer (iobase._WriteBundleDoFn): the loop's sink.
  writer: Optional[core.DoFn] = None

  def with_side_inputs(self, values: list) -> tuple[tuple, dict]:
    if not self.side_inputs:
      return tuple(self.args), dict(self.kwargs or {})
    args, kwargs = insert_values_in_args(self.args, self.kwargs or {}, values)
    return tuple(args), kwargs


@dataclasses.dataclass
class Chain:
  calls: list[Call]
  combine: Optional[core.CombineFn] = None
  # How add_input is written into the loop: 'callable', 'count', 'mean'
  # or 'generic' (a call).
  combine_kind: str = ''
  max_keys: int = MAX_KEYS

  def setup(self) -> None:
    if self.combine is not None:
      self.combine.setup()

  def teardown(self) -> None:
    if self.combine is not None:
      self.combine.teardown()


class NotEligibleStep(NotEligible):
  """Step ``index`` of the chain is not one the fast path runs."""
  def __init__(self, index: int, reason: str):
    super().__init__(reason)
    self.index = index


def load(spec: FastPath, context) -> Chain:
  """The chain's functions; raises NotEligibleStep saying which step is
  not a plain callable or one of Beam's combines."""
  chain = Chain(calls=[])
  for index, step in enumerate(spec.steps):
    try:
      if step.kind == GLOBAL_WINDOW:
        chain.calls.append(Call(fn=None, single=True, identity=True))
      elif step.kind == PARDO:
        chain.calls.append(_callable(step, pickler.loads(step.payload)))
        writers = [c for c in chain.calls if c.writer is not None]
        if writers and not (
            chain.calls[-1].writer is not None or chain.calls[-1].single and
            not chain.calls[-1].side_inputs):
          raise NotEligible(f'{step.name!r} comes after a file writer')
      else:
        payload = beam_runner_api_pb2.CombinePayload.FromString(step.payload)
        fn = core.CombineFn.from_runner_api(payload.combine_fn, context)
        chain.combine, chain.combine_kind, chain.max_keys = _combine(
            step.name, fn)
    except NotEligible as exn:
      raise NotEligibleStep(index, str(exn)) from None
  return chain


def _callable(step, dofn_data) -> Call:
  name = step.name
  dofn, args, kwargs = dofn_data[:3]
  if type(dofn) is iobase._WriteBundleDoFn and len(step.side_inputs) == 1 and (  # pylint: disable=protected-access,unidiomatic-typecheck
      len(args) == 1 and isinstance(args[0], ArgumentPlaceholder) and
      not kwargs):
    # WriteToText's (and every file sink's) writer, Beam's own DoFn: the
    # loop opens it at the first element and closes it at the end, as its
    # start_bundle, process and finish_bundle do in a bundle.
    return Call(fn=None, single=True, args=tuple(args),
                side_inputs=tuple(step.side_inputs), writer=dofn)
  if type(dofn) is not core.CallableWrapperDoFn:  # pylint: disable=unidiomatic-typecheck
    raise NotEligible(f'{name!r} runs {type(dofn).__name__}, not a plain '
                      'callable')
  placeholders = sum(
      isinstance(a, ArgumentPlaceholder)
      for a in list(args) + list((kwargs or {}).values()))
  if placeholders != len(step.side_inputs):
    raise NotEligible(f'{name!r} passes its side inputs in another way')
  if getattr(dofn, '_runtime_output_constraints', None):
    raise NotEligible(f'{name!r} checks its output types at run time')
  signature = DoFnSignature(dofn)
  if signature.process_method.defaults:
    # Beam then uses its per-window invoker: the defaults may be DoFn params.
    raise NotEligible(f'{name!r} has default arguments')
  fn = dofn._fn  # pylint: disable=protected-access
  code = getattr(fn, '__code__', None)
  single = (code is not None and fn.__closure__ and
            _code_key(code) in _MAP_CODES)
  return Call(
      fn=fn.__closure__[0].cell_contents if single else
      signature.process_method.method_value,
      single=bool(single), args=tuple(args or ()), kwargs=dict(kwargs or {}),
      side_inputs=tuple(
          sorted(step.side_inputs,
                 key=lambda si: sideinputs.get_sideinput_index(si.tag))))


def _combine(name: str, fn: core.CombineFn) -> tuple[core.CombineFn, str, int]:
  if not type(fn).__module__.startswith('apache_beam.'):
    raise NotEligible(f'{name!r} runs {type(fn).__name__}, a CombineFn of '
                      'the user\'s own')
  tiny = isinstance(fn, (combiners.CountCombineFn, combiners.MeanCombineFn)
                    ) or (isinstance(fn, core.CallableWrapperCombineFn) and
                          fn._fn in (min, max, sum))  # pylint: disable=protected-access
  max_keys = MAX_KEYS_TINY if tiny else MAX_KEYS
  kind = 'generic'
  if type(fn) in (core.CallableWrapperCombineFn,
                  core.NoSideInputsCallableWrapperCombineFn):
    if not isinstance(fn._fn, types.BuiltinFunctionType):  # pylint: disable=protected-access
      # The user's function runs when the buffer is compacted, inside the
      # commit of an element's outputs, which the loop cannot undo.
      raise NotEligible(f'{name!r} combines with a function of the user\'s '
                        'own')
    kind = 'callable'
  elif type(fn) is combiners.CountCombineFn:
    kind = 'count'
  elif type(fn) is combiners.MeanCombineFn:
    kind = 'mean'
  return fn, kind, max_keys


def is_special(x) -> bool:
  return isinstance(x, SPECIAL_OUTPUTS)


# -- the loop ---------------------------------------------------------------

# Fallback kinds: CLEAN, the element's outputs were dropped and nothing of
# it reached the sink; UNCLEAN, the sink took part of them; SOURCE, the
# source updated a metric while reading.
CLEAN, UNCLEAN, SOURCE = 'clean', 'unclean', 'source'


class Fallback(Exception):
  """The loop stopped at ``value`` (of ``meta``'s element): the harness
  takes over from there."""
  def __init__(self, kind: str, meta, value, cause):
    super().__init__(kind)
    self.kind = kind
    self.meta = meta
    self.value = value
    self.cause = cause


# Sinks: where each element's outputs are committed.
TABLE, RECORDS, ENCODED, WRITE = 'table', 'records', 'encoded', 'write'

# Per sink: (code before the outputs, code per output ``x``, code after),
# at no indentation; TABLE and RECORDS code reads the output's key and
# value from ``k`` and ``val``.
_COMMIT = {
    # The precombine's table, as PGBKCVOperation keeps it (insertion order
    # is eviction order); accumulators are stored bare.
    ('table', 'generic'): ('', """
acc = table.get(k, MISSING)
if acc is MISSING:
  if len(table) >= max_keys:
    evict()
  acc = create_accumulator()
table[k] = add_input(acc, val)""", ''),
    # CallableWrapperCombineFn.add_input, inlined.
    ('table', 'callable'): ('', """
acc = table.get(k)
if acc is None:
  if len(table) >= max_keys:
    evict()
  acc = table[k] = []
acc.append(val)
if len(acc) > buffer_size:
  table[k] = [combine_fn(acc)]""", ''),
    # CountCombineFn.add_input, inlined.
    ('table', 'count'): ('', """
acc = table.get(k)
if acc is None:
  if len(table) >= max_keys:
    evict()
  acc = 0
table[k] = acc + 1""", ''),
    # MeanCombineFn.add_input, inlined.
    ('table', 'mean'): ('', """
acc = table.get(k)
if acc is None:
  if len(table) >= max_keys:
    evict()
  acc = (0, 0)
table[k] = (acc[0] + val, acc[1] + 1)""", ''),
    # Shuffle records of (key, value) bytes, packed per reduce partition
    # (worker.shuffle.PartitionPacker, inlined).
    ('records', ''): ('', """
kb = encode_key(k)
p = crc32(kb) % partitions
out = streams[p]
if out is None:
  out = streams[p] = OutputStream()
vb = encode_value(val)
out.write_var_int64(len(kb))
out.write(kb)
out.write_var_int64(len(vb))
out.write(vb)
if out.size() >= limit:
  ready.append((p, out.get()))
  streams[p] = None""", ''),
    # A file sink's writer (sinks.Writer): the output's element written.
    ('write', ''): ('', """
write(x, meta)""", ''),
    # Encoded windowed elements, in the input element's window.
    ('encoded', ''): ("""
out = streams[0]
with_value = meta.with_value""", """
encode(with_value(x), out, True)""", """
if out.size() >= limit:
  ready.append(out.get())
  streams[0] = OutputStream()"""),
}

# How a TABLE or RECORDS sink reads an output's key and value: as Beam's
# precombine and GroupByKey do, ``key, value = element``. A precombine
# with the default windowing keys a TimestampedValue or WindowedValue by
# its value alone (PGBKCVOperation.process), so it need not be checked
# for those first; a shuffle's records must (its windows would count).
_UNPACK = {
    'table': """
try:
  k, val = x
except Exception:
  k, val = unwrap(x)""",
    'records': """
k, val = x""",
    'encoded': '',
    'write': '',
}


def unwrap(x) -> tuple:
  """A precombine's input that did not unpack: a TimestampedValue or
  WindowedValue stands for its value; a TaggedOutput goes elsewhere."""
  if isinstance(x, TaggedOutput):
    raise SpecialOutput('an output is a TaggedOutput')
  if isinstance(x, (TimestampedValue, WindowedValue)):
    x = x.value
  k, v = x
  return k, v


def _block(code: str, indent: str) -> list[str]:
  return [indent + line for line in code.strip('\n').split('\n') if line]


def _commit(sink: str, combine_kind: str, indent: str, outs: bool) -> list[str]:
  """The sink's commit of the element's outputs (``outs``, else the one
  output ``x``, already unpacked), failing UNCLEAN."""
  before, each, after = _COMMIT[(sink, combine_kind)]
  body = _block(before, indent + '  ')
  if outs:
    body += [f'{indent}  for x in outs:']
    body += _block(_UNPACK[sink], indent + '    ')
    body += _block(each, indent + '    ')
  else:
    body += _block(each, indent + '  ')
  body += _block(after, indent + '  ')
  return ([f'{indent}try:'] + body + [
      f'{indent}except Exception as exn:',
      f'{indent}  raise Fallback(UNCLEAN, meta, v, exn)',
      f'{indent}if ready:',
      f'{indent}  yield from ready',
      f'{indent}  ready.clear()',
  ])


# An element's outputs held back before they are committed anyway (a
# FlatMap that fans one element out widely streams, as in the harness).
SPILL_OUTPUTS = 1024


def compile_loop(singles: list[bool], sink: str, combine_kind: str,
                 windowed: bool, read: bool, names: dict,
                 extra: Optional[list[str]] = None,
                 identity: Optional[list[bool]] = None) -> Callable:
  """A generator function ``run(units, meta)`` for a chain of ParDos.

  ``units`` are the values fed to the first ParDo (with ``windowed``, the
  WindowedValues carrying them, each its own ``meta``); ``meta`` is the
  WindowedValue whose window, timestamp and pane the outputs take.
  Committed element counts are added to ``counts`` (the units', then one
  per ParDo's output); chunks ready to leave are yielded. ``names`` gives
  the loop its functions and state (the sink's table or streams); they
  become the function's locals. ``extra[i]``: what follows the element in
  the call of ParDo i (e.g. ``*a0``), if anything; ``identity[i]``: step i
  is WindowInto(GlobalWindows()), the element as it is if its pane is the
  default one (checked per element of a windowed input).

  An element's outputs are committed once it is done, so that a fallback
  at it leaves nothing of it behind (CLEAN), unless it has more than
  SPILL_OUTPUTS of them (then UNCLEAN). A chain of Maps has one output an
  element, committed with no list.
  """
  n = len(singles)
  one = all(singles)
  namespace = dict(names)
  namespace.update(
      Fallback=Fallback, CLEAN=CLEAN, UNCLEAN=UNCLEAN, SOURCE=SOURCE,
      MISSING=_MISSING, type=type, len=len, Exception=Exception,
      cap=SPILL_OUTPUTS, unwrap=unwrap, DEFAULT_PANE=PANE_INFO_UNKNOWN)
  bound = ', '.join(f'{name}={name}' for name in sorted(namespace))
  lines = [f'def run(units, meta, {bound}):']
  # How each ParDo output's count is known: a Map outputs as many as it
  # reads; outputs that reach the end unchanged in number are the
  # element's outputs; the others are counted.
  counted = []
  for i in range(n):
    if one:
      counted.append('1')
    elif all(singles[i + 1:]):
      counted.append('(spilled + len(outs))')
    elif singles[i]:
      counted.append(counted[-1] if i else '1')
    else:
      counted.append(f'c{i + 1}')
  counters = [c for c in counted if c.startswith('c')]
  lines.append('  ' + ' = '.join(f'n{i}' for i in range(n + 1)) + ' = 0')
  lines.append('  v = None')
  lines.append('  try:')
  if windowed:
    lines.append('    for meta in units:')
    lines.append('      v = meta.value')
  else:
    lines.append('    for v in units:')
  if windowed and identity and any(identity):
    lines.append('      if meta.pane_info != DEFAULT_PANE:')
    lines.append('        raise Fallback(CLEAN, meta, v, None)')
  if read:
    # The source's own doing: a metric update, or a record that is not a
    # plain value (worker.reads re-stamps those).
    lines.append('      if watch.touched or (type(v) not in plain and '
                 'special_record(v)):')
    lines.append('        raise Fallback(SOURCE, meta, v, None)')
  if not one:
    lines.append('      outs = []')
    lines.append('      spilled = 0')
  if counters:
    lines.append('      ' + ' = '.join(counters) + ' = 0')
  lines.append('      try:')
  indent, value = '        ', 'v'
  for i, single in enumerate(singles):
    x = f'x{i}'
    more = (extra or [''] * n)[i]
    call = f'f{i}({value}, {more})' if more else f'f{i}({value})'
    if identity and identity[i]:
      lines.append(f'{indent}{x} = {value}')
      value = x
      continue
    if single:
      lines.append(f'{indent}{x} = {call}')
    else:
      lines.append(f'{indent}r{i} = {call}')
      lines.append(f'{indent}if r{i} is not None:')
      lines.append(f'{indent}  for {x} in r{i}:')
      indent += '    '
    if not (i == n - 1 and sink == TABLE):
      lines.append(f'{indent}if type({x}) not in plain:')
      lines.append(f'{indent}  check({x})')
    if counted[i].startswith('c'):
      lines.append(f'{indent}{counted[i]} += 1')
    value = x
  if one:
    lines.append(f'{indent}x = {value}')
    lines.extend(_block(_UNPACK[sink], indent))
  else:
    lines.append(f'{indent}outs.append({value})')
    lines.append(f'{indent}if len(outs) >= cap:')
    lines.append(f'{indent}  spilled += len(outs)')
    lines.extend(_commit(sink, combine_kind, indent + '  ', outs=True))
    lines.append(f'{indent}  outs = []')
  lines.append('      except Fallback:')
  lines.append('        raise')
  lines.append('      except Exception as exn:')
  lines.append('        raise Fallback(%s, meta, v, exn)' %
               ('CLEAN' if one else 'UNCLEAN if spilled else CLEAN'))
  lines.append('      if watch.touched:')
  lines.append('        raise Fallback(%s, meta, v, None)' %
               ('CLEAN' if one else 'UNCLEAN if spilled else CLEAN'))
  lines.append('      n0 += 1')
  for i in range(n):
    lines.append(f'      n{i + 1} += {counted[i]}')
  lines.extend(_commit(sink, combine_kind, '      ', outs=not one))
  lines.append('  finally:')
  for i in range(n + 1):
    lines.append(f'    counts[{i}] += n{i}')
  source = '\n'.join(lines) + '\n'
  exec(compile(source, f'<fast path loop {sink}>', 'exec'), namespace)  # pylint: disable=exec-used
  run = namespace['run']
  run.source = source
  return run


_MISSING = object()
