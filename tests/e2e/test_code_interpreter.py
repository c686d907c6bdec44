"""The unmodified `e2b-code-interpreter` SDK against a node's `code-interpreter-v1`.

The template's sandboxes restore a capture taken with the code interpreter's
server (aenv.interp.server) and a warm Python kernel running, so state
lives in the kernel: it carries over between runs, across pause/resume and
into every child of a fork. The first create of a node waits for that
capture (boot, kernel, capture); the rest restore it.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import BarChart, ChartType, LineChart

from tests.conftest import NodeProc, built_home, requires_node

TEMPLATE = "code-interpreter-v1"
JS = Path(__file__).resolve().parent.parent / "js"


def _has_template() -> bool:
    home = built_home()
    return home is not None and (home / "templates" / TEMPLATE / "template.json").is_file()


pytestmark = [
    requires_node,
    pytest.mark.runsc,
    pytest.mark.skipif(
        not _has_template(), reason=f"AENV_TEST_HOME has no {TEMPLATE} (make test-artefacts)"
    ),
]


@pytest.fixture
def sbx(node: NodeProc) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=300, request_timeout=300)  # the SDK's default template
    try:
        yield s
    finally:
        with contextlib.suppress(Exception):
            s.kill()


def test_stateful_runs_and_execution_counts(sbx: Sandbox) -> None:
    first = sbx.run_code("x = 41\nx + 1")
    assert first.error is None
    assert first.text == "42"
    second = sbx.run_code("x += 1\nprint('x is', x)\nx")
    assert second.logs.stdout == ["x is 42\n"]
    assert second.text == "42"
    assert second.execution_count is not None and first.execution_count is not None
    assert second.execution_count == first.execution_count + 1


def test_exception_comes_back_with_its_traceback(sbx: Sandbox) -> None:
    execution = sbx.run_code("def f():\n    return 1 / 0\n\nf()")
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "f()" in execution.error.traceback and "ZeroDivisionError" in execution.error.traceback
    assert sbx.run_code("'still here'").text == "'still here'"


def test_matplotlib_figure_is_png_and_chart_data(sbx: Sandbox) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\n"
        "ax.plot([1, 2, 3], [2, 4, 8], label='growth')\n"
        "ax.set_title('Growth'); ax.set_xlabel('day'); ax.set_ylabel('size')\n"
        "plt.show()"
    )
    execution = sbx.run_code(code)
    assert execution.error is None, execution.error
    [result] = execution.results
    assert result.png is not None
    assert base64.b64decode(result.png).startswith(b"\x89PNG\r\n\x1a\n")
    chart = result.chart
    assert isinstance(chart, LineChart) and chart.type is ChartType.LINE
    assert (chart.title, chart.x_label, chart.y_label) == ("Growth", "day", "size")
    [line] = chart.elements
    assert line.label == "growth"
    assert line.points == [(1, 2), (2, 4), (3, 8)]

    bars = sbx.run_code(
        "plt.figure(); plt.bar(['a', 'b'], [3, 5], label='count'); plt.title('Bars'); plt.show()"
    )
    bar = bars.results[0].chart
    assert isinstance(bar, BarChart) and bar.title == "Bars"
    assert [(e.label, e.group, e.value) for e in bar.elements] == [
        ("a", "count", 3),
        ("b", "count", 5),
    ]


def test_result_formats(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "import pandas as pd\n"
        "from IPython.display import Markdown, display\n"
        "display(Markdown('**bold**'))\n"
        "pd.DataFrame({'a': [1, 2]})"
    )
    assert execution.error is None, execution.error
    markdown, frame = execution.results
    assert markdown.markdown == "**bold**" and not markdown.is_main_result
    assert frame.is_main_result and frame.html is not None and "<table" in frame.html
    assert frame.text is not None and "a" in frame.text


def test_streaming_callbacks_arrive_while_it_runs(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    errors: list[str] = []
    results: list[str] = []
    started = time.monotonic()
    execution = sbx.run_code(
        "import sys, time\n"
        "print('one', flush=True)\n"
        "time.sleep(1.5)\n"
        "print('two', flush=True)\n"
        "print('oops', file=sys.stderr, flush=True)\n"
        "'done'",
        on_stdout=lambda m: seen.append((time.monotonic() - started, m.line)),
        on_stderr=lambda m: errors.append(m.line),
        on_result=lambda r: results.append(str(r.text)),
    )
    assert [line for _, line in seen] == ["one\n", "two\n"]
    assert seen[1][0] - seen[0][0] > 1.0  # streamed, not delivered at the end
    assert errors == ["oops\n"]
    assert results == ["'done'"] and execution.text == "'done'"


def test_contexts_are_isolated_and_managed(sbx: Sandbox) -> None:
    sbx.run_code("shared = 'default'")
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    missing = sbx.run_code("shared", context=ctx)
    assert missing.error is not None and missing.error.name == "NameError"
    sbx.run_code("mine = 1", context=ctx)
    assert sbx.run_code("shared").text == "'default'"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("mine", context=ctx).error is not None
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]


def test_bash_contexts_keep_shell_state(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(language="bash", cwd="/tmp")
    assert ctx.language == "bash"
    sbx.run_code("COUNT=41; cd /home/user", context=ctx)
    ran = sbx.run_code("echo $((COUNT + 1)) $(pwd)", context=ctx)
    assert ran.logs.stdout == ["42 /home/user\n"]
    failed = sbx.run_code("ls /nonexistent", context=ctx)
    assert failed.error is not None or failed.logs.stderr
    with_env = sbx.run_code("echo $GREETING", context=ctx, envs={"GREETING": "hi"})
    assert with_env.logs.stdout == ["hi\n"]
    assert sbx.run_code('echo "${GREETING-unset}"', context=ctx).logs.stdout == ["unset\n"]
    # `language` alone runs in that language's default context
    assert sbx.run_code("echo $0 | grep -c bash", language="bash").logs.stdout == ["1\n"]


def test_env_vars_apply_to_one_run(sbx: Sandbox) -> None:
    code = "import os; repr(os.environ.get('AENV_GREETING'))"
    assert sbx.run_code(code, envs={"AENV_GREETING": "hi"}).text == "\"'hi'\""
    assert sbx.run_code(code).text == "'None'"


def test_sandbox_env_vars_from_create_reach_the_kernel(node: NodeProc) -> None:
    s = Sandbox.create(envs={"AENV_FROM_CREATE": "yes"}, timeout=120, request_timeout=300)
    try:
        assert s.run_code("import os; os.environ['AENV_FROM_CREATE']").text == "'yes'"
        bash = s.run_code("echo $AENV_FROM_CREATE", language="bash")
        assert bash.logs.stdout == ["yes\n"]
    finally:
        s.kill()


def test_timeout_interrupts_the_run(sbx: Sandbox) -> None:
    sbx.run_code("n = 0")
    with pytest.raises(Exception, match="timed out"):
        sbx.run_code("import time\nwhile True:\n    n += 1\n    time.sleep(0.01)", timeout=2)
    # the kernel was interrupted: the context answers at once and kept its state
    started = time.monotonic()
    after = sbx.run_code("n > 0")
    assert after.text == "True"
    assert time.monotonic() - started < 10


def test_a_dead_kernel_is_replaced(sbx: Sandbox) -> None:
    sbx.run_code("lost = 1")
    died = sbx.run_code("import os\nos._exit(3)")
    assert died.error is not None and died.error.name == "KernelDied"
    after = sbx.run_code("'lost' in globals(), 6 * 7")
    assert after.error is None and after.text == "(False, 42)"


def test_fork_keeps_kernel_state(node: NodeProc) -> None:
    src = Sandbox.create(timeout=300, request_timeout=300)
    children: list[Sandbox] = []
    try:
        src.run_code("import numpy as np\nsecret = np.arange(5).sum()")
        results = src.fork(count=2, timeout=120)
        children = [r for r in results if isinstance(r, Sandbox)]
        assert len(children) == 2, results
        for i, child in enumerate(children):
            assert child.run_code("int(secret)").text == "10"
            child.run_code(f"secret = {i}")
        assert [c.run_code("secret").text for c in children] == ["0", "1"]
        assert src.run_code("int(secret)").text == "10"
    finally:
        for c in children:
            with contextlib.suppress(Exception):
                c.kill()
        src.kill()


def test_pause_resume_keeps_kernel_state(node: NodeProc) -> None:
    s = Sandbox.create(timeout=300, request_timeout=300)
    try:
        s.run_code("kept = [1, 2, 3]")
        s.pause()
        resumed = Sandbox.connect(s.sandbox_id)
        assert resumed.run_code("sum(kept)").text == "6"
    finally:
        s.kill()


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_js_sdk(node: NodeProc) -> None:
    if not (JS / "node_modules" / "@e2b" / "code-interpreter").is_dir():
        pytest.skip("npm @e2b/code-interpreter not installed (make test installs it)")
    env = dict(os.environ, E2B_API_URL=node.url, E2B_SANDBOX_URL=node.url, E2B_API_KEY=node.api_key)
    r = subprocess.run(
        ["node", "--test", "interp.test.mjs"],
        cwd=JS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_other_size_boots_and_starts_the_server(node: NodeProc) -> None:
    """A create at another size than the template's cannot restore its capture:
    the node boots it and starts the code interpreter before answering."""
    r = httpx.post(
        f"{node.url}/sandboxes",
        headers={"X-API-Key": node.api_key},
        json={"templateID": TEMPLATE, "timeout": 120, "memoryMB": 768},
        timeout=300,
    )
    assert r.status_code == 201, r.text
    s = Sandbox.connect(r.json()["sandboxID"])
    try:
        assert s.run_code("import numpy; int(numpy.ones(3).sum())").text == "3"
    finally:
        s.kill()
