"""The CRDs: the chart ships the repository's copies unchanged, every schema is structural
(as the API server requires of apiextensions.k8s.io/v1), and the examples validate."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from tests.chart.chartlib import CHART, ROOT

# Keywords a structural schema may not use at all (Kubernetes "Specifying a structural schema").
FORBIDDEN = {"$ref", "definitions", "dependencies", "patternProperties", "additionalItems", "$schema", "id"}
# Inside allOf/anyOf/oneOf/not only value validations are allowed.
NOT_IN_JUNCTORS = {"type", "description", "default", "additionalProperties", "nullable",
                   "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string"}


def structural_problems(node: dict, path: str, in_junctor: bool = False) -> list[str]:
    """Why `node` is not a structural schema node (empty when it is)."""
    out = []
    if not isinstance(node, dict):
        return [f"{path}: not an object"]
    out += [f"{path}: {k} is not allowed in a structural schema" for k in FORBIDDEN & node.keys()]
    if in_junctor:
        out += [f"{path}: {k} is not allowed inside allOf/anyOf/oneOf/not" for k in NOT_IN_JUNCTORS & node.keys()]
    elif "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields") \
            and not node.get("x-kubernetes-int-or-string"):
        out.append(f"{path}: no type (nor x-kubernetes-preserve-unknown-fields / int-or-string)")
    if "properties" in node and isinstance(node.get("additionalProperties"), dict):
        out.append(f"{path}: properties and additionalProperties together")
    if node.get("uniqueItems") is True:
        out.append(f"{path}: uniqueItems: true is forbidden")
    if "items" in node and not isinstance(node["items"], dict):
        out.append(f"{path}: items must be one schema")
    if "default" in node and not in_junctor:
        try:
            jsonschema.validate(node["default"], node)
        except jsonschema.ValidationError as e:
            out.append(f"{path}: default does not validate: {e.message}")
    for k, sub in (node.get("properties") or {}).items():
        out += structural_problems(sub, f"{path}.{k}", in_junctor)
    if isinstance(node.get("items"), dict):
        out += structural_problems(node["items"], f"{path}[]", in_junctor)
    if isinstance(node.get("additionalProperties"), dict):
        out += structural_problems(node["additionalProperties"], f"{path}.*", in_junctor)
    for j in ("allOf", "anyOf", "oneOf"):
        for i, sub in enumerate(node.get(j) or []):
            out += structural_problems(sub, f"{path}.{j}[{i}]", True)
    if isinstance(node.get("not"), dict):
        out += structural_problems(node["not"], f"{path}.not", True)
    return out


def crds() -> list[tuple[str, dict]]:
    return [(f"{p.name}:{d['metadata']['name']}", d) for p in sorted((ROOT / "crds").glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]


def test_chart_crds_are_byte_identical_copies_of_the_repository_crds():
    repo = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert sorted(chart) == sorted(repo) and sorted(repo) == ["kopfpeering.yaml", "tracesession.yaml"]
    different = [name for name in repo if repo[name] != chart[name]]
    assert different == [], f"charts/ingero/crds differs from crds/ for {different}: cp crds/*.yaml charts/ingero/crds/"


@pytest.mark.parametrize("where,crd", crds(), ids=[w for w, _ in crds()])
def test_every_crd_schema_is_structural(where, crd):
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    for v in crd["spec"]["versions"]:
        root = v["schema"]["openAPIV3Schema"]
        assert root.get("type") == "object"
        meta = (root.get("properties") or {}).get("metadata")
        # At the root, metadata may only be typed (the API server owns it).
        assert meta is None or set(meta) <= {"type"}, meta
        assert structural_problems(root, "") == []
        if "status" in v.get("subresources", {}):
            assert "status" in root["properties"]


def test_the_structural_check_catches_what_the_api_server_refuses():
    bad = {"type": "object", "properties": {
        "a": {"description": "no type"},
        "b": {"type": "array", "items": [{"type": "string"}]},
        "c": {"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": {"type": "string"}},
        "d": {"type": "string", "anyOf": [{"type": "string", "minLength": 1}]},
        "e": {"type": "integer", "default": "five"}}}
    problems = structural_problems(bad, "")
    assert [p.split(":")[0] for p in problems] == [".a", ".b", ".c", ".d.anyOf[0]", ".e"], problems


def test_examples_validate_against_the_tracesession_schema():
    crd = yaml.safe_load((ROOT / "crds" / "tracesession.yaml").read_text())
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    api = f"{crd['spec']['group']}/{version['name']}"
    examples = [(p.name, d) for p in sorted((ROOT / "examples").glob("*.yaml"))
                for d in yaml.safe_load_all(p.read_text()) if d and d.get("kind") == crd["spec"]["names"]["kind"]]
    assert examples, "no TraceSession in examples/"
    for name, doc in examples:
        assert doc["apiVersion"] == api, name
        jsonschema.Draft7Validator(schema).validate(doc)
    # The schema does reject a bad session (so the check above means something).
    bad = dict(examples[0][1], spec=dict(examples[0][1]["spec"], probes=["gpu"]))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)


def _spec_numbers(node: dict, path: str):
    """(dotted path, schema node) of every number in a schema, below `path`."""
    if node.get("type") in ("integer", "number"):
        yield path, node
    for k, sub in (node.get("properties") or {}).items():
        yield from _spec_numbers(sub, f"{path}.{k}")


def test_every_number_in_a_tracesession_spec_has_the_operators_maximum():
    from ingero_operator.plan import MAXIMUM
    crd = yaml.safe_load((ROOT / "crds" / "tracesession.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    got = {path: node.get("maximum") for path, node in _spec_numbers(spec, "spec")}
    assert got == MAXIMUM
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for huge in (10 ** 12, 2 ** 63 - 1):   # the API server refuses them before the operator sees them
        doc = {"apiVersion": "ingero.io/v1alpha1", "kind": "TraceSession", "metadata": {"name": "x"},
               "spec": {"selector": {"matchLabels": {"a": "b"}}, "durationSeconds": huge}}
        with pytest.raises(jsonschema.ValidationError, match="maximum"):
            jsonschema.Draft7Validator(schema).validate(doc)


def _tracesession(spec: dict) -> dict:
    return {"apiVersion": "ingero.io/v1alpha1", "kind": "TraceSession", "metadata": {"name": "x"},
            "spec": {"selector": {"matchLabels": {"job-name": "j"}}, **spec}}


@pytest.mark.parametrize("case,spec,words", [
    ("5000 labels", {"selector": {"matchLabels": {f"k{i}": "v" for i in range(5000)}}}, "too many properties"),
    ("label value", {"selector": {"matchLabels": {"a": "bad value!"}}}, "does not match"),
    ("long label value", {"selector": {"matchLabels": {"a": "v" * 64}}}, "is too long"),
    ("1000 probes", {"probes": ["nccl"] * 1000}, "is too long"),
    ("relative ncclLibPath", {"ncclLibPath": "lib/libnccl.so.2"}, "does not match"),
    ("ncclLibPath with a newline", {"ncclLibPath": "/lib/libnccl.so.2\nLD_PRELOAD=/x"}, "does not match"),
])
def test_the_tracesession_schema_refuses_oversized_or_malformed_fields(case, spec, words):
    from ingero_operator.plan import MAX_LABELS

    crd = yaml.safe_load((ROOT / "crds" / "tracesession.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft7Validator(schema).validate(_tracesession({"ncclLibPath": "/usr/lib/libnccl.so.2",
                                                                "probes": ["nccl", "tcp", "sched"]}))
    with pytest.raises(jsonschema.ValidationError, match=words):
        jsonschema.Draft7Validator(schema).validate(_tracesession(spec))
    labels = schema["properties"]["spec"]["properties"]["selector"]["properties"]["matchLabels"]
    assert labels["maxProperties"] == MAX_LABELS      # the operator refuses what the API server would
    probes = schema["properties"]["spec"]["properties"]["probes"]
    # the API server refuses duplicates in a set (uniqueItems is not allowed in a structural schema)
    assert probes["x-kubernetes-list-type"] == "set" and probes["maxItems"] == len(probes["items"]["enum"])
