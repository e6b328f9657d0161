"""While importing, sends the grader a forged "loaded" report whose fields have the wrong types."""
import gc
import time

from attn_spec.grading.isolation import wire

chan = next(o for o in gc.get_objects() if isinstance(o, wire.Channel))
chan.send({"stage": "loaded", "ok": True, "found": 5, "kinds": [1, 2], "outcome": ["graded"]})
time.sleep(60)


def attention(Q, K, V, mask=None):
    return V
