"""Sleeps for an hour in the function."""
import time


def attention(Q, K, V, mask=None):
    time.sleep(3600)
