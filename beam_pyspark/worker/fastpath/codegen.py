"""The fast path's loop for one stage, written as Python source.

``compile_loop`` writes, once per stage and task, a generator function
``run(units, meta)`` for the stage's tree of steps (``chain.Call``) and
sinks (``sinks``): per element the user's calls, nested as the tree
nests them (a FlatMap's or DoFn's outputs iterated, a Filter's kept,
tagged outputs dispatched to their PCollection's consumers), a type
check of each output, Beam's element count per PCollection, and the
sinks' work (a combine's ``add_input``, inlined for Beam's callable,
count and mean combiners; shuffle records; encoded elements), with no
function call per step that the tree does not need. ``feed_functions``
writes, per DoFn with a ``finish_bundle``, a function that sends its
outputs down the tree.

An element's outputs are committed once it is done, so that a fallback
at it leaves nothing of it behind (CLEAN), unless a sink holds more than
SPILL_OUTPUTS of them (then UNCLEAN). Where each element has at most one
output (Maps and Filters into one sink) it is held in a variable.

Outputs of a type outside ``plain`` take the slow path (``slow``): a
TimestampedValue, WindowedValue or TaggedOutput is unwrapped, re-stamped
or routed as Beam's ``_OutputHandler`` would (``meta`` loops carry each
output's timestamp, windows and pane; the others, whose sinks never read
them, keep only values); anything the loop cannot keep raises, and the
harness takes the element.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable
from typing import Optional

from apache_beam.transforms.window import FixedWindows

from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.fastpath import outputs
from beam_pyspark.worker.fastpath import sinks
from beam_pyspark.worker.fastpath.chain import Call

# An element's outputs held back before they are committed anyway (a
# FlatMap that fans one element out widely streams, as in the harness).
SPILL_OUTPUTS = 1024

CLEAN, UNCLEAN, SOURCE = chains.CLEAN, chains.UNCLEAN, chains.SOURCE
Fallback = chains.Fallback


@dataclasses.dataclass
class Tree:
  """What the loop runs: calls, the PCollections they read and write, and
  the sinks reading PCollections (``sinks.Sink``: DATA_OUTPUTs, the rest
  stage's input, combines' tables)."""
  calls: list[Call]
  root: str  # the PCollection the units are elements of
  sinks: dict  # PCollection -> [Sink]
  counts: dict  # PCollection -> index in the task's counts
  meta: bool  # carry each output's timestamp, windows and pane
  metered: bool  # set the tracker's step before each call
  # Per call, whether its instance's first output is still to be checked
  # (chain.Instances.checks): once checked, the loop no longer asks.
  checks: Optional[list] = None

  def consumers(self, pcoll: str) -> list:
    out = [('call', i) for i, c in enumerate(self.calls)
           if pcoll in c.step.inputs]
    return out + [('sink', s) for s in self.sinks.get(pcoll, [])]


class _Writer:
  def __init__(self, tree: Tree, held: bool):
    self.tree = tree
    self.held = held  # per-element commit (run) or at once (feed)
    self.lines: list[str] = []
    self.calls_at: dict[int, int] = {}  # line number -> call index
    self.local_counts: dict[str, str] = {}  # pcoll -> counter variable
    self.derived: dict[str, str] = {}  # pcoll -> its count expression
    self.holds: dict[int, str] = {}  # sink index -> its held variable
    self.tables_at: dict[int, int] = {}  # line number -> table sink index
    self.single = False
    self._ids = itertools.count()

  def line(self, indent: str, text: str, call: Optional[int] = None):
    self.lines.append(indent + text)
    if call is not None:
      self.calls_at[len(self.lines) + 1] = call  # +1: the def line

  def sink_lines(self, indent: str, sink, texts: list) -> None:
    """A sink's code. A precombine's table runs its CombineFn's
    ``add_input``, whose metric updates are the combine's step's (the
    harness's state sampler has the Precombine's): found by line until an
    update has been seen, then set (``ts<s>``) in the metered loop, since
    the table's code runs in another call's output or in the commit."""
    table = sink.kind == sinks.TABLE
    if table and self.tree.metered:
      texts = [f'w.step = ts{sink.index}'] + texts + ['w.step = None']
    for text in texts:
      self.line(indent, text)
      if table:
        self.tables_at[len(self.lines) + 1] = sink.index  # +1: the def line

  def var(self, prefix: str) -> str:
    return f'{prefix}{next(self._ids)}'

  # -- counting -------------------------------------------------------------

  def count(self, pcoll: str, indent: str, like: Optional[str] = None):
    """An output into ``pcoll``: counted (or known to be as many as
    ``like``'s, a Map's input)."""
    if pcoll not in self.tree.counts:
      return
    if not self.held:
      self.line(indent, f'counts[{self.tree.counts[pcoll]}] += 1')
    elif like is not None and like in self.derived:
      self.derived[pcoll] = self.derived[like]
    else:
      var = self.local_counts.setdefault(pcoll, f'c{len(self.local_counts)}')
      self.derived[pcoll] = var
      self.line(indent, f'{var} += 1')

  # -- the tree -------------------------------------------------------------

  def emit(self, pcoll: str, x: str, m: str, indent: str) -> None:
    """Code for everything that reads ``pcoll``, given its value ``x``
    (and meta ``m``)."""
    tree = self.tree
    for kind, what in tree.consumers(pcoll):
      if kind == 'sink':
        self.sink(what, x, m, indent)
      else:
        self.call(what, x, m, indent)

  def sink(self, sink, x: str, m: str, indent: str) -> None:
    if sink.kind == 'discard':
      return
    if not self.held:
      self.sink_lines(indent, sink, sink.put(x, m))
      return
    if self.single:
      self.line(indent, f'h{sink.index} = {sink.hold(x, m)}')
      return
    held = f'o{sink.index}'
    self.line(indent, f'{held}.append({sink.hold(x, m)})')
    self.line(indent, f'if len({held}) >= cap:')
    self.line(indent, '  spilled += 1')
    self.sink_lines(indent + '  ', sink, sink.commit(held))
    self.line(indent, f'  {held}.clear()')

  def args(self, i: int, call: Call, x: str, m: str) -> str:
    parts = [f'*{x}' if call.star else x]
    params = dict(call.params)
    for position in range(len(call.args)):
      name = params.get(position)
      parts.append({
          None: f'a{i}_{position}', 'timestamp': f'{m}.timestamp',
          'window': f'user_window({m}.windows[0])', 'pane': f'{m}.pane_info',
          'windowed_value': f'user_windowed_value({m}.with_value({x}))'
      }[name])
    if call.kwargs:
      parts.append(f'**kw{i}')
    return ', '.join(parts)

  def call(self, i: int, x: str, m: str, indent: str) -> None:
    tree = self.tree
    call = tree.calls[i]
    out = call.step.output_pcoll
    meta = tree.meta
    if tree.metered and call.kind not in (chains.IDENTITY, chains.ASSIGN,
                                          chains.COMBINE, chains.FLATTEN):
      self.line(indent, f'w.step = s{i}')
    if call.kind == chains.COMBINE:
      (sink, ) = [s for s in tree.sinks.get(call.step.transform_id, [])]
      self.sink(sink, x, m, indent)
      return
    if call.windowed:
      # A DoFn taking its window is called once per window of the element
      # (PerWindowInvoker.invoke_process).
      mw = self.var('m')
      self.line(indent, f'for {mw} in per_window({x}, {m}):')
      indent, m = indent + '  ', mw
    y, my = self.var('x'), (self.var('m') if meta else m)
    if call.kind == chains.FLATTEN:
      # Each input's elements as they are (a Flatten operation's).
      self.count(out, indent, like=call.step.input_pcoll
                 if len(call.step.inputs) == 1 else None)
      self.emit(out, x, m, indent)
      return
    if call.kind == chains.IDENTITY:
      if meta:
        self.line(indent, f'{my} = assign{i}({x}, {m})')
      self.count(out, indent, like=call.step.input_pcoll)
      self.emit(out, x, my, indent)
      return
    if call.kind == chains.ASSIGN:
      table = self.starts_table(call)
      if table is not None:
        # Fixed windows straight into a precombine: the window's start in
        # integer microseconds keys the table (sinks.Table.starts), no
        # WindowedValue or window object made per element.
        t, st = self.var('t'), self.var('st')
        self.line(indent, f'if len({m}.windows) != 1:')
        self.line(indent, '  raise SpecialOutput('
                  "'an element in several windows')")
        self.line(indent, f'{t} = {m}.timestamp_micros')
        self.line(indent, f'{st} = {t} - ({t} - {table.starts[1]}) % '
                  f'{table.starts[0]}')
        self.count(out, indent, like=call.step.input_pcoll)
        self.sink(table, x, st, indent)
        return
      self.line(indent, f'{my} = assign{i}({x}, {m})')
      self.count(out, indent, like=call.step.input_pcoll)
      self.emit(out, x, my, indent)
      return
    invoke = f'f{i}({self.args(i, call, x, m)})'
    if call.kind == chains.FILTER:
      self.line(indent, f'if {invoke}:', call=i)
      self.count(out, indent + '  ')
      self.emit(out, x, m, indent + '  ')
      return
    if call.kind == chains.MAP:
      self.line(indent, f'{y} = {invoke}', call=i)
      self.output(i, y, m, my, indent, like=call.step.input_pcoll)
      return
    r = self.var('r')
    self.line(indent, f'{r} = {invoke}', call=i)
    if call.check_output and (tree.checks is None or tree.checks[i]):
      self.line(indent, f'if chk[{i}]:')
      self.line(indent, f'  chk[{i}] = False')
      self.line(indent, f'  if type({r}) in (str, bytes, dict):')
      self.line(indent, f'    bad_output({r})')
    self.line(indent, f'if {r} is not None:')
    self.line(indent + '  ', f'for {y} in {r}:', call=i)
    inner = indent + '    '
    if len(call.tags) > 1:
      k = self.var('t')
      self.line(inner, f'{k} = 0')
      if meta:
        self.line(inner, f'{my} = {m}')
      self.line(inner, f'if type({y}) not in plain:')
      self.line(inner, f'  {k}, {y}{", " + my if meta else ""} = '
                f'slow{i}({y}, {m})')
      branch = 'if'
      for index, tag in enumerate(call.tags):
        pcoll = dict(call.step.outputs).get(tag)
        if pcoll is None:
          continue  # no main output: Beam drops what goes there
        self.line(inner, f'{branch} {k} == {index}:')
        branch = 'elif'
        self.count(pcoll, inner + '  ')
        self.emit(pcoll, y, my, inner + '  ')
        self.line(inner + '  ', 'pass')
    else:
      self.output(i, y, m, my, inner)
    if tree.metered:
      self.line(inner, f'w.step = s{i}')

  def starts_table(self, call):
    """The windowed precombine table a FixedWindows ASSIGN alone feeds
    (its ``starts`` set: keyed by window start), else None."""
    window_fn = call.windowing.windowfn if call.windowing is not None else None
    if type(window_fn) is not FixedWindows:  # pylint: disable=unidiomatic-typecheck
      return None
    after = self.tree.consumers(call.step.output_pcoll)
    if len(after) != 1 or after[0][0] != 'call':
      return None
    combine = self.tree.calls[after[0][1]]
    if combine.kind != chains.COMBINE:
      return None
    (table, ) = self.tree.sinks.get(combine.step.transform_id, [])
    if table.kind != sinks.TABLE or not table.windowed:
      return None
    table.key_by_start(window_fn)
    return table

  def output(self, i: int, y: str, m: str, my: str, indent: str,
             like: Optional[str] = None) -> None:
    """A single-output step's output ``y``: checked, counted, sent on."""
    tree = self.tree
    out = tree.calls[i].step.output_pcoll
    if tree.meta:
      self.line(indent, f'{my} = {m}')
    after = tree.consumers(out)
    # A precombine in the default windowing keys a TimestampedValue or
    # WindowedValue by its value (PGBKCVOperation.process): its sink
    # unwraps what does not unpack (sinks.UNPACK), no check needed.
    unchecked = not tree.meta and len(after) == 1 and after[0][0] == 'call' \
        and tree.calls[after[0][1]].kind == chains.COMBINE
    if not unchecked:
      self.line(indent, f'if type({y}) not in plain:')
      self.line(indent, f'  {y}{", " + my if tree.meta else ""} = '
                f'slow{i}({y}, {m})')
    self.count(out, indent, like=like)
    self.emit(out, y, my, indent)


