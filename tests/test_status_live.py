"""The status page and the Job API while real jobs run.

A real ``beam-pyspark job-server`` subprocess on local[2] runs jobs that
Beam's own PortableRunner sends; the pages are driven in a real headless
Chromium, Debian's, through Debian's chromedriver (set-up installs both:
scripts/ensure-browser.sh). Nothing is downloaded at run time: Selenium
is handed the driver's path, so Selenium Manager never runs. A failing
browser test leaves a screenshot under its pytest tmp dir.

Set BEAM_PYSPARK_SCREENSHOTS=DIR to also write the job page's picture
that docs/guide/status-page.md shows (docs/status-page.png) there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
import urllib.request

import pytest
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.runners.runner import PipelineState

from jobserver_process import JobServerProcess
from status_jobs import portable_options
from status_jobs import slow_pipeline

TESTS = os.path.dirname(os.path.abspath(__file__))
CHROMIUM = '/usr/bin/chromium'
CHROMEDRIVER = '/usr/bin/chromedriver'
CHROMIUM_FLAGS = ('--headless', '--no-sandbox', '--disable-gpu',
                  '--disable-quic', '--no-first-run',
                  '--disable-background-networking',
                  '--disable-component-update', '--disable-sync',
                  '--window-size=1400,2000')

linux_only = pytest.mark.skipif(
    not sys.platform.startswith('linux'),
    reason='the browser tests use Debian\'s chromium and chromedriver, '
    'which set-up installs on Linux only')


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  s = JobServerProcess(tmp_path_factory.mktemp('status-live') / 'server',
                       env={'PYTHONPATH': TESTS})
  yield s
  s.stop()


def _get_json(url: str):
  with urllib.request.urlopen(url, timeout=10) as response:
    return json.loads(response.read())


def _wait(condition, timeout: float, what: str, every: float = 0.2):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = condition()
    if value:
      return value
    time.sleep(every)
  raise AssertionError(f'timed out after {timeout:.0f} s waiting for {what}')


def _job_id(server, job_name: str) -> str:
  return _wait(lambda: next((r['job_id'] for r in _get_json(
      server.status_url + 'api/jobs') if r['job_name'] == job_name), None),
               60, f'job {job_name} on the status page')


def _counter(response, name: str):
  for info in response.metrics.committed:
    if info.labels.get('NAME') == name and 'user' in info.urn:
      from apache_beam.metrics import monitoring_infos as mi
      return mi.extract_counter_value(info)
  return 0


def test_get_job_metrics_grows_while_the_job_runs(server):
  result = slow_pipeline(
      portable_options(server.job_endpoint, 'metrics-grow', 8),
      elements=16, secs=0.4).run()
  job_id = _job_id(server, 'metrics-grow')
  seen = []  # user counter values read while the job was RUNNING
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:
    state = server.job_stub.GetState(
        beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
    metrics = server.job_stub.GetJobMetrics(
        beam_job_api_pb2.GetJobMetricsRequest(job_id=job_id))
    after = server.job_stub.GetState(
        beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
    if state == after == beam_job_api_pb2.JobState.RUNNING:
      seen.append(_counter(metrics, 'slow_elements'))
    if after == beam_job_api_pb2.JobState.DONE:
      break
    time.sleep(0.25)
  assert result.wait_until_finish() == PipelineState.DONE
  growth = sorted(set(seen))
  # Counts read mid-job, and more than one of them: it grew while running.
  assert len([v for v in growth if 0 < v < 16]) >= 2, seen
  assert seen == sorted(seen), seen  # committed counts never go back
  final = server.job_stub.GetJobMetrics(
      beam_job_api_pb2.GetJobMetricsRequest(job_id=job_id))
  assert _counter(final, 'slow_elements') == 16
  # The page's JSON: the Spark tasks of the job's group, all done.
  detail = _get_json(server.status_url + 'api/jobs/' + job_id)
  assert detail['progress']['total'] >= 8
  assert detail['progress']['done'] == detail['progress']['total']
  assert detail['spark_stages'] and all(
      s['done'] == s['total'] for s in detail['spark_stages'])
  assert detail['spark_ui'] and detail['spark_stages'][0]['url'].startswith(
      detail['spark_ui'])
  assert sum(detail['beam_stage_tasks_done'].values()) >= 8
  # The one line that says where to watch the job, in its messages.
  links = [m['text'] for m in detail['messages'] if 'status page' in m['text']]
  assert len(links) == 1 and re.search(
      r'status page http://localhost:\d+/jobs/metrics-grow\S+, Spark UI '
      r'http://\S+', links[0]), links


# -- the browser --------------------------------------------------------------


@pytest.fixture(scope='module')
def browser(tmp_path_factory):
  missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
  if missing:
    # Fails, never skips: CI must not pass without the browser tests.
    pytest.fail(f'{" and ".join(missing)} missing: run `make setup` (it '
                'runs scripts/ensure-browser.sh as root on Debian), or '
                '`apt-get install chromium chromium-driver`.')
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for flag in CHROMIUM_FLAGS:
    options.add_argument(flag)
  options.add_argument(
      f'--user-data-dir={tmp_path_factory.mktemp("chromium-profile")}')
  driver = webdriver.Chrome(
      service=Service(executable_path=CHROMEDRIVER), options=options)
  driver.set_page_load_timeout(30)
  yield driver
  driver.quit()


@contextlib.contextmanager
def screenshot_on_failure(driver, tmp_path, name: str):
  try:
    yield
  except BaseException:
    path = tmp_path / f'{name}-failure.png'
    try:
      driver.save_screenshot(str(path))
      print(f'screenshot of the failure: {path}')
    except Exception as exn:  # pylint: disable=broad-except
      print(f'no screenshot: {exn}')
    raise


def _text(driver, css: str) -> str:
  """The element's text; '' while it is not there, or was just replaced
  by the page's script (a stale reference: the caller polls again)."""
  from selenium.common.exceptions import StaleElementReferenceException
  from selenium.webdriver.common.by import By
  try:
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[0].text if found else ''
  except StaleElementReferenceException:
    return ''


