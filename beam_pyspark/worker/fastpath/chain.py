"""A fast-path stage's DoFns and combines, unpickled, checked and set up.

``load`` unpickles each step as Beam's ``bundle_processor`` does
(``create_par_do``: the DoFnInfo tuple; ``create_combine_per_key_precombine``:
``CombineFn.from_runner_api``; ``create_assign_windows``: the Windowing)
and keeps what the loop can call as Beam's invokers would:

* a DoFn (a ``CallableWrapperDoFn`` of ``Map``, ``FlatMap``, ``Filter``,
  ``MapTuple``..., or a DoFn of the user's own) whose ``process`` takes
  the element, its extra arguments and side inputs, and at most the
  element's timestamp, window, pane, key or windowed value
  (``DoFn.TimestampParam``...), never state, timers, restrictions, bundle
  finalization, batches or context parameters; its arguments are laid out
  as Beam's ``PerWindowInvoker`` lays them out (``_get_arg_placeholders``);
* a CombineFn of Beam's own, whose ``add_input`` neither updates metrics
  nor fails halfway for a well-typed input;
* a WindowInto.

``Instances`` holds one set of them and runs their lifecycle as Beam's
harness does: ``setup`` once (as a bundle processor is created),
``start_bundle`` and ``finish_bundle`` per bundle (upstream last and first,
as a bundle processor's operations start and finish), ``teardown`` when
the Python worker lets them go (the job's end, ``worker.harnesses``), or
after a failure, when Beam discards the bundle processor.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import types
from typing import Callable
from typing import Optional

from apache_beam.internal import pickler
from apache_beam.internal.util import ArgumentPlaceholder
from apache_beam.internal.util import insert_values_in_args
from apache_beam.io import iobase
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.pvalue import TaggedOutput
from apache_beam.runners.common import MethodWrapper
from apache_beam.runners.common import _get_arg_placeholders
from apache_beam.transforms import combiners
from apache_beam.transforms import core
from apache_beam.transforms import sideinputs
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.fastpath import ASSIGN_WINDOWS
from beam_pyspark.planning.fastpath import FLATTEN as FLATTEN_STEP
from beam_pyspark.planning.fastpath import EXTRACT
from beam_pyspark.planning.fastpath import GLOBAL_WINDOW
from beam_pyspark.planning.fastpath import MAIN_TAG
from beam_pyspark.planning.fastpath import MERGE
from beam_pyspark.planning.fastpath import PARDO
from beam_pyspark.planning.fastpath import FastPath
from beam_pyspark.planning.fastpath import Step

_LOGGER = logging.getLogger(__name__)

# Outputs whose meaning the loop keeps only on its slow path: Beam
# re-windows, re-stamps or re-routes them (common._OutputHandler).
SPECIAL_OUTPUTS = (WindowedValue, TimestampedValue, TaggedOutput)

# (PGBKCVOperation) keys held before the oldest tenth is emitted.
MAX_KEYS = 100 * 1000
MAX_KEYS_TINY = 1000 * 1000

# How a ParDo is called: Map's function, one output; FlatMap's or a DoFn's
# process, an iterable of outputs; Filter's predicate, the element or
# nothing; WindowInto's, the element in its new windows; and no call.
MAP, FLAT, FILTER, ASSIGN, IDENTITY, COMBINE, FLATTEN = (
    'map', 'flat', 'filter', 'assign', 'identity', 'combine', 'flatten')

# DoFn parameters the loop hands over (names in chain.Call.params).
_PARAMS = {
    'ElementParam': 'element', 'TimestampParam': 'timestamp',
    'WindowParam': 'window', 'PaneInfoParam': 'pane',
    'WindowedValueParam': 'windowed_value',
}


class NotEligible(Exception):
  """A step's unpickled function is not one the fast path runs."""


class NotEligibleStep(NotEligible):
  """Step ``index`` of the tree is not one the fast path runs."""
  def __init__(self, index: int, reason: str):
    super().__init__(reason)
    self.index = index


class SpecialOutput(Exception):
  """An output only the harness handles."""


