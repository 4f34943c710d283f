"""`cpuserve bench structured`'s pure logic: the decode schema really cannot end before max_tokens
(its shortest JSON is longer than the token budget, checked against a hand-made shortest instance),
the compile schema has the 30 mixed properties it claims, and the percentile is nearest-rank."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cpuserve.bench.structured_bench import (
    ITEM_SCHEMA,
    decode_schema,
    min_items_for,
    min_json_bytes,
    percentile,
    wide_schema,
)

SHORTEST_ITEM = {"id": 0, "name": "", "ok": True, "level": "low", "score": 0}


def _compact(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def test_min_json_bytes_is_the_shortest_instance():
    jsonschema.validate(SHORTEST_ITEM, ITEM_SCHEMA)
    assert min_json_bytes(ITEM_SCHEMA) == _compact(SHORTEST_ITEM)
    array = {"type": "array", "items": ITEM_SCHEMA, "minItems": 3}
    assert min_json_bytes(array) == _compact([SHORTEST_ITEM] * 3)


@pytest.mark.parametrize(
    ("schema", "shortest"),
    [
        ({"type": "string", "minLength": 5}, "aaaaa"),
        ({"type": ["null", "string"]}, ""),
        ({"enum": ["long one", "ab", 7]}, 7),
        ({"const": {"a": 1}}, {"a": 1}),
        ({"type": "boolean"}, True),
        ({"type": "object", "properties": {"x": {"type": "integer"}}}, {}),
        ({"type": "array", "items": {"type": "integer"}}, []),
    ],
)
def test_min_json_bytes_by_kind(schema, shortest):
    jsonschema.validate(shortest, schema)
    assert min_json_bytes(schema) == _compact(shortest)


@pytest.mark.parametrize("budget", [1, 2, 59, 60, 61, 1000, 32 * 81])
def test_min_items_is_the_fewest_that_exceed_the_budget(budget):
    n = min_items_for(ITEM_SCHEMA, budget)
    over = {"type": "array", "items": ITEM_SCHEMA, "minItems": n}
    assert min_json_bytes(over) > budget
    if n > 1:
        assert min_json_bytes({**over, "minItems": n - 1}) <= budget


def test_decode_schema_outlasts_the_token_budget():
    schema = decode_schema(new_tokens=64, max_token_bytes=81)
    assert min_json_bytes(schema) > 64 * 81
    jsonschema.Draft202012Validator.check_schema(schema)


def test_wide_schema_has_thirty_mixed_properties_and_a_fresh_name_per_tag():
    schema = wide_schema("t1")
    props = schema["properties"]
    assert len(props) == 30 and all(k.endswith("_t1") for k in props)
    kinds = [v.get("type", "enum" if "enum" in v else None) for v in props.values()]
    assert {"string", "integer", "number", "boolean", "array", "object", "enum"} <= set(kinds)
    assert set(schema["required"]) <= set(props)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert json.dumps(wide_schema("t2")) != json.dumps(schema)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 90) == 9.0
    assert percentile(values, 50) == 5.0
    assert percentile(values, 100) == 10.0
    assert percentile([3.0], 90) == 3.0
    assert percentile([], 90) == 0.0
