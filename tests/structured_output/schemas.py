"""JSON schemas for the structured-output tests: nested objects, arrays, enums, required
properties, numbers and integers with bounds, const, anyOf, $ref, nullable types, string
lengths and formats. Each is bounded (maxLength, maxItems, ranges) so that a tiny random
model finishes within the tests' token limits."""

NAME = {"type": "string", "maxLength": 8}

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}, "required": ["x"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
     "required": ["n"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"kind": {"const": "user"}, "id": {"type": "integer", "minimum": 1, "maximum": 999}},
     "required": ["kind", "id"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                                      {"type": "string", "maxLength": 4}]}}, "required": ["v"]},
    {"$defs": {"item": {"type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["sku", "qty"]}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
     "required": ["items"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME,
        "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                  "required": ["city", "zip"]}}, "required": ["name", "address"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["a"]},
    {"type": "object", "properties": {"status": {"type": "string", "enum": ["ok", "error"]},
                                      "code": {"type": "integer", "enum": [200, 404, 500]}}, "required": ["status", "code"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 5},
                                                "minItems": 1, "maxItems": 3}}, "required": ["words"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "count": {"type": "integer", "multipleOf": 5,
                                                                             "minimum": 0, "maximum": 50}},
     "required": ["flag", "count"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                                {"enum": ["x", "y"]}], "items": False}},
     "required": ["pair"]},
    {"enum": ["alpha", "beta", 3, None]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"k": NAME}, "required": ["k"],
                                               "additionalProperties": False}, "n": {"type": "null"}},
     "required": ["meta", "n"]},
]
