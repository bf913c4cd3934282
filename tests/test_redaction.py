"""Which option values the status page, GetJobs and the logs redact
(beam_pyspark.redaction): the name rule, and secrets inside values."""

from __future__ import annotations

import json

import pytest

from beam_pyspark.redaction import REDACTED
from beam_pyspark.redaction import is_secret_name
from beam_pyspark.redaction import redact
from beam_pyspark.redaction import redact_options


@pytest.mark.parametrize('name', [
    's3_access_key_id', 's3_secret_access_key', 's3_session_token',
    'api_key', 'apiKey', 'hf_token', 'credentials_file', 'db_password',
    'azure_connection_string', 'spark.hadoop.fs.s3a.secret.key',
    'spark.hadoop.fs.s3a.access.key', 'spark.authenticate.secret',
    'spark.ssl.keyStorePassword', 'AWS_SECRET_ACCESS_KEY', 'key',
    'proxy_auth', 'private_key', 'beam:option:s3_secret_access_key:v1',
])
def test_secret_names(name):
  assert is_secret_name(name)


@pytest.mark.parametrize('name', [
    'key_coder', 'enable_hot_key_logging', 'sort_key', 'dataflow_kms_key',
    'max_tokens', 'tokenizer', 'keys', 'keyed_state', 'job_name',
    'spark_conf', 'environment_config', 'author', 'authority', 'monkey',
])
def test_names_that_only_look_secret(name):
  assert not is_secret_name(name)


def test_secrets_inside_values():
  options = redact_options({
      'beam:option:spark_conf:v1': ['spark.hadoop.fs.s3a.secret.key=abc',
                                    'spark.executor.memory=1g'],
      'beam:option:environment_config:v1': json.dumps(
          {'command': 'boot', 'env': {'AWS_SECRET_ACCESS_KEY': 'abc',
                                      'HOME': '/h'}}),
      'beam:option:index_url:v1': 'https://me:pw@pypi.example/simple',
      'beam:option:input:v1':
          'https://b.s3.amazonaws.com/f?X-Amz-Signature=abc&part=1',
      'beam:option:api_key:v1': 'abc',
      'beam:option:runner:v1': 'PortableRunner',
  })
  assert options['beam:option:spark_conf:v1'] == [
      f'spark.hadoop.fs.s3a.secret.key={REDACTED}', 'spark.executor.memory=1g']
  assert json.loads(options['beam:option:environment_config:v1']) == {
      'command': 'boot', 'env': {'AWS_SECRET_ACCESS_KEY': REDACTED,
                                 'HOME': '/h'}}
  assert options['beam:option:index_url:v1'] == (
      f'https://me:{REDACTED}@pypi.example/simple')
  assert options['beam:option:input:v1'] == (
      f'https://b.s3.amazonaws.com/f?X-Amz-Signature={REDACTED}&part=1')
  assert options['beam:option:api_key:v1'] == REDACTED
  assert options['beam:option:runner:v1'] == 'PortableRunner'
  # Nothing to hide: the value itself, untouched.
  assert redact('api_key', None) is None
  config = '{"command":  "x"}'
  assert redact('environment_config', config) is config