def _namespace(tree: Tree, names: dict, bound: list) -> dict:
  namespace = dict(names)
  for i, call in enumerate(tree.calls):
    if call.kind in (chains.MAP, chains.FLAT, chains.FILTER):
      namespace[f'f{i}'] = call.fn
      args, kwargs = bound[i]
      for position, arg in enumerate(args):
        namespace[f'a{i}_{position}'] = arg
      if kwargs:
        namespace[f'kw{i}'] = kwargs
      namespace[f'slow{i}'] = outputs.slow(call, tree.meta)
    elif call.kind in (chains.ASSIGN, chains.IDENTITY):
      namespace[f'assign{i}'] = outputs.assign(call)
  namespace.update(
      Fallback=Fallback, CLEAN=CLEAN, UNCLEAN=UNCLEAN, SOURCE=SOURCE,
      SpecialOutput=chains.SpecialOutput, type=type, len=len, str=str,
      bytes=bytes, dict=dict, Exception=Exception, cap=SPILL_OUTPUTS,
      bad_output=outputs.bad_output, MISSING=chains.MISSING,
      per_window=outputs.per_window, user_window=outputs.user_window,
      user_windowed_value=outputs.user_windowed_value)
  return namespace


def _finish(writer: _Writer, indent: str) -> None:
  """The element's counts and held outputs, committed."""
  tree = writer.tree
  for pcoll, index in tree.counts.items():
    expr = writer.derived.get(pcoll)
    if expr is not None:
      writer.line(indent, f'n{index} += {expr}')
  sinks = [s for ss in tree.sinks.values() for s in ss if s.kind != 'discard']
  if not sinks:
    return
  writer.line(indent, 'try:')
  for sink in sinks:
    if writer.single:
      writer.line(indent, f'  if h{sink.index} is not MISSING:')
      writer.sink_lines(indent + '    ', sink,
                        sink.put_held(f'h{sink.index}'))
    else:
      writer.sink_lines(indent + '  ', sink, sink.commit(f'o{sink.index}'))
  writer.line(indent, 'except Exception as exn:')
  writer.line(indent, '  raise Fallback(UNCLEAN, meta, v, exn)')