# Fallback kinds: CLEAN, nothing of the element reached a sink; UNCLEAN,
# some of it did, or output of a bundle's end; SOURCE, the source itself
# did what the loop cannot keep (updated a metric, read special values).
CLEAN, UNCLEAN, SOURCE = 'clean', 'unclean', 'source'
MISSING = object()


class Fallback(Exception):
  """The loop stopped at ``value`` (of ``meta``'s element): the harness
  takes over from there."""
  def __init__(self, kind: str, meta, value, cause):
    super().__init__(kind)
    self.kind = kind
    self.meta = meta
    self.value = value
    self.cause = cause


def _code_key(code) -> tuple:
  return (code.co_code, code.co_consts, code.co_names, code.co_varnames,
          code.co_freevars, code.co_filename, code.co_firstlineno)


def _wrapper_codes(*transforms) -> frozenset:
  return frozenset(_code_key(t.fn._fn.__code__) for t in transforms)  # pylint: disable=protected-access


# Beam's wrappers as their code reads (a pickled lambda comes back with a
# code object of its own): Map's ``lambda x: [fn(x)]`` (and with
# arguments), MapTuple's ``lambda x: [fn(*x)]``, Filter's
# ``lambda x, *args, **kwargs: [x] if fn(x, *args, **kwargs) else []``.
_MAP_CODES = _wrapper_codes(core.Map(len), core.Map(lambda x, y: x, None))
_MAP_TUPLE_CODES = _wrapper_codes(core.MapTuple(len))
_FILTER_CODES = _wrapper_codes(core.Filter(bool))


@dataclasses.dataclass
class Call:
  """How the loop runs one step.

  ``args`` and ``kwargs`` are what Beam's invoker passes to ``fn`` after
  the element, as ``_get_arg_placeholders`` lays them out: side inputs as
  ``ArgumentPlaceholder``s until ``bind`` puts their values in, DoFn
  parameters as ``(position, name)`` in ``params`` (position 0 is the
  element's unless ``star``)."""
  step: Step
  kind: str
  fn: Optional[Callable] = None
  args: list = dataclasses.field(default_factory=list)
  kwargs: dict = dataclasses.field(default_factory=dict)
  params: list = dataclasses.field(default_factory=list)
  star: bool = False  # MapTuple: fn(*element)
  dofn: Optional[core.DoFn] = None
  # Beam's check that a DoFn of the user's own returns no str, bytes or
  # dict from process (common._OutputHandler), done on its first output.
  check_output: bool = False
  # The input's WindowFn: a TimestampedValue output's windows are its.
  window_fn: object = None
  # A WindowParam needs the element in one window (else Beam calls process
  # once per window).
  windowed: bool = False
  # Output tags, the main one first (None: its only output).
  tags: tuple = ()
  combine: Optional[core.CombineFn] = None
  combine_kind: str = ''
  max_keys: int = MAX_KEYS
  windowing: object = None  # ASSIGN: the new windowing; COMBINE: the input's
  side_inputs: tuple = ()  # planning.fastpath.SideInput, in Beam's order

  def bind(self, values: list) -> tuple[list, dict]:
    """The arguments after the element, side inputs' values put in."""
    if not self.side_inputs:
      return list(self.args), dict(self.kwargs)
    args, kwargs = insert_values_in_args(self.args, self.kwargs, values)
    return list(args), dict(kwargs)


def load(spec: FastPath, runtime) -> list[Call]:
  """The tree's calls, or NotEligibleStep saying which step the loop
  cannot run."""
  calls = []
  for index, step in enumerate(spec.steps):
    try:
      calls.append(_load(step, runtime))
    except NotEligible as exn:
      raise NotEligibleStep(index, str(exn)) from None
  return calls


