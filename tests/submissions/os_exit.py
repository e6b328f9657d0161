"""Calls os._exit in the function (no cleanup, no exception)."""
import os


def attention(Q, K, V, mask=None):
    os._exit(0)
