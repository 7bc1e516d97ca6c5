"""JSON schemas made strict: ``strict: true`` (a ``json_schema`` response format, a function
tool, a Responses ``text.format``) closes every object of the schema whatever its
``additionalProperties`` says, as OpenAI's and xgrammar's strict modes do. Without it JSON
Schema's own default stands (an object without ``additionalProperties`` may carry extra
keys)."""

from __future__ import annotations

# keywords whose value is one subschema / a list of them / a name -> subschema mapping
_SUB_ONE = ("items", "not", "if", "then", "else", "contains", "propertyNames",
            "additionalItems", "unevaluatedItems")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _is_object_schema(node: dict) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and ("properties" in node or "additionalProperties" in node
                          or "required" in node))


def strict_schema(schema: object) -> object:
    """A copy of ``schema`` where every object schema (``type`` object, or untyped with
    ``properties`` / ``additionalProperties`` / ``required``) has ``additionalProperties:
    false``, and no ``unevaluatedProperties``: only declared properties (and
    ``patternProperties``) are allowed. Recurses through every subschema keyword and
    ``$defs``, so pydantic's nested models (``$ref`` to ``$defs``) are closed too. A
    ``dict[str, X]`` field (an object with no properties) becomes the empty object, as in
    OpenAI's strict mode."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true / false schemas, enum values
    out = {}
    for key, value in schema.items():
        if key in _SUB_ONE or key in _SUB_LIST:
            out[key] = strict_schema(value)
        elif key in _SUB_MAP and isinstance(value, dict):
            out[key] = {k: strict_schema(v) for k, v in value.items()}
        else:
            out[key] = value
    if _is_object_schema(schema):
        out["additionalProperties"] = False
        out.pop("unevaluatedProperties", None)
    return out
