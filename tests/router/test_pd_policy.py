"""The prefill/decode policy's legs (kvserve.router.policy.plan)."""

from kvserve.router.policy import plan


def test_plan_legs():
    body = {"prompt": "hi", "max_tokens": 8}
    assert plan("auto", False, body) == (None, "auto")  # no prefill replicas: one leg
    assert plan("session", False, body) == (None, "session")
    assert plan("auto", True, body) == ("prefix", "least-loaded")
    assert plan("session", True, body) == ("prefix", "least-loaded")  # no session on prefill
    assert plan("round-robin", True, body) == ("round-robin", "least-loaded")
    for whole in ({**body, "n": 2}, {**body, "echo": True}, {**body, "max_tokens": 1},
                  {**body, "kv_transfer": {"role": "decode"}}, None):
        assert plan("auto", True, whole) == (None, "least-loaded")  # whole to a decode replica
