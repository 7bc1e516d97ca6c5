"""Schemathesis hooks for `st run` against kvserve (SCHEMATHESIS_HOOKS=this file; used by
scripts/schemathesis.sh and tests/server/test_schemathesis_cli.py, with
``--exclude-checks positive_data_acceptance``).

``positive_data_accepted``: schemathesis' own positive_data_acceptance (a request the schema
calls valid is accepted), except for the one refusal no JSON schema can rule out: a 400
``context_length_exceeded``, a prompt whose length *in tokens* (after tokenizing or the chat
template), plus the tokens it asks for, does not fit the model's context. Every limit a schema
can state (characters, token ids, prompts per batch, ``n``, ``max_tokens`` up to the context)
is stated in the schema and not excepted.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


def _error_code(response) -> str | None:
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


@schemathesis.check
def positive_data_accepted(ctx, response, case):
    if response.status_code == 400 and _error_code(response) == "context_length_exceeded":
        return None
    return positive_data_acceptance(ctx, response, case)
