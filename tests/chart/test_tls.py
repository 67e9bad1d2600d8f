"""TLS as the chart configures it, between a real agent and the operator's agent client.

One certificate serves every agent of the DaemonSet, and the operator reaches agents by
pod IP, so the operator checks the agents' Service name (tls.serverName) in the
certificate instead of the address. The agent runs with the rendered flags, the operator
client with settings resolved from the rendered environment; only the file paths are
moved from the pod's mounts to a temporary folder.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chart.chartlib import NAMESPACE, ROOT, args_of, container, find, render

TLS_VALUES = {"tls": {"enabled": True, "secretName": "ingero-agent-tls"}}


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, dns_name: str) -> None:
    """A CA and an agent certificate for `dns_name` (no IP address in it), as cert-manager would issue."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ingero-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={dns_name}", "-keyout", "tls.key",
            "-out", "agent.csr", cwd=d)
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:{dns_name}\n")
    openssl("x509", "-req", "-in", "agent.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "ext.cnf", "-out", "tls.crt", cwd=d)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(tmp_path, values):
    """The agent with the rendered flags: certificates made by openssl for the Secret the
    values name, or, with no tls.secretName, the ones in the Secret the chart generates."""
    pytest.importorskip("aiohttp", reason="the operator's dependencies are not installed")
    docs = render(values)
    agent, op = container(docs, "DaemonSet", "agent"), container(docs, "Deployment", "operator")
    env = {e["name"]: e["value"] for e in op["env"] if "value" in e}
    if (values or {}).get("tls", {}).get("secretName"):
        if not shutil.which("openssl"):
            pytest.skip("openssl is not installed (makes the test certificates)")
        make_certs(tmp_path, env["INGERO_AGENT_TLS_SERVER_NAME"])
    else:
        for key, data in find(docs, "Secret", "ingero-agent-tls")["data"].items():
            (tmp_path / key).write_bytes(base64.b64decode(data))
    (tmp_path / "token").write_text("t" * 32)
    port = free_port()
    moved = {"/etc/ingero/tls/": f"{tmp_path}/", "/etc/ingero/token/": f"{tmp_path}/"}
    argv = []
    for a in agent["args"]:
        flag = a.split("=", 1)[0]
        if flag in ("--cgroup-root", "--node", "--listen", "--data-dir"):
            continue              # host facts of a node; replaced below
        for old, new in moved.items():
            a = a.replace(old, new)
        argv.append(a)
    argv += ["--node", "node-1", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data"), "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "ingero", *argv], cwd=ROOT, stderr=subprocess.PIPE)
    # the agent's start (its imports) took over 20 s at load ~30 in a CI run, and the tests
    # then met a closed port: wait as long as a busy machine needs, and say it if it never listens
    deadline = time.monotonic() + 180
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the agent did not listen within 180 s"
        time.sleep(0.05)
    for k, v in env.items():
        env[k] = v.replace("/etc/ingero/tls/", f"{tmp_path}/")
    return proc, port, env, args_of(agent)


@pytest.fixture
def tls_agent(tmp_path):
    proc, port, env, args = start_agent(tmp_path, TLS_VALUES)
    try:
        yield port, env, args
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def mtls_agent(tmp_path):
    proc, port, env, args = start_agent(tmp_path, {"tls": dict(TLS_VALUES["tls"], mutual=True)})
    try:
        yield port, env, args, tmp_path
    finally:
        proc.terminate()
        proc.wait(10)


def ask_time(port: int, agent_settings) -> dict:
    import aiohttp

    from ingero_operator.agents import AgentClient

    async def go():
        async with aiohttp.ClientSession() as http:
            client = AgentClient("node-1", "127.0.0.1", port, "t" * 32, agent_settings, http)
            return await client.time_sample()
    return asyncio.run(go())


def test_operator_verifies_the_agent_by_the_service_name_the_chart_configures(tls_agent):
    from ingero_operator.settings import Settings

    port, env, agent_args = tls_agent
    assert agent_args["--tls-cert"] and agent_args["--tls-key"]
    s = Settings.from_env(env)
    assert s.agent.tls and s.agent.tls_server_name == f"ingero-agent.{NAMESPACE}.svc"
    sample = ask_time(port, s.agent)
    assert sample.rtt_ns > 0 and abs(sample.offset_ns) < 1_000_000_000


