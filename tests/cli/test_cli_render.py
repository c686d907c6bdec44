"""Listings: aligned tables with relative times; JSON unless asked otherwise."""

from __future__ import annotations

import datetime as dt

from aenv.client import render

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def test_sandbox_table() -> None:
    out = render.sandboxes_table(
        [
            {
                "sandboxID": "abc",
                "alias": "base",
                "state": "running",
                "startedAt": "2026-01-01T11:58:30Z",
                "endAt": "2026-01-01T12:05:00Z",
                "cpuCount": 2,
                "memoryMB": 512,
                "metadata": {"b": "2", "a": "1"},
            }
        ],
        NOW,
    )
    header, row = out.splitlines()
    assert header.split() == [
        "SANDBOX",
        "ID",
        "TEMPLATE",
        "STATE",
        "STARTED",
        "ENDS",
        "CPU",
        "MEM",
        "MB",
        "METADATA",
    ]
    assert row.split() == [
        "abc",
        "base",
        "running",
        "1m30s",
        "ago",
        "in",
        "5m00s",
        "2",
        "512",
        "a=1,b=2",
    ]
    assert header.index("TEMPLATE") == row.index("base")


def test_sandbox_table_says_why_a_sandbox_died() -> None:
    listed = {"sandboxID": "abc", "state": "running", "endAt": "2026-01-01T12:05:00Z"}
    died = {
        "sandboxID": "def",
        "state": "died",
        "endAt": "2026-01-01T11:59:00Z",
        "reason": "died at 2026-01-01T11:59:00+00:00: the host killed it: out of memory",
    }
    header, row_listed, row_died = render.sandboxes_table([listed, died], NOW).splitlines()
    assert header.split()[-1] == "REASON"
    assert "died" not in row_listed
    assert "died" in row_died.split() and row_died.endswith("out of memory")
    assert " - " in row_died  # it ends no more: no "ENDS"
    assert "REASON" not in render.sandboxes_table([listed], NOW)


def test_times() -> None:
    assert render.ago("2026-01-01T10:00:00Z", NOW) == "2h00m ago"
    assert render.until("2026-01-01T11:00:00Z", NOW) == "now"
    assert render.until(None, NOW) == "-"


def test_explicit_format_wins() -> None:
    assert render.choose_format("table") == "table"
    assert render.choose_format("json") == "json"


def test_members_table() -> None:
    out = render.members_table(
        [
            {
                "nodeID": "a",
                "url": "http://10.0.0.1:8000",
                "state": "alive",
                "incarnation": 2,
                "load": {
                    "sandboxes": 3,
                    "maxSandboxes": 256,
                    "memFree": 8 * 2**30,
                    "memTotal": 16 * 2**30,
                    "cpuLoad": 0.5,
                    "draining": True,
                },
            },
            {"nodeID": "b", "url": "http://10.0.0.2:8000", "state": "dead", "incarnation": 0},
        ]
    )
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["NODE", "URL", "STATE", "INC"]
    assert "alive (draining)" in lines[1] and "3/256" in lines[1] and "8.0/16.0" in lines[1]
    assert lines[2].split()[:3] == ["b", "http://10.0.0.2:8000", "dead"]