def _load(step: Step, runtime) -> Call:
  context = runtime.context
  if step.kind == GLOBAL_WINDOW:
    return Call(step, IDENTITY)
  if step.kind == FLATTEN_STEP:
    return Call(step, FLATTEN)
  if step.kind == ASSIGN_WINDOWS:
    windowing = core.Windowing.from_runner_api(
        beam_runner_api_pb2.WindowingStrategy.FromString(step.payload),
        context)
    return Call(step, ASSIGN, windowing=windowing)
  if step.kind in (MERGE, EXTRACT):
    # Beam's CombineOperation: (key, values) -> (key, phase(values)) in
    # the element's windows; the CombineFn set up and torn down with it.
    payload = beam_runner_api_pb2.CombinePayload.FromString(step.payload)
    fn = core.CombineFn.from_runner_api(payload.combine_fn, context)
    phase = (fn.merge_accumulators if step.kind == MERGE else
             fn.extract_output)
    return Call(step, MAP, fn=_phase(phase), combine=fn,
                tags=(step.outputs[0][0], ),
                window_fn=runtime.windowing(step.input_windowing).windowfn)
  if step.kind != PARDO:
    payload = beam_runner_api_pb2.CombinePayload.FromString(step.payload)
    fn = core.CombineFn.from_runner_api(payload.combine_fn, context)
    combine, kind, max_keys = _combine(step.name, fn)
    return Call(step, COMBINE, combine=combine, combine_kind=kind,
                max_keys=max_keys,
                windowing=runtime.windowing(step.input_windowing))
  if step.dofn_urn == python_urns.KEY_WITH_NONE_DOFN:
    # CombineGlobally's KeyWithVoid, a DoFn of Beam's known by its URN.
    return Call(step, MAP, fn=_key_with_none, tags=(step.outputs[0][0], ),
                window_fn=runtime.windowing(step.input_windowing).windowfn)
  dofn_data = pickler.loads(step.payload)
  dofn, args, kwargs = dofn_data[:3]
  windowing = dofn_data[4] if len(dofn_data) > 4 and dofn_data[4] else (
      runtime.windowing(step.input_windowing))
  return _pardo(step, dofn, list(args or ()), dict(kwargs or {}),
                windowing.windowfn)


def _pardo(step: Step, dofn, args: list, kwargs: dict, window_fn) -> Call:
  name = repr(step.name)
  if not isinstance(dofn, core.DoFn):
    raise NotEligible(f'{name} runs {type(dofn).__name__}, not a DoFn')
  if dofn._process_batch_defined or dofn._process_yields_batches:  # pylint: disable=protected-access
    raise NotEligible(f'{name} processes batches')
  signature = _Signature(dofn)
  if any(isinstance(d, _KEYED_PARAMS)
         for d in signature.process_method.defaults):
    raise NotEligible(f'{name} is splittable or stateful')
  for method in signature.lifecycle:
    if method.defaults:
      raise NotEligible(f'{name} takes parameters in {method.method_value}')
  if getattr(dofn, '_runtime_output_constraints', None):
    raise NotEligible(f'{name} checks its output types at run time')
  placeholders = sum(
      isinstance(a, ArgumentPlaceholder)
      for a in list(args) + list(kwargs.values()))
  if placeholders != len(step.side_inputs):
    raise NotEligible(f'{name} passes its side inputs in another way')
  side_inputs = tuple(
      sorted(step.side_inputs,
             key=lambda si: sideinputs.get_sideinput_index(si.tag)))
  tags = tuple(tag for tag, _ in step.outputs)
  if len(tags) > 1:
    tags = (MAIN_TAG, ) + tuple(t for t in tags if t != MAIN_TAG)
  call = Call(step, FLAT, dofn=dofn, window_fn=window_fn, tags=tags,
              side_inputs=side_inputs)
  if type(dofn) is iobase._WriteBundleDoFn:  # pylint: disable=protected-access,unidiomatic-typecheck
    # Beam's own file writer (WriteToText's): its process as a plain
    # call, which returns a written file's result once it is full.
    call.fn = _writer_process(dofn)
    call.args, call.kwargs = args, kwargs
    return call
  wrapped = _unwrapped(dofn, signature, args, kwargs)
  if wrapped is not None:
    call.kind, call.fn, call.star = wrapped
    call.args, call.kwargs = args, kwargs
    return call
  placeholders, laid_out, kwargs = _get_arg_placeholders(
      signature.process_method, args, kwargs)
  params = []
  for position, param in placeholders:
    names = [n for n, p in _PARAMS.items() if getattr(core.DoFn, n) == param]
    if not names:
      raise NotEligible(f'{name} takes {param} in process')
    params.append((position, _PARAMS[names[0]]))
  if not params or params[0] != (0, 'element'):
    raise NotEligible(f'{name} does not take the element first')
  call.fn = signature.process_method.method_value
  call.args, call.kwargs = laid_out[1:], dict(kwargs)
  call.params = [(p - 1, n) for p, n in params[1:]]
  call.windowed = any(n == 'window' for _, n in call.params)
  call.check_output = type(dofn) is not core.CallableWrapperDoFn  # pylint: disable=unidiomatic-typecheck
  return call


