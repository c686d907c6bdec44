"""Host-name egress rules on real gVisor sandboxes, driven through the e2b SDK.

Rules: the "internet" is `tests.egressnet` (namespace `AENV_TEST_EGRESS_PREFIX`,
default `aenvci`; TEST-NET addresses, its own resolver, HTTP and HTTPS
servers with a test CA); this file's node admits only that range
(`AENV_EGRESS_CAP`) and checks names against that resolver
(`AENV_EGRESS_DNS`), so nothing leaves the machine. Inside the sandbox curl
pins names to addresses with `--resolve` (the sandbox's own DNS is not what
is tested, except in `test_dns_servers`), trusts the test CA with
`--cacert`, and gives up after 5 s. A server answers `from <its address>
host=<Host> sni=<SNI> peer=<client>`, so a test sees where a request really
went.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from e2b import Sandbox, Secret, SecretException

from tests.conftest import (
    NET_PREFIX,
    NodeProc,
    built_home,
    leaks,
    link_home,
    requires_node,
    sdk_pointed_at,
    start_node,
    stop_node,
)
from tests.egressnet import (
    DNS_IP,
    HOST_END,
    NAMES,
    NODE_RANGES,
    PROXY_IP,
    SUBNET,
    UNCERTIFIED,
    A,
    B,
    C,
    Internet,
    internet_fixture,
    socks_fixture,
)

pytestmark = [requires_node, pytest.mark.runsc]

CA_IN_SANDBOX = "/tmp/test-ca.pem"
NODE_ENV = {"AENV_EGRESS_CAP": SUBNET, "AENV_EGRESS_DNS": DNS_IP}
# this file's nodes split the run's slot range: the module's node, the restarted one
SLOTS = NODE_RANGES[:2]
ONLY_THESE = {"allow_out": ["allowed.test", "*.cdn.test"], "deny_out": ["0.0.0.0/0"]}


internet = internet_fixture("")
socks = socks_fixture()


@pytest.fixture(scope="module")
def enode(internet: Internet) -> Iterator[NodeProc]:
    home = built_home()
    assert home is not None
    private = Path(tempfile.mkdtemp(prefix="aenv-egress-node-"))
    link_home(home, private)
    try:
        n = start_node(
            private,
            api_key="aenv_test_" + secrets.token_hex(8),
            log_path=private / "node.log",
            extra_env={
                **NODE_ENV,
                "AENV_SLOT_CIDR": str(SLOTS[0]),
                "AENV_NET_PREFIX": NET_PREFIX + "e",
                # the internet's CA, for re-encrypting intercepted requests
                "AENV_EGRESS_CA_FILE": str(internet.ca_pem),
            },
        )
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    try:
        with sdk_pointed_at(n.url, n.api_key):
            yield n
    finally:
        code = stop_node(n)
        left = leaks(private, NET_PREFIX + "e")
        assert code == 0, f"node exited with {code}:\n{n.log_tail()}"
        assert not left, f"node left behind: {left}"
        shutil.rmtree(private, ignore_errors=True)


def prepare(sbx: Sandbox, internet: Internet) -> Sandbox:
    sbx.files.write(CA_IN_SANDBOX, internet.ca_pem.read_text())
    return sbx


def fetch(sbx: Sandbox, url: str, *, to: str | None = None, header: str | None = None) -> str:
    """curl `url` in the sandbox; its name pinned to `to` (default: its real address)."""
    host = url.split("/")[2]
    name, _, port = host.partition(":")
    port = port or ("443" if url.startswith("https") else "80")
    args = ["curl", "-sS", "-m", "5", "--cacert", CA_IN_SANDBOX]
    if name in NAMES:
        args += ["--resolve", f"{name}:{port}:{to or NAMES[name][0]}"]
    if header:
        args += ["-H", f"'{header}'"]
    r = sbx.commands.run(" ".join([*args, url, "2>&1 || echo fail:$?"]), timeout=30)
    return r.stdout.strip()


def cli_env(config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env["XDG_CONFIG_HOME"] = str(config)
    return env


def allowed(out: str, ip: str) -> bool:
    return out.startswith(f"from {ip} ")


def egress_log(node: NodeProc, sandbox_id: str) -> list[dict[str, str]]:
    r = httpx.get(f"{node.url}/v2/sandboxes/{sandbox_id}/logs", headers={"X-API-Key": node.api_key})
    r.raise_for_status()
    return [e["fields"] for e in r.json()["logs"] if e["fields"].get("kind") == "egress"]


def test_only_named_hosts(enode: NodeProc, internet: Internet, tmp_path: Path) -> None:
    s = prepare(Sandbox.create("base", network=ONLY_THESE), internet)  # type: ignore[arg-type]
    try:
        out = fetch(s, "https://allowed.test/")
        assert allowed(out, A) and "sni=allowed.test" in out, out
        assert allowed(fetch(s, "http://allowed.test/"), A)
        # wildcards: any depth below the suffix, never the suffix itself
        assert allowed(fetch(s, "https://api.cdn.test/"), A)
        assert allowed(fetch(s, "https://deep.api.cdn.test/"), A)
        assert fetch(s, "https://cdn.test/").startswith(("fail:", "curl:"))
        assert fetch(s, "https://other.test/").startswith(("fail:", "curl:"))
        # a raw IP no CIDR allows, over TLS without a name and over HTTP
        assert "fail:" in fetch(s, f"http://{C}/")
        assert "fail:" in fetch(s, f"https://{C}/")
        # an allowed name claimed to another address gets nowhere (SNI and Host)
        assert "fail:" in fetch(s, "https://allowed.test/", to=B)
        assert "fail:" in fetch(s, f"http://{B}/", header="Host: allowed.test")
        info = s.get_info().network or {}
        assert info.get("allow_out") == ONLY_THESE["allow_out"]
        log = egress_log(enode, s.sandbox_id)
        verdicts = {(e["host"], e["ip"], e["verdict"]) for e in log}
        assert ("allowed.test", A, "allowed") in verdicts
        assert ("other.test", B, "denied") in verdicts
        assert ("allowed.test", B, "denied") in verdicts
        assert ("", C, "denied") in verdicts
        assert any(int(e["bytesIn"]) > 0 for e in log if e["verdict"] == "allowed")
        metrics = httpx.get(f"{enode.url}/metrics", headers={"X-API-Key": enode.api_key}).text
        assert 'aenv_egress_connections_total{proto="tls",verdict="allowed"}' in metrics
        cli = subprocess.run(
            [sys.executable, "-m", "aenv", "logs", s.sandbox_id, "--egress", "--output", "table"],
            env={**cli_env(tmp_path), "AENV_URL": enode.url, "AENV_API_KEY": enode.api_key},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        rows = cli.stdout.splitlines()
        assert rows[0].split()[:4] == ["TIME", "VERDICT", "HOST", "ADDRESS"]
        assert any("denied" in r and "other.test" in r for r in rows[1:])
    finally:
        s.kill()


def test_deny_by_name_with_the_internet_open(enode: NodeProc, internet: Internet) -> None:
    s = prepare(Sandbox.create("base", network={"deny_out": ["other.test"]}), internet)
    try:
        assert "fail:" in fetch(s, "https://other.test/")
        assert allowed(fetch(s, "https://allowed.test/"), A)
        assert allowed(fetch(s, f"http://{C}/"), C)  # addresses stay open
    finally:
        s.kill()


def test_sandboxes_without_names_skip_the_proxy(enode: NodeProc, internet: Internet) -> None:
    s = prepare(Sandbox.create("base"), internet)
    try:
        assert allowed(fetch(s, "https://allowed.test/", to=B), B)
        assert egress_log(enode, s.sandbox_id) == []
    finally:
        s.kill()


def test_dns_servers(enode: NodeProc, internet: Internet) -> None:
    network = {**ONLY_THESE, "dns_servers": [DNS_IP]}
    s = prepare(Sandbox.create("base", network=network), internet)  # type: ignore[arg-type]
    try:
        s.commands.run(f"echo 'nameserver {DNS_IP}' > /etc/resolv.conf", user="root")
        r = s.commands.run(
            f"curl -sS -m 5 --cacert {CA_IN_SANDBOX} https://allowed.test/ 2>&1 || echo fail:$?",
            timeout=30,
        )
        assert allowed(r.stdout.strip(), A), r.stdout
        assert (s.get_info().network or {}).get("dns_servers") == [DNS_IP]
        s.update_network(ONLY_THESE)  # type: ignore[arg-type]
        r = s.commands.run("curl -sS -m 5 https://allowed.test/ 2>&1 || echo fail:$?", timeout=30)
        assert "fail:" in r.stdout  # the resolver is closed again (the default is 8.8.8.8)
    finally:
        s.kill()


def test_rules_change_at_runtime_and_survive_pause_and_fork(
    enode: NodeProc, internet: Internet
) -> None:
    s = prepare(Sandbox.create("base", network=ONLY_THESE), internet)  # type: ignore[arg-type]
    forks: list[Sandbox] = []
    try:
        assert allowed(fetch(s, "https://allowed.test/"), A)
        s.update_network({"allow_out": ["other.test"], "deny_out": ["0.0.0.0/0"]})
        assert allowed(fetch(s, "https://other.test/"), B)
        assert "fail:" in fetch(s, "https://allowed.test/")
        s.pause()
        s = Sandbox.connect(s.sandbox_id)
        assert allowed(fetch(s, "https://other.test/"), B)
        assert "fail:" in fetch(s, "https://allowed.test/")
        assert (s.get_info().network or {}).get("allow_out") == ["other.test"]
        (child,) = s.fork(count=1)
        assert isinstance(child, Sandbox), child
        forks.append(child)
        assert allowed(fetch(child, "https://other.test/"), B)
        assert "fail:" in fetch(child, "https://allowed.test/")
    finally:
        for f in forks:
            f.kill()
        s.kill()


@pytest.mark.parametrize(
    "network",
    [ONLY_THESE, {"allow_out": ["allowed.test", "0.0.0.0/0"]}, {"deny_out": ["other.test"]}],
)
def test_host_stays_unreachable(
    enode: NodeProc, internet: Internet, network: dict[str, list[str]]
) -> None:
    s = prepare(Sandbox.create("base", network=network), internet)  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        # the host's own address in the internet's subnet, its proxy port, its loopback
        assert "fail:" in fetch(s, f"http://{HOST_END}:1/")
        assert "fail:" in fetch(s, "https://allowed.test/", to=HOST_END)
        assert "fail:" in fetch(s, "http://127.0.0.1/")
        assert time.monotonic() - t0 < 30
    finally:
        s.kill()


def test_rules_survive_a_node_restart(internet: Internet, tmp_path: Path) -> None:
    home = built_home()
    assert home is not None
    private = tmp_path / "home"
    private.mkdir()
    link_home(home, private)
    prefix = NET_PREFIX + "r"
    env = {
        **NODE_ENV,
        "AENV_SLOT_CIDR": str(SLOTS[1]),
        "AENV_NET_PREFIX": prefix,
        "AENV_ON_STOP": "keep",  # a crashed node's sandboxes run on
    }
    key = "aenv_test_" + secrets.token_hex(8)

    def start() -> NodeProc:
        return start_node(private, api_key=key, log_path=private / "node.log", extra_env=env)

    n = start()
    try:
        with sdk_pointed_at(n.url, key):
            s = prepare(Sandbox.create("base", network=ONLY_THESE), internet)  # type: ignore[arg-type]
            assert allowed(fetch(s, "https://allowed.test/"), A)
        stop_node(n, signal.SIGKILL)
        n = start()
        with sdk_pointed_at(n.url, key):
            s = Sandbox.connect(s.sandbox_id)
            assert allowed(fetch(s, "https://allowed.test/"), A)
            assert "fail:" in fetch(s, "https://other.test/")
            assert (s.get_info().network or {}).get("allow_out") == ONLY_THESE["allow_out"]
            s.kill()
    finally:
        env["AENV_ON_STOP"] = "stop"
        code = stop_node(n)
        left = leaks(private, prefix)
        assert code == 0, n.log_tail()
        assert not left, left


def test_secrets_through_the_sdk(enode: NodeProc) -> None:
    value = "sk-test-" + secrets.token_hex(16)
    info = Secret.create("Egress-Test-Key", value, metadata={"owner": "tests"})
    try:
        assert info.name == "egress-test-key" and info.version == 1
        assert Secret.get_info("egress-test-key").secret_id == info.secret_id
        assert Secret.exists(info.secret_id)
        updated = Secret.update(info.secret_id, value + "-2")
        assert updated.version == 2 and updated.metadata == {"owner": "tests"}
        listed = Secret.list().next_items()
        assert [s.secret_id for s in listed if s.name == "egress-test-key"] == [info.secret_id]
        with pytest.raises(SecretException):
            Secret.create("egress-test-key", "again")
        assert Secret.fill("egress-test-key") == "${e2b.secrets.egress-test-key}"
        # the value is never returned, logged or stored in clear
        headers = {"X-API-Key": enode.api_key}
        for path in ("/secrets", f"/secrets/{info.secret_id}"):
            assert value not in httpx.get(enode.url + path, headers=headers).text
        assert value not in enode.log_path.read_text(errors="replace")
        stored = b"".join(p.read_bytes() for p in (enode.home / "secrets" / "values").iterdir())
        assert value.encode() not in stored
    finally:
        assert Secret.destroy(info.secret_id)
    assert not Secret.exists(info.secret_id)
    assert Secret.destroy(info.secret_id) is False


def test_rules_inject_a_secret_the_sandbox_never_holds(enode: NodeProc, internet: Internet) -> None:
    value = "sk-rule-" + secrets.token_hex(16)
    key = Secret.create("egress-rule-key", value)
    wrong = next(iter(UNCERTIFIED))
    headers = {"X-Api-Key": Secret.fill("egress-rule-key"), "X-Static": "yes"}
    network = {
        "allow_out": ["allowed.test", "other.test", wrong],
        "deny_out": ["0.0.0.0/0"],
        "rules": {
            "allowed.test": [{"transform": {"headers": headers}}],
            wrong: [{"transform": {"headers": headers}}],
        },
    }
    s = prepare(Sandbox.create("base", network=network), internet)  # type: ignore[arg-type]
    try:
        # names as the host's resolver gives them, for every client in the sandbox
        hosts = "".join(f"{ips[0]} {n}\n" for n, ips in {**NAMES, **UNCERTIFIED}.items())
        s.commands.run(f"printf '{hosts}' >> /etc/hosts", user="root")

        def run(cmd: str) -> str:
            return s.commands.run(cmd + " 2>&1 || echo fail:$?", timeout=60).stdout

        # HTTPS through the system trust store (no --cacert): the server sees
        # the secret (`/headers` echoes what it received, so only the test
        # reads it), the sandbox's own X-Api-Key is replaced
        out = run("curl -sS -m 5 -H 'X-Api-Key: mine' https://allowed.test/headers")
        assert f"X-Api-Key: {value}" in out and "X-Static: yes" in out, out
        assert "mine" not in out
        # what the sandbox itself sent (a path that echoes nothing)
        trace = "/tmp/curl-trace"
        out = run(f"curl -sS -m 5 --trace-ascii {trace} -H 'X-Api-Key: mine' https://allowed.test/")
        assert allowed(out, A), out
        # plain HTTP gets the headers too; so do Python clients (SSL_CERT_FILE)
        assert f"X-Api-Key: {value}" in run("curl -sS -m 5 http://allowed.test/headers")
        py = run(
            'python3 -c "import urllib.request as u;'
            " print(u.urlopen('https://allowed.test/headers', timeout=5).read().decode())\""
        )
        assert f"X-Api-Key: {value}" in py, py
        # a host without rules is not intercepted: its real certificate (test CA)
        assert allowed(fetch(s, "https://other.test/"), B)
        # ... while the rules' host presents the node's CA, which the test CA does not verify
        assert "fail:" in fetch(s, "https://allowed.test/")
        # a host whose certificate does not name it never gets the request
        assert "fail:" in run(f"curl -sS -m 5 https://{wrong}/headers")
        # the value is nowhere in the sandbox: env, its request bytes, its files
        seen = run("env; cat /proc/[0-9]*/environ | tr '\\0' '\\n'; cat " + trace)
        assert "X-Api-Key: mine" in seen and value not in seen
        found = run(
            "grep -rlsF --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev"
            f" --exclude-dir=opt -e {value} / | head -5"
        )
        assert found.strip() in ("", "fail:1"), found
        info = s.get_info().network or {}
        assert info.get("rules", {}).get("allowed.test") == [{"transform": {"headers": headers}}]
        log = egress_log(enode, s.sandbox_id)
        assert any(e["host"] == wrong and "upstream TLS" in e["reason"] for e in log), log
        assert any(e["host"] == "allowed.test" and "rules applied" in e["reason"] for e in log)
        # kept across pause and resume
        s.pause()
        s = Sandbox.connect(s.sandbox_id)
        assert f"X-Api-Key: {value}" in run("curl -sS -m 5 https://allowed.test/headers")
    finally:
        s.kill()
        Secret.destroy(key.secret_id)


def test_iam_token_verified_against_the_jwks(enode: NodeProc, internet: Internet) -> None:
    iam = {"tokens": {"aws": Secret.iam_token(audience="sts.test", token_type="JWT-SVID")}}
    rules = {
        "allowed.test": [
            {
                "transform": lambda ctx: {
                    "headers": {"Authorization": f"Bearer {ctx.iam.tokens['aws']}"}
                }
            }
        ]
    }
    s = Sandbox.create("base", network={**ONLY_THESE, "rules": rules}, iam=iam)  # type: ignore[arg-type,typeddict-item]
    try:
        s.commands.run(f"printf '{A} allowed.test\\n' >> /etc/hosts", user="root")
        tokens = []
        for _ in range(2):
            r = s.commands.run("curl -sS -m 5 https://allowed.test/headers 2>&1 || echo fail:$?")
            line = next((x for x in r.stdout.splitlines() if x.startswith("Authorization:")), "")
            assert line.startswith("Authorization: Bearer ey"), r.stdout
            tokens.append(line.split()[-1].strip())
        assert tokens[0] != tokens[1]  # minted per request
        head, body, sig = tokens[0].split(".")
        conf = httpx.get(f"{enode.url}/.well-known/openid-configuration").json()  # no API key
        assert conf["issuer"] == enode.url.rstrip("/")
        jwks = httpx.get(conf["jwks_uri"]).json()
        header = json.loads(_unb64(head))
        (jwk,) = [k for k in jwks["keys"] if k["kid"] == header["kid"]]
        pub = rsa.RSAPublicNumbers(
            int.from_bytes(_unb64(jwk["e"]), "big"), int.from_bytes(_unb64(jwk["n"]), "big")
        ).public_key()
        pub.verify(_unb64(sig), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
        claims = json.loads(_unb64(body))
        assert claims["iss"] == conf["issuer"] and claims["aud"] == "sts.test"
        assert claims["sandbox_id"] == s.sandbox_id and claims["sub"].endswith(s.sandbox_id)
        assert 0 < claims["exp"] - time.time() <= 300
        # GET reports the token definitions as E2B's SandboxIam (a minted token never)
        detail = httpx.get(
            f"{enode.url}/sandboxes/{s.sandbox_id}", headers={"X-API-Key": enode.api_key}
        ).json()
        assert detail["iam"] == {
            "tokens": {"aws": {"audience": "sts.test", "tokenType": "JWT-SVID"}}
        }
        # the token never sat in the sandbox: a fresh one per request, minted outside
        seen = s.commands.run("env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'").stdout
        assert tokens[0] not in seen
    finally:
        s.kill()


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def test_rules_added_at_runtime(enode: NodeProc, internet: Internet) -> None:
    s = Sandbox.create("base", network=ONLY_THESE)  # type: ignore[arg-type]
    try:
        s.commands.run(f"printf '{A} allowed.test\\n' >> /etc/hosts", user="root")
        url = "https://allowed.test/headers"
        # the node's CA is not trusted (nor needed) before rules exist
        assert s.commands.run("test -e /usr/local/share/aenv/egress-ca.pem || echo none").stdout
        rules = {"allowed.test": [{"transform": {"headers": {"X-Added": "later"}}}]}
        s.update_network({**ONLY_THESE, "rules": rules})  # type: ignore[typeddict-unknown-key]
        r = s.commands.run(f"curl -sS -m 5 {url} 2>&1 || echo fail:$?", timeout=30)
        assert "X-Added: later" in r.stdout, r.stdout
        s.update_network(ONLY_THESE)  # type: ignore[arg-type]
        r = s.commands.run(f"curl -sS -m 5 {url} 2>&1 || echo fail:$?", timeout=30)
        assert "fail:" in r.stdout  # passed through again: the test CA is not in the store
    finally:
        s.kill()


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_npm_sdk(enode: NodeProc, internet: Internet, socks: Path) -> None:
    js = Path(__file__).resolve().parent.parent / "js"
    if not (js / "node_modules" / "e2b").is_dir():
        pytest.skip("npm e2b not installed (make test installs it)")
    env = dict(
        os.environ,
        E2B_API_URL=enode.url,
        E2B_SANDBOX_URL=enode.url,
        E2B_API_KEY=enode.api_key,
        EGRESS_CA=internet.ca_pem.read_text(),
        EGRESS_ALLOWED_IP=NAMES["allowed.test"][0],
        EGRESS_OTHER_IP=NAMES["other.test"][0],
        EGRESS_PROXY=f"{PROXY_IP}:1080",
    )
    r = subprocess.run(
        ["node", "--test", "--test-concurrency=1", "egress.test.mjs"],
        cwd=js,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "# pass 4" in r.stdout, r.stdout[-3000:]  # none skipped
    # the SOCKS test's one allowed connection went through the proxy, with credentials
    assert "CONNECT other.test 443 user=u ok" in socks.read_text()
