"""Hypothesis strategies that generate valid messages for any pb MessageType."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from aenv.proto.pb import _RANGES, Field, Kind, Message, MessageType

_TS_MIN, _TS_MAX = -62135596800, 253402300799


def value_strategy(f: Field, depth: int) -> st.SearchStrategy[Any]:
    kind = f.kind
    if kind is Kind.STRING:
        return st.text(max_size=20)
    if kind is Kind.BYTES:
        return st.binary(max_size=40)
    if kind is Kind.BOOL:
        return st.booleans()
    if kind is Kind.ENUM:
        assert f.enum is not None
        return st.sampled_from(sorted(set(f.enum.values.values())))
    if kind is Kind.MAP:
        return st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
    if kind is Kind.MESSAGE:
        assert f.message is not None
        return message_strategy(f.message, depth + 1)
    lo, hi = _RANGES[kind]
    return st.integers(lo, hi)


def message_strategy(mtype: MessageType, depth: int = 0) -> st.SearchStrategy[Message]:
    if mtype.wkt == "timestamp":
        return st.builds(
            lambda s, n: {"seconds": s, "nanos": n},
            st.integers(_TS_MIN, _TS_MAX),
            st.integers(0, 999_999_999),
        )
    plain = [f for f in mtype.fields if f.oneof is None]
    required: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for f in plain:
        if f.kind is Kind.MESSAGE and depth > 4:
            continue
        strat = value_strategy(f, depth)
        if f.repeated:
            strat = st.lists(strat, max_size=3)
        if f.has_presence:
            optional[f.name] = strat
        else:
            required[f.name] = strat
    base = st.fixed_dictionaries(required, optional=optional)
    oneof_parts = []
    for members in mtype.oneofs.values():
        choices: list[st.SearchStrategy[dict[str, Any]]] = [st.just({})]
        for f in members:
            if f.kind is Kind.MESSAGE and depth > 4:
                continue
            choices.append(value_strategy(f, depth).map(lambda v, n=f.name: {n: v}))
        oneof_parts.append(st.one_of(choices))

    def merge(parts: tuple[dict[str, Any], ...]) -> Message:
        out: dict[str, Any] = {}
        for part in parts:
            out.update(part)
        return normalize(mtype, out)

    return st.tuples(base, *oneof_parts).map(merge)


def normalize(mtype: MessageType, msg: Message) -> Message:
    """`msg` as decode() returns it: defaults filled in, nested too."""
    if mtype.wkt == "timestamp":
        return {"seconds": msg.get("seconds", 0), "nanos": msg.get("nanos", 0)}
    out = mtype.default()
    for f in mtype.fields:
        if f.name not in msg:
            continue
        value = msg[f.name]
        if f.kind is Kind.MESSAGE:
            assert f.message is not None
            sub = f.message
            value = [normalize(sub, v) for v in value] if f.repeated else normalize(sub, value)
        out[f.name] = value
    return out
