"""Dereferences a null pointer: the process dies with SIGSEGV."""
import ctypes


def attention(Q, K, V, mask=None):
    return ctypes.string_at(0)