def test_without_the_server_name_the_agents_certificate_does_not_match_its_address(tls_agent):
    from ingero_operator.agents import AgentUnreachable
    from ingero_operator.settings import Settings

    port, env, _ = tls_agent
    env = {k: v for k, v in env.items() if k != "INGERO_AGENT_TLS_SERVER_NAME"}
    s = Settings.from_env(env)
    with pytest.raises(AgentUnreachable, match="(?i)certificate|hostname|IP address mismatch"):
        ask_time(port, s.agent)


def test_an_agent_certificate_from_another_ca_is_refused(tls_agent, tmp_path_factory):
    from ingero_operator.agents import AgentUnreachable
    from ingero_operator.settings import Settings

    port, env, _ = tls_agent
    other = tmp_path_factory.mktemp("other-ca")
    make_certs(other, env["INGERO_AGENT_TLS_SERVER_NAME"])
    s = Settings.from_env(dict(env, INGERO_AGENT_CA_FILE=str(other / "ca.crt")))
    with pytest.raises(AgentUnreachable, match="(?i)certificate"):
        ask_time(port, s.agent)


def test_with_mutual_tls_the_agent_accepts_the_operator_certificate_and_refuses_a_client_without_one(mtls_agent):
    from ingero_operator.agents import AgentUnreachable
    from ingero_operator.settings import Settings

    port, env, agent_args, certs = mtls_agent
    assert agent_args["--tls-client-ca"] == ["/etc/ingero/tls/ca.crt"]
    s = Settings.from_env(env)
    assert s.agent.client_cert_file.endswith("/tls.crt") and s.agent.client_key_file.endswith("/tls.key")
    assert ask_time(port, s.agent).rtt_ns > 0
    bare = {k: v for k, v in env.items() if k not in ("INGERO_AGENT_CLIENT_CERT", "INGERO_AGENT_CLIENT_KEY")}
    # TLS 1.3: the client finishes its side of the handshake before the agent checks its (missing)
    # certificate, so the refusal may surface as the agent closing the connection (broken pipe)
    with pytest.raises(AgentUnreachable, match="(?i)certificate|alert|reset|closed|disconnect|broken pipe"):
        ask_time(port, Settings.from_env(bare).agent)


# ---- the certificate the chart generates (the default install) ---------------------------------

@pytest.fixture
def generated_agent(tmp_path, request):
    proc, port, env, args = start_agent(tmp_path, request.param)
    try:
        yield port, env, args
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("generated_agent", [None], indirect=True, ids=["default-values"])
def test_by_default_the_operator_verifies_the_agent_with_the_generated_ca_and_checks_the_service_name(
        generated_agent):
    from ingero_operator.agents import AgentUnreachable
    from ingero_operator.settings import Settings

    port, env, agent_args = generated_agent
    assert agent_args["--tls-cert"] and "--tls-client-ca" not in agent_args
    s = Settings.from_env(env)
    assert s.agent.tls and s.agent.tls_server_name == f"ingero-agent.{NAMESPACE}.svc"
    assert ask_time(port, s.agent).rtt_ns > 0
    # The name is checked: the same CA with another expected name is refused.
    wrong = Settings.from_env(dict(env, INGERO_AGENT_TLS_SERVER_NAME=f"other.{NAMESPACE}.svc"))
    with pytest.raises(AgentUnreachable, match="(?i)certificate|hostname"):
        ask_time(port, wrong.agent)


@pytest.mark.parametrize("generated_agent", [{"tls": {"mutual": True}}], indirect=True, ids=["mutual"])
def test_mutual_tls_works_with_the_generated_certificate(generated_agent):
    from ingero_operator.agents import AgentUnreachable
    from ingero_operator.settings import Settings

    port, env, agent_args = generated_agent
    assert agent_args["--tls-client-ca"] == ["/etc/ingero/tls/ca.crt"]
    s = Settings.from_env(env)
    assert ask_time(port, s.agent).rtt_ns > 0
    bare = {k: v for k, v in env.items() if k not in ("INGERO_AGENT_CLIENT_CERT", "INGERO_AGENT_CLIENT_KEY")}
    with pytest.raises(AgentUnreachable, match="(?i)certificate|alert|reset|closed|disconnect|broken pipe"):
        ask_time(port, Settings.from_env(bare).agent)
