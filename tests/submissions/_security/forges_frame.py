"""Writes its own reply frame on the grader's socket: a tensor record of shape [10**30] with stride
0 (4 bytes of data), which the grader once accepted and then failed on. Then it waits to be killed."""
import gc
import json
import time

from attn_spec.grading.isolation import wire


def attention(Q, K, V, mask=None):
    chan = next(o for o in gc.get_objects() if isinstance(o, wire.Channel))
    record = {"dtype": "float32", "shape": [10**30], "strides": [0], "nbytes": 4, "device": "cpu"}
    head = json.dumps({"ok": True, "result": [{"$t": 0}], "inputs": [None] * 4, "tensors": [record]}).encode()
    chan.sock.sendall(len(head).to_bytes(4, "big") + head + bytes(4))
    time.sleep(60)
