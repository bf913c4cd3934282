"""The status page's style and its two small scripts, inline in the pages.

Vanilla JavaScript, no framework, nothing fetched from elsewhere: the
pages work from a machine with no internet, and through an ssh tunnel.
The job list's script rebuilds its rows from /api/jobs with DOM text
nodes (never HTML from data); a job's page swaps in fragments the server
rendered and escaped (/jobs/<id>/live). The list polls for as long as it
is open (new jobs arrive); a job's page stops once the job has ended.
"""

STYLE = '''
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1em; }
td, th { padding: .25em .75em; border-bottom: 1px solid #ddd; text-align: left;
  vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.state-DONE { color: #176f2c; } .state-FAILED { color: #b00020; }
.state-RUNNING { color: #0b57d0; } .state-CANCELLED { color: #6d4c00; }
.state-CANCELLING { color: #6d4c00; }
.bar { display: inline-block; width: 10em; height: .8em; background: #e6e9ef;
  border-radius: .4em; overflow: hidden; vertical-align: middle; }
.bar .fill { display: block; height: 100%; background: #0b57d0; }
.tasks { margin-left: .5em; font-size: .9em; color: #555; }
ul.messages { list-style: none; padding: 0; }
ul.messages li { border-bottom: 1px solid #eee; padding: .2em 0; }
.sev { display: inline-block; width: 5.5em; font-size: .8em; font-weight: bold; }
.sev-WARNING { color: #8a5a00; } .sev-ERROR { color: #b00020; }
.filters a { margin-right: .75em; } .filters a.current { font-weight: bold; }
pre { white-space: pre-wrap; margin: 0; display: inline; }
form.cancel { display: inline; margin-left: 1em; }
.muted { color: #777; }
.failure { display: block; color: #b00020; font-weight: bold; margin: 4px 0;
  white-space: pre-wrap; }
'''

# The job list: rows rebuilt from /api/jobs every second.
JOBS_SCRIPT = r'''
(function () {
  var body = document.getElementById('jobs-body');
  function cell(tr, text, cls) {
    var td = document.createElement('td');
    if (cls) td.className = cls;
    if (text !== null) td.appendChild(document.createTextNode(text));
    tr.appendChild(td);
    return td;
  }
  function bar(td, p) {
    if (!p) { td.appendChild(document.createTextNode('')); return; }
    td.setAttribute('data-done', p.done);
    td.setAttribute('data-total', p.total);
    var outer = document.createElement('span');
    outer.className = 'bar';
    var fill = document.createElement('span');
    fill.className = 'fill';
    fill.style.width = (100 * p.fraction).toFixed(1) + '%';
    outer.appendChild(fill);
    td.appendChild(outer);
    var text = document.createElement('span');
    text.className = 'tasks';
    text.textContent = p.done + '/' + p.total + ' tasks';
    td.appendChild(text);
  }
  function render(rows) {
    var fresh = document.createElement('tbody');
    fresh.id = 'jobs-body';
    rows.forEach(function (row) {
      var tr = document.createElement('tr');
      tr.setAttribute('data-job-id', row.job_id);
      var a = document.createElement('a');
      a.href = '/jobs/' + encodeURIComponent(row.job_id);
      a.textContent = row.job_name;
      cell(tr, null).appendChild(a);
      var code = document.createElement('code');
      code.textContent = row.job_id;
      cell(tr, null).appendChild(code);
      cell(tr, row.state, 'state state-' + row.state);
      bar(cell(tr, null, 'progress'), row.progress);
      cell(tr, row.submitted_at);
      cell(tr, row.duration_secs === null ? '' :
           row.duration_secs.toFixed(1) + ' s', 'num');
      fresh.appendChild(tr);
    });
    body.parentNode.replaceChild(fresh, body);
    body = fresh;
  }
  function poll() {
    fetch('/api/jobs', {cache: 'no-store'})
      .then(function (r) { return r.json(); })
      .then(function (rows) {
        render(rows);
        setTimeout(poll, 1000);
      })
      .catch(function () { setTimeout(poll, 3000); });
  }
  setTimeout(poll, 1000);
})();
'''

# A job's page: its live sections swapped in every 1.5 s until it ended.
JOB_SCRIPT = r'''
(function () {
  var root = document.getElementById('job');
  var live = root.getAttribute('data-live');
  function poll() {
    fetch(live + window.location.search, {cache: 'no-store'})
      .then(function (r) { return r.json(); })
      .then(function (data) {
        Object.keys(data.sections).forEach(function (id) {
          var el = document.getElementById(id);
          if (el) el.innerHTML = data.sections[id];
        });
        if (!data.terminal) setTimeout(poll, 1500);
      })
      .catch(function () { setTimeout(poll, 3000); });
  }
  if (root.getAttribute('data-terminal') !== 'true') setTimeout(poll, 1500);
})();
'''