def _one_output(tree: Tree) -> bool:
  """At most one output per element, into one sink."""
  pcoll, sinks = tree.root, 0
  while True:
    after = tree.consumers(pcoll)
    if len(after) != 1:
      return False
    kind, what = after[0]
    if kind == 'sink':
      return what.kind != 'discard'
    call = tree.calls[what]
    if call.kind == chains.COMBINE:
      return True
    if call.kind == chains.FLAT:
      return False
    pcoll = call.step.output_pcoll


def compile_loop(tree: Tree, names: dict, bound: list, read: bool,
                 tracker) -> Callable:
  """``run(units, meta)``: a generator over the units (the root's values
  with ``read``, each in ``meta``; else WindowedValues) yielding the
  sinks' ready items, returning 'learned' after an element whose metric
  update asked for a metered loop. ``names``: the sinks' and the loop's
  state (``ready``, ``counts``, ``w``, ``s<i>`` containers, ``chk``...);
  ``bound[i]``: call i's (args, kwargs)."""
  w = _Writer(tree, held=True)
  w.single = _one_output(tree)
  if tree.root in tree.counts:
    w.derived[tree.root] = '1'
  indent = '      '
  body_start = len(w.lines)
  w.emit(tree.root, 'v', 'meta', indent + '  ')
  body = w.lines[body_start:]
  del w.lines[body_start:]
  calls_at = dict(w.calls_at)
  tables_at = dict(w.tables_at)
  w.tables_at.clear()
  head = []
  counters = list(w.local_counts.values())
  if w.single:
    head += [f'h{s.index} = MISSING' for ss in tree.sinks.values()
             for s in ss if s.kind != 'discard']
  else:
    head += [f'o{s.index} = []' for ss in tree.sinks.values() for s in ss
             if s.kind != 'discard'] + ['spilled = 0']
  if counters:
    head.append(' = '.join(counters) + ' = 0')
  lines = ['  ' + ' = '.join(f'n{i}' for i in tree.counts.values()) + ' = 0'
           if tree.counts else '  pass',
           '  v = None', '  try:']
  if read:
    lines += ['    for v in units:',
              '      if w.touched or (type(v) not in plain and '
              'special_record(v)):',
              '        raise Fallback(SOURCE, meta, v, None)']
  else:
    lines += ['    for meta in units:', '      v = meta.value']
  lines += [indent + h for h in head]
  lines.append(indent + 'try:')
  offset = len(lines) - body_start
  lines += body
  unclean = 'CLEAN' if w.single else 'UNCLEAN if spilled else CLEAN'
  lines += [
      indent + 'except Fallback:', indent + '  raise',
      indent + 'except Exception as exn:',
      indent + f'  raise Fallback({unclean}, meta, v, exn)',
      indent + 'if w.alert and w.touched:',
      indent + f'  raise Fallback({unclean}, meta, v, None)']
  w.lines = lines
  _finish(w, indent)
  w.line(indent, 'if ready:')
  w.line(indent, '  yield from ready')
  w.line(indent, '  ready.clear()')
  if tree.metered:
    w.line(indent, 'if w.pending:')
    w.line(indent, '  w.settle()')
    w.line(indent, 'w.step = None')
  else:
    w.line(indent, 'if w.alert:')
    w.line(indent, '  w.settle()')
    w.line(indent, '  w.alert = False')
    w.line(indent, '  return "learned"')
  w.line('  ', 'finally:')
  for pcoll, index in tree.counts.items():
    w.line('    ', f'counts[{index}] += n{index}')
  if not tree.counts:
    w.line('    ', 'pass')
  namespace = _namespace(tree, names, bound)
  namespace['w'] = tracker
  run = _compile('run', '(units, meta', w.lines, namespace, 'run')
  tracker.lines[run.__code__] = {
      **{line + offset: names[f's{i}'] for line, i in calls_at.items()},
      **{line + offset: names[f'ts{s}'] for line, s in tables_at.items()},
      **{line: names[f'ts{s}'] for line, s in w.tables_at.items()}}
  return run


