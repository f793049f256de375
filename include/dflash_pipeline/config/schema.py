"""What every config module shares: the error a bad conf raises and the schema check the params' bounds
are enforced with outside Airflow. Its own module so that run.py, mix.py, quality.py, tokenize.py and
evaluate.py import it, not each other (they used to import run.py inside functions, a circle)."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """The run's configuration is wrong: retrying cannot fix it."""


def check_schema(name: str, value: Any, schema: dict[str, Any]) -> None:
    """A small JSON-schema subset check, so library callers (not only Airflow) get the same bounds."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    py_ok = {
        "null": lambda v: v is None,
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, (list, tuple)),
        "object": lambda v: isinstance(v, dict),
    }
    if types and not any(py_ok[t](value) for t in types):
        raise ConfigError(f"param {name}: {value!r} is not of type {' or '.join(types)}")
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"param {name}: {value!r} is not a finite number")
        if "minimum" in schema and value < schema["minimum"]:
            raise ConfigError(f"param {name}: {value} is less than the minimum of {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            raise ConfigError(f"param {name}: {value} is more than the maximum of {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise ConfigError(f"param {name}: {value} must be more than {schema['exclusiveMinimum']}")
    if "enum" in schema and value not in schema["enum"]:
        raise ConfigError(f"param {name}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        raise ConfigError(f"param {name}: must not be empty")
    if isinstance(value, str) and len(value) > schema.get("maxLength", 1 << 30):
        raise ConfigError(f"param {name}: at most {schema['maxLength']} characters")
    if isinstance(value, (list, tuple)):
        if len(value) < schema.get("minItems", 0):
            raise ConfigError(f"param {name}: needs at least {schema['minItems']} item(s)")
        if len(value) > schema.get("maxItems", 1 << 30):
            raise ConfigError(f"param {name}: at most {schema['maxItems']} items")
        if schema.get("uniqueItems") and len(set(value)) != len(value):
            raise ConfigError(f"param {name}: items must be unique")
        item_schema = schema.get("items")
        if item_schema:
            for item in value:
                check_schema(f"{name}[]", item, item_schema)
