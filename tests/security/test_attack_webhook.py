"""The profiler-plugin admission webhook under attack: the real operator process with its
bounded WebhookServer (tests/unit/webhook_operator.py), a crowd of half-open connections and
reviews no API server sends. Every refusal is a 4xx AdmissionReview naming the problem in
``response.status``; the API server applies the failure policy (Ignore) to it."""

from __future__ import annotations

import copy
import json

from tests.security.attacks import half_open, throughout, vm
from tests.unit.webhook_operator import admit, needs_openssl, pod, post, post_raw, review, webhook  # noqa: F401

pytestmark = needs_openssl


def refused(code: int, text: str) -> tuple[int, str]:
    """(status, message) of a refusal, checked to be an AdmissionReview."""
    doc = json.loads(text)
    assert doc["apiVersion"] == "admission.k8s.io/v1" and doc["kind"] == "AdmissionReview", doc
    status = doc["response"]["status"]
    assert status["code"] == code and doc["response"]["allowed"] is False, doc
    assert "\n" not in status["message"], status
    return code, status["message"]


def test_malformed_reviews_are_4xx_admission_reviews_naming_the_problem_never_500(webhook):
    good = review(pod("x", {"ingero.io/profiler": "enabled"}))
    no_user = copy.deepcopy(good)
    del no_user["request"]["userInfo"]
    deep = copy.deepcopy(good)       # parses, and kopf's recursive copies would overflow on it
    deep["request"]["object"]["metadata"]["annotations"] = {"a": json.loads("[" * 900 + "]" * 900)}
    cases = {
        "array": (b"[]", 400, "must be a JSON object"),
        "no-request": (json.dumps({"kind": "AdmissionReview"}).encode(), 400, "no request"),
        "null-request": (json.dumps({"kind": "AdmissionReview", "request": None}).encode(), 400, "no request"),
        "null": (b"null", 400, "must be a JSON object"),
        "no-uid": (json.dumps({"kind": "AdmissionReview", "request": {}}).encode(), 400, "uid"),
        "no-user": (json.dumps(no_user).encode(), 400, "userInfo"),
        "object-text": (json.dumps({**good, "request": {**good["request"], "object": "pod"}}).encode(), 400, "object"),
        "not-pods": (json.dumps({**good, "request": {**good["request"], "resource": {
            "group": "apps", "version": "v1", "resource": "deployments"}}}).encode(), 400, "pods only"),
        "nested": (b'{"request": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests too deeply"),
        "nested-object": (json.dumps(deep).encode(), 400, "more than 64 levels"),
        "not-json": (b"{", 400, "not JSON"),
        "oversize": (b'{"request": "' + b"x" * (3 << 20) + b'"}', 413, "body larger than"),
    }
    for name, (body, code, words) in cases.items():
        got, message = refused(code, post_raw(webhook, body)[1])
        assert words in message, (name, message)
    assert refused(413, post_raw(webhook, cases["oversize"][0], chunked=True)[1])
    assert "pods only" not in refused(404, post_raw(webhook, json.dumps(good).encode(), path="/other")[1])[1]
    log = webhook["log"]()
    assert "Traceback" not in log and "Error handling request" not in log, log
    resp = admit(webhook, "/profiler-pod", pod("after", {"ingero.io/profiler": "enabled"}))
    assert resp.get("patch"), resp      # and the server still serves


def test_an_update_review_gets_no_patch(webhook):
    p = pod("upd", {"ingero.io/profiler": "enabled"})
    req = review(p, operation="UPDATE")
    req["request"]["oldObject"] = p
    code, doc = post(webhook["port"], "/profiler-pod", req, webhook["ca"])
    assert code == 200 and doc["response"]["allowed"] is True, (code, doc)
    assert "patch" not in doc["response"], doc


def test_500_half_open_connections_cost_under_50_mib_and_delay_no_admission_past_2_s(webhook):
    """TCP connections that never say hello (and so never send a request): each holds a slot
    of the webhook's bound at most until a new client needs it or the idle timeout."""
    admit(webhook, "/profiler-pod", pod("warm", {"ingero.io/profiler": "enabled"}))
    rss0 = vm(webhook["pid"], "VmRSS")
    socks = half_open(webhook["port"], 500, b"")
    try:
        statuses, ms = throughout(lambda: admit(webhook, "/profiler-pod", pod("crowded", {
            "ingero.io/profiler": "enabled"})) and 200)
        grew = vm(webhook["pid"], "VmRSS") - rss0
        print(f"webhook under 500 half-open: RSS +{grew:.1f} MiB")
        assert ms[-1] < 2000 and grew < 50, (ms, grew)
    finally:
        for s in socks:
            s.close()