def feed_functions(tree: Tree, names: dict, bound: list, tracker) -> dict:
  """Call index -> ``feed(items)``: a DoFn's finish_bundle outputs (Beam's
  WindowedValues, maybe tagged) sent down the tree, committed at once."""
  feeds = {}
  namespace = _namespace(tree, names, bound)
  namespace['w'] = tracker
  for i, call in enumerate(tree.calls):
    if call.dofn is None or not chains._overrides(call.dofn, 'finish_bundle'):  # pylint: disable=protected-access
      continue
    w = _Writer(tree, held=False)
    w.line('  ', 'for item in items:')
    w.line('    ', f'ti, x, m = finish_output{i}(item)')
    branch = 'if'
    for index, tag in enumerate(call.tags or (None, )):
      pcoll = dict(call.step.outputs).get(tag) if tag else (
          call.step.output_pcoll)
      if not pcoll:
        continue
      w.line('    ', f'{branch} ti == {index}:')
      branch = 'elif'
      w.count(pcoll, '      ')
      w.emit(pcoll, 'x', 'm', '      ')
      w.line('      ', 'pass')
    namespace[f'finish_output{i}'] = outputs.finish_output(call)
    feed = _compile(f'feed{i}', '(items', w.lines, namespace, f'feed{i}')
    tracker.lines[feed.__code__] = {
        **{line: names[f's{c}'] for line, c in w.calls_at.items()},
        **{line: names[f'ts{s}'] for line, s in w.tables_at.items()}}
    feeds[i] = feed
  return feeds


_COMPILED: dict = {}
_COMPILED_MAX = 256


def _compile(name: str, params: str, lines: list, namespace: dict,
             label: str) -> Callable:
  bound = ', '.join(f'{n}={n}' for n in sorted(namespace))
  source = f'def {name}{params}, {bound}):\n' + '\n'.join(lines) + '\n'
  scope = dict(namespace)
  # Every task of a stage writes the same source: compiled once per worker
  # (the values are the defaults, bound by each exec).
  key = (source, label)
  code = _COMPILED.get(key)
  if code is None:
    if len(_COMPILED) >= _COMPILED_MAX:
      _COMPILED.clear()
    code = _COMPILED[key] = compile(source, f'<fast path {label}>', 'exec')
  exec(code, scope)  # pylint: disable=exec-used
  fn = scope[name]
  fn.source = source
  return fn