def _row(browser, job_name_prefix: str):
  """The job list's row of a job, read at once (the script replaces the
  rows every second, so elements found earlier go stale)."""
  return browser.execute_script('''
    var tr = document.querySelector(
        '#jobs-body tr[data-job-id^="' + arguments[0] + '"]');
    if (!tr) return null;
    var p = tr.querySelector('td.progress'), t = tr.querySelector('.tasks');
    return {state: tr.querySelector('td.state').textContent,
            done: p.getAttribute('data-done'),
            total: p.getAttribute('data-total'),
            tasks: t ? t.textContent : null};''', job_name_prefix)


@linux_only
def test_the_list_shows_a_running_jobs_progress_advancing(
    server, browser, tmp_path):
  from selenium.webdriver.common.by import By
  with screenshot_on_failure(browser, tmp_path, 'list'):
    browser.get(server.status_url)
    # Set once: a full reload would lose it.
    browser.execute_script('window.__notReloaded = true;')
    result = slow_pipeline(
        portable_options(server.job_endpoint, 'progress-list', 12),
        elements=24, secs=0.5).run()
    _wait(lambda: _row(browser, 'progress-list'), 60,
          'the new job\'s row, without a reload')
    seen = []  # (done, total) as the page showed them while RUNNING
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      row = _row(browser, 'progress-list')
      if row and row['state'] == 'RUNNING' and row['done'] is not None:
        seen.append((int(row['done']), int(row['total'])))
      if row and row['state'] == 'DONE':
        break
      time.sleep(0.2)
    assert result.wait_until_finish() == PipelineState.DONE
    mid_job = sorted({done for done, total in seen if 0 < done < total})
    assert len(mid_job) >= 2, seen  # it advanced, and the page followed
    assert [d for d, _ in seen] == sorted(d for d, _ in seen), seen
    row = _wait(lambda: (lambda r: r and r['state'] == 'DONE' and r)(
        _row(browser, 'progress-list')), 10, 'DONE on the list')
    assert row['done'] == row['total'] and row['tasks'] == (
        f'{row["done"]}/{row["total"]} tasks')
    assert browser.execute_script('return window.__notReloaded === true;')

    # The finished job's page: the picture docs/guide/status-page.md shows.
    browser.find_element(
        By.CSS_SELECTOR, '#jobs-body tr[data-job-id^="progress-list"] a'
    ).click()
    _wait(lambda: 'elements' in _text(browser, '#job-graph'), 20,
          'element counts on the graph')
    # Its Spark tasks over time, sampled while the list page polled.
    done = browser.execute_script('''
        return Array.from(document.querySelectorAll(
            'svg.chart[data-chart="tasks_done"] g[data-series="done"] circle'
        )).map(c => Number(c.dataset.value));''')
    assert len(done) >= 2 and done == sorted(done) and done[-1] > done[0], done
    # What a new user found (issue 43): the job's own name, its real first
    # state, the options set (Beam's defaults folded away), the master.
    assert _text(browser, 'h1') == 'progress-list'
    states = browser.execute_script('''
        const h = [...document.querySelectorAll('h2')].find(
            e => e.textContent === 'States');
        return [...h.nextElementSibling.querySelectorAll('li')].map(
            li => li.textContent);''')
    assert states[0].endswith('PREPARED') and 'STOPPED' not in ' '.join(
        states), states
    assert states[-1].endswith('DONE'), states
    assert not browser.execute_script(
        'return document.getElementById("all-options").open;')
    set_rows = browser.execute_script(
        'return document.querySelectorAll("table.options-set tr").length;')
    assert 2 <= set_rows <= 10, set_rows  # its head and the few set
    master = _text(browser, '#spark-master')
    assert re.fullmatch(r'local\[[\d*]+\] \(\d+ cores\)', master), master
    height = browser.execute_script(
        'return document.documentElement.scrollHeight;')
    print(f'the job page is {height} px tall')
    wanted = os.environ.get('BEAM_PYSPARK_SCREENSHOTS')
    shot = tmp_path / 'status-page.png'
    browser.save_screenshot(str(shot))
    if wanted:
      shutil.copy(shot, os.path.join(wanted, 'status-page.png'))