# Parameters of a splittable or stateful DoFn's process.
_KEYED_PARAMS = (core.DoFn.RestrictionParam, core.DoFn.WatermarkEstimatorParam,
                 core.DoFn.StateParam, core.DoFn.TimerParam)


class _Signature:
  """What the loop needs of Beam's ``DoFnSignature``: its ``MethodWrapper``
  of ``process`` and of the lifecycle methods. Not Beam's whole signature:
  that walks every method of the DoFn twice for state and timer
  parameters (~0.9 ms a DoFn, paid on the driver and again in each
  task), which the plan has already ruled out from the ParDo's payload
  (``planning.fastpath``: no state, timers, restriction or finalization),
  and validates what Beam validated when the ParDo was built; a state or
  timer parameter of ``process`` is still refused."""
  def __init__(self, dofn):
    self.process_method = MethodWrapper(dofn, 'process')
    self.lifecycle = [
        MethodWrapper(dofn, method)
        for method in ('setup', 'start_bundle', 'finish_bundle', 'teardown')
    ]


def _unwrapped(dofn, signature, args,
               kwargs) -> Optional[tuple[str, Callable, bool]]:
  """Map's, MapTuple's and Filter's wrappers as (kind, the user's
  function, star), or None."""
  if type(dofn) is not core.CallableWrapperDoFn:  # pylint: disable=unidiomatic-typecheck
    return None
  fn = dofn._fn  # pylint: disable=protected-access
  code = getattr(fn, '__code__', None)
  if code is None or not fn.__closure__:
    return None
  if signature.process_method.defaults:
    return None  # DoFn parameters: laid out by _get_arg_placeholders
  inner = fn.__closure__[0].cell_contents
  key = _code_key(code)
  if key in _MAP_CODES:
    return MAP, inner, False
  if key in _MAP_TUPLE_CODES and not args and not kwargs:
    return MAP, inner, True
  if key in _FILTER_CODES:
    return FILTER, inner, False
  return FLAT, fn, False


def _key_with_none(v):
  return None, v


def _phase(apply: Callable) -> Callable:
  """A combine phase on a (key, values) element."""
  def phase(kv):
    return kv[0], apply(kv[1])

  return phase


def _writer_process(dofn):
  """``_WriteBundleDoFn.process`` without its generator."""
  def process(element, init_result):
    if dofn.writer is None:
      import uuid  # pylint: disable=import-outside-toplevel
      dofn.writer = dofn.sink.open_writer(init_result, str(uuid.uuid4()))
    dofn.writer.write(element)
    if dofn.writer.at_capacity():
      result = dofn.writer.close()
      dofn.writer = None
      return (result, )
    return None

  return process


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
  elif (type(fn) in (combiners.TopCombineFn, combiners.Largest) and
        fn._compare is operator.lt and fn._key is None and  # pylint: disable=protected-access
        type(fn._n) is int and fn._n > 0):  # pylint: disable=protected-access,unidiomatic-typecheck
    kind = 'top'
  return fn, kind, max_keys


def is_special(x) -> bool:
  return isinstance(x, SPECIAL_OUTPUTS)


