"""A real Prometheus (Debian's `prometheus`, which `make setup` installs) scraping a demo's
operator and agents with the chart's alert rules, for the whole-flow tests.

Scrapes and evaluates every second; the rules are the chart's PrometheusRule as Helm renders
it, with `metrics.prometheusRule.for` set short (a chart value), so an alert fires and
resolves within a lab job of seconds."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.chart.chartlib import render

FOR = "1s"


def reason() -> str | None:
    if not shutil.which("prometheus"):
        return "prometheus is not installed: `make setup` installs Debian's prometheus"
    return None


def chart_rules() -> dict:
    values = {"metrics": {"prometheusRule": {"enabled": True, "for": FOR}}}
    return next(d for d in render(values) if d["kind"] == "PrometheusRule")["spec"]


class Prometheus:
    """`prometheus` on a free loopback port, scraping the operator (job ingero-operator) and the
    agents (job ingero-agent, as the chart's PodMonitor names it)."""

    def __init__(self, folder: Path, operator_port: int, agent_ports: list[int]):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rules.yaml").write_text(yaml.safe_dump(chart_rules()))
        (folder / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {"job_name": "ingero-operator", "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"]}]},
                {"job_name": "ingero-agent",
                 "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in agent_ports]}]}]}))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        self.log = open(folder / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={self.url[len('http://'):]}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict | list:
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.load(r)
        assert doc["status"] == "success", doc
        return doc["data"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
