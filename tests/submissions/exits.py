"""Calls sys.exit in the function."""
import sys


def attention(Q, K, V, mask=None):
    sys.exit(3)
