"""gRPC's standard health service (``grpc.health.v1.Health``) on the job
port, so load balancers, Kubernetes probes and ``grpc_health_probe`` can ask
the job server whether it serves.

``grpcio-health-checking`` would pull a protobuf major version Beam does
not take, so the two small messages of ``health.proto`` are built here from
their descriptor. Check answers SERVING while the server takes jobs and
NOT_SERVING once it is stopping ("" and the Job API's service name are
known; any other name is NOT_FOUND, as the standard servicer answers);
Watch sends the status, then each change.
"""

from __future__ import annotations

import threading
from typing import Callable

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf import descriptor_pool
from google.protobuf import message_factory

SERVICE = 'grpc.health.v1.Health'
JOB_SERVICE = 'org.apache.beam.model.job_management.v1.JobService'
UNKNOWN, SERVING, NOT_SERVING = 0, 1, 2
# How often Watch looks at the status.
WATCH_POLL_SECS = 0.5


def _messages():
  proto = descriptor_pb2.FileDescriptorProto(
      name='beam_pyspark/grpc_health_v1.proto', package='grpc.health.v1',
      syntax='proto3')
  request = proto.message_type.add(name='HealthCheckRequest')
  request.field.add(name='service', number=1, type=9, label=1)  # string
  response = proto.message_type.add(name='HealthCheckResponse')
  status = response.enum_type.add(name='ServingStatus')
  for name, number in (('UNKNOWN', 0), ('SERVING', 1), ('NOT_SERVING', 2),
                       ('SERVICE_UNKNOWN', 3)):
    status.value.add(name=name, number=number)
  response.field.add(name='status', number=1, type=14, label=1,  # enum
                     type_name='.grpc.health.v1.HealthCheckResponse.'
                     'ServingStatus')
  pool = descriptor_pool.DescriptorPool()
  pool.Add(proto)
  return (
      message_factory.GetMessageClass(
          pool.FindMessageTypeByName('grpc.health.v1.HealthCheckRequest')),
      message_factory.GetMessageClass(
          pool.FindMessageTypeByName('grpc.health.v1.HealthCheckResponse')))


HealthCheckRequest, HealthCheckResponse = _messages()


def health_handler(serving: Callable[[], bool],
                   stopped: threading.Event) -> grpc.GenericRpcHandler:
  """The service: ``serving()`` says whether the server takes jobs;
  ``stopped`` ends Watch streams."""
  def status_of(request, context):
    if request.service not in ('', JOB_SERVICE):
      context.abort(grpc.StatusCode.NOT_FOUND,
                    f'unknown service {request.service!r}')
    return SERVING if serving() else NOT_SERVING

  def check(request, context):
    return HealthCheckResponse(status=status_of(request, context))

  def watch(request, context):
    last = None
    while context.is_active() and not stopped.is_set():
      status = status_of(request, context)
      if status != last:
        last = status
        yield HealthCheckResponse(status=status)
      stopped.wait(WATCH_POLL_SECS)

  return grpc.method_handlers_generic_handler(SERVICE, {
      'Check': grpc.unary_unary_rpc_method_handler(
          check, request_deserializer=HealthCheckRequest.FromString,
          response_serializer=HealthCheckResponse.SerializeToString),
      'Watch': grpc.unary_stream_rpc_method_handler(
          watch, request_deserializer=HealthCheckRequest.FromString,
          response_serializer=HealthCheckResponse.SerializeToString),
  })