@linux_only
def test_the_job_page_is_live_and_its_cancel_cancels(
    server, browser, tmp_path):
  from selenium.webdriver.common.by import By
  with screenshot_on_failure(browser, tmp_path, 'job'):
    result = slow_pipeline(
        portable_options(server.job_endpoint, 'to-cancel', 12),
        elements=400, secs=0.5).run()
    job_id = _job_id(server, 'to-cancel')
    browser.get(server.status_url + 'jobs/' + job_id)
    browser.execute_script('window.__notReloaded = true;')
    # Messages arrive while the page is open.
    _wait(lambda: 'Running job' in _text(browser, '#job-messages'), 60,
          'the job\'s "Running job" message')
    assert browser.execute_script('return window.__notReloaded === true;')
    # The graph: fused stages with the pipeline's transform names, and
    # Beam's element counts on the edges once the first tasks ended.
    graph = _wait(lambda: (lambda t: 'elements' in t and t)(
        _text(browser, '#job-graph')), 90, 'element counts on the graph')
    for name in ('Numbers', 'Slowly', 'Format'):
      assert name in graph, graph
    assert '400 elements' in graph, graph
    assert _text(browser, '#job-state').startswith('RUNNING')
    browser.find_element(By.ID, 'cancel').click()
    _wait(lambda: _text(browser, '#job-state').startswith('CANCELLED'), 60,
          'CANCELLED on the job\'s page')
    state = server.job_stub.GetState(
        beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
    assert state == beam_job_api_pb2.JobState.CANCELLED
    # Beam's PortableRunner raises for a job that ended CANCELLED.
    with pytest.raises(RuntimeError, match='in state CANCELLED'):
      result.wait_until_finish()
    # Cancelled well before its 400 elements' 100 s of sleep.
    counted = server.job_stub.GetJobMetrics(
        beam_job_api_pb2.GetJobMetricsRequest(job_id=job_id))
    assert _counter(counted, 'slow_elements') < 400