def _overrides(dofn, method: str) -> bool:
  """Whether ``dofn.method`` is more than DoFn's no-op, asked of the
  instance as Beam's DoFnInvoker calls it: a wrapper that delegates by
  ``__getattribute__`` (Beam's ``with_exception_handling`` wraps the
  user's DoFn so) has the user's ``start_bundle`` without its class
  defining one."""
  return _own_method(dofn, method) is not getattr(core.DoFn, method)


def _overrides_combine(combine, method: str) -> bool:
  return _own_method(combine, method) is not getattr(core.CombineFn, method)


def _own_method(instance, method: str):
  bound = getattr(instance, method, None)
  return getattr(bound, '__func__', bound)


class Instances:
  """One set of a stage's DoFns and CombineFns, set up, with the lifecycle
  Beam's harness gives them (see the module's docstring). Cached per job
  and stage in the Python worker (``worker.harnesses.keep``)."""
  def __init__(self, calls: list[Call]):
    self.calls = calls
    self.last_used = 0.0
    self.uncached = False
    self._in_use = False
    self._set_up = False
    self._torn_down = False
    # DoFns whose bundle methods are their own (not DoFn's no-ops).
    self.starts = [c for c in reversed(calls)
                   if c.dofn is not None and _overrides(c.dofn, 'start_bundle')]
    self.finishes = [c for c in calls if c.dofn is not None and (
        _overrides(c.dofn, 'finish_bundle'))]
    self.bundle_methods = bool(self.starts or self.finishes)
    # Beam's check of a DoFn's first output, per instance (chain.Call).
    self.checks = [c.check_output for c in calls]
    # Whether the loop sets the metrics tracker's step before each call:
    # once a metric was updated (worker.fastpath.metrics).
    self.metered = False

  # -- the harness cache's interface --------------------------------------

  def in_use(self) -> bool:
    return self._in_use

  def dead(self) -> Optional[str]:
    return 'torn down' if self._torn_down else None

  def shutdown(self) -> None:
    self.teardown()

  def needs_release(self) -> bool:
    """Whether a release would run anything: a DoFn's or combine's own
    ``setup`` or ``teardown`` (the resources they hold); without them,
    dropping the set is only garbage, which the idle reaper collects."""
    if not self._set_up or self._torn_down:
      return False
    return any(
        (c.dofn is not None and (_overrides(c.dofn, 'setup') or
                                 _overrides(c.dofn, 'teardown'))) or
        (c.combine is not None and (
            _overrides_combine(c.combine, 'setup') or
            _overrides_combine(c.combine, 'teardown')))
        for c in self.calls)

  # -- the lifecycle -----------------------------------------------------

  def claim(self) -> None:
    self._in_use = True

  def release(self) -> None:
    self._in_use = False

  def setup(self, step_scope: Callable) -> None:
    """Each DoFn's ``setup`` and each combine's, once (an exception leaves
    them to be torn down, as Beam's failed bundle processor is)."""
    if self._set_up:
      return
    self._set_up = True
    for call in self.calls:
      with step_scope(call):
        if call.dofn is not None:
          call.dofn.setup()
        if call.combine is not None:
          call.combine.setup()

  def teardown(self) -> None:
    """Each one's ``teardown``; an error is logged (as the harness's
    release logs it), and the others are still torn down."""
    if self._torn_down or not self._set_up:
      self._torn_down = True
      return
    self._torn_down = True
    for call in self.calls:
      try:
        if call.dofn is not None:
          if type(call.dofn) is iobase._WriteBundleDoFn and (  # pylint: disable=protected-access,unidiomatic-typecheck
              call.dofn.writer is not None):
            # A file the loop was writing when it handed over: closed,
            # never finalized (its bundle's result was not output).
            writer, call.dofn.writer = call.dofn.writer, None
            writer.close()
          call.dofn.teardown()
        if call.combine is not None:
          call.combine.teardown()
      except Exception:  # pylint: disable=broad-except
        _LOGGER.warning('Error tearing down %s of the fast path',
                        call.step.name, exc_info=True)
