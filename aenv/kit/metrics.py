"""A tiny Prometheus registry: counters, gauges and a text exposition.

Enough for `/metrics`: labelled counters and gauges, plus gauges computed at
scrape time from callbacks. No global state: the node owns one `Registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]


def _fmt_value(value: float) -> str:
    """Exact: whole numbers as integers (byte counters pass 10**6), others as repr."""
    if value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(value)


def _fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(10), " ").replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels
    )
    return "{" + inner + "}"


@dataclass
class Metric:
    name: str
    help: str
    kind: str  # "counter" | "gauge"
    values: dict[Labels, float] = field(default_factory=dict)
    callback: Callable[[], Iterable[tuple[Labels, float]]] | None = None

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def counter(
        self,
        name: str,
        help: str,
        callback: Callable[[], Iterable[tuple[Labels, float]]] | None = None,
    ) -> Metric:
        """A counter: incremented with `inc`, or read from `callback` at render time."""
        return self._add(Metric(name, help, "counter", callback=callback))

    def gauge(
        self,
        name: str,
        help: str,
        callback: Callable[[], Iterable[tuple[Labels, float]]] | None = None,
    ) -> Metric:
        return self._add(Metric(name, help, "gauge", callback=callback))

    def _add(self, m: Metric) -> Metric:
        if m.name in self._metrics:
            raise ValueError(f"metric {m.name} registered twice")
        self._metrics[m.name] = m
        return m

    def render(self) -> str:
        out: list[str] = []
        for m in self._metrics.values():
            out.append(f"# HELP {m.name} {m.help}")
            out.append(f"# TYPE {m.name} {m.kind}")
            samples = list(m.callback()) if m.callback else list(m.values.items())
            if not samples and m.callback is None:
                samples = [((), 0.0)]
            for labels, value in samples:
                out.append(f"{m.name}{_fmt_labels(labels)} {_fmt_value(value)}")
        return "\n".join(out) + "\n"
