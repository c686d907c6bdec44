"""The code interpreter server's translation of Jupyter messages into the
SDKs' stream events (aenv.interp.server, which imports only the standard
library, so this runs on the host; the kernel side runs in tests/e2e)."""

from __future__ import annotations

import subprocess

import pytest

from aenv.interp import server


def _msg(kind: str, **content: object) -> dict[str, object]:
    return {"msg_type": kind, "content": content, "parent_header": {"msg_id": "m"}}


def test_streams_become_stdout_and_stderr_lines() -> None:
    out = server._event(_msg("stream", name="stdout", text="hi\n"))
    err = server._event(_msg("stream", name="stderr", text="oops\n"))
    assert out is not None and err is not None
    assert (out["type"], out["text"]) == ("stdout", "hi\n")
    assert (err["type"], err["text"]) == ("stderr", "oops\n")
    assert isinstance(out["timestamp"], int) and out["timestamp"] > 10**18  # ns


def test_results_carry_every_format_under_the_sdk_names() -> None:
    data = {
        "text/plain": "<Figure>",
        "image/png": "iVBORw0KGgo=\n",
        "text/html": "<b>x</b>",
        "application/vnd.aenv.chart+json": {"type": "line", "title": None, "elements": []},
        "application/x-custom": "kept",
    }
    main = server._event(_msg("execute_result", data=data, execution_count=3))
    shown = server._event(_msg("display_data", data={"text/markdown": "**b**"}))
    assert main == {
        "type": "result",
        "is_main_result": True,
        "text": "<Figure>",
        "png": "iVBORw0KGgo=",
        "html": "<b>x</b>",
        "chart": {"type": "line", "title": None, "elements": []},
        "extra": {"application/x-custom": "kept"},
    }
    assert shown == {"type": "result", "is_main_result": False, "markdown": "**b**"}


def test_errors_and_execution_counts() -> None:
    error = server._event(
        _msg("error", ename="ValueError", evalue="bad", traceback=["line 1", "ValueError: bad"])
    )
    assert error == {
        "type": "error",
        "name": "ValueError",
        "value": "bad",
        "traceback": "line 1\nValueError: bad",
    }
    count = server._event(_msg("execute_input", code="1", execution_count=7))
    assert count == {"type": "number_of_executions", "execution_count": 7}
    assert server._event(_msg("status", execution_state="busy")) is None


def test_languages_are_those_with_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "_kernels", {"python3", "bash"})
    assert server._language(None) == "python"
    assert server._language("Python3") == "python"
    assert server._language("sh") == "bash"
    monkeypatch.setattr(server, "_kernels", {"python3"})
    with pytest.raises(server.HTTPError) as e:
        server._language("bash")
    assert e.value.status == 400 and "(available: python)" in e.value.message
    with pytest.raises(server.HTTPError):
        server._language("r")


def test_bash_env_vars_are_put_back() -> None:
    envs = {"GREETING": "it's me"}
    script = server._bash_push_env(envs) + "echo $GREETING\n" + server._bash_pop_env(envs)
    script += 'echo "${GREETING-unset}"\n'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["it's me", "unset"]
    before = "export GREETING=old\n"
    done = subprocess.run(
        ["bash", "-c", before + script], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines() == ["it's me", "old"]


def test_helpers_call_the_hidden_module_without_binding_names() -> None:
    code = server._call_kernel_module("push_env", {"A": "1"})
    assert code == "__import__('sys').modules['_aenv_interp'].push_env({'A': '1'})\n"
    compile(server._setup_code(), "<setup>", "exec")  # valid Python for the kernel
