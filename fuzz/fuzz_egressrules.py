"""Fuzz the `network.rules` core (sans-IO): validation, matching, head rewriting.

`aenv.proto.egressrules` takes rules from API bodies and request heads from
sandboxes, both untrusted. The rules: `parse_rules` either refuses with
`PolicyError` or returns rules that round-trip through `to_doc`/`from_doc`;
`headers_for` never raises and picks an exact pattern over any wildcard;
`rewrite_head` either refuses with `HeadError` or returns one head that ends
with exactly one blank line, holds each injected header exactly once, asks
for `Connection: close`, keeps the request line, and never lets a header
line the sandbox sent survive under an injected name (so the sandbox cannot
smuggle a second value past the rule); `substitute` resolves each placeholder of the
value in one pass (nothing else) and refuses line breaks in values. Runs under pytest
(short) or standalone (`python fuzz/fuzz_egressrules.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from _harness import FUZZ, main
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.egressrules import (
    HeadError,
    HostRules,
    Placeholder,
    head_end,
    parse_rules,
    placeholders,
    rewrite_head,
    substitute,
)
from aenv.proto.netpolicy import PolicyError

header_names = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,12}", fullmatch=True)
text = st.text(st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=40)
hosts = st.one_of(
    st.from_regex(r"(\*\.)?[a-z0-9]{1,8}(\.[a-z0-9]{1,8}){0,3}", fullmatch=True), text
)


@FUZZ
@given(
    st.dictionaries(
        hosts,
        st.lists(
            st.one_of(
                st.fixed_dictionaries(
                    {
                        "transform": st.fixed_dictionaries(
                            {"headers": st.dictionaries(header_names, text)}
                        )
                    }
                ),
                st.none(),
                text,
            ),
            max_size=3,
        ),
        max_size=4,
    ),
    st.one_of(st.none(), hosts),
)
def test_rules(raw: dict[str, list[object]], name: str | None) -> None:
    try:
        rules = parse_rules(raw)
    except PolicyError:
        return
    assert HostRules.from_doc(rules.to_doc()) == rules
    got = rules.headers_for(name)
    if name is not None and name in rules.hosts:
        assert got == dict(rules.rules)[name]


@FUZZ
@given(
    st.lists(st.tuples(header_names, text), max_size=6),
    st.lists(st.tuples(header_names, text), max_size=4),
    st.binary(max_size=60),
)
def test_rewrite(sent: list[tuple[str, str]], inject: list[tuple[str, str]], noise: bytes) -> None:
    inject = list({k.lower(): (k, v) for k, v in inject}.values())
    lines = ["GET /p HTTP/1.1", *(f"{k}: {v}" for k, v in sent)]
    for head in (("\r\n".join(lines) + "\r\n\r\n").encode("utf-8"), noise + b"\r\n\r\n"):
        try:
            out = rewrite_head(head, inject)
        except HeadError:
            continue
        assert head_end(out) == len(out)
        text_out = out.decode("latin-1")
        got = text_out[:-4].split("\r\n")
        assert got[0] == head.decode("latin-1").split("\r\n")[0]
        assert got[-1] == "Connection: close"
        for k, v in inject:
            same = [g for g in got[1:] if g.split(":", 1)[0].strip().lower() == k.lower()]
            assert same == [f"{k}: {v}"]


@FUZZ
@given(text, st.text(min_size=4, max_size=20))
def test_substitute(value: str, secret: str) -> None:
    calls: list[Placeholder] = []

    def resolve(p: Placeholder) -> str:
        calls.append(p)
        return secret

    try:
        out = substitute(value, resolve)
    except HeadError:
        assert any(c in secret for c in "\r\n\x00") and placeholders(value)
        return
    # one pass: every placeholder of `value` resolved once, nothing else asked
    assert set(calls) == placeholders(value)
    if secret not in value:
        assert (secret in out) == bool(calls)


TESTS: tuple[Callable[[], None], ...] = (test_rules, test_rewrite, test_substitute)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
