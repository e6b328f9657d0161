"""Never finishes importing."""
import time

while True:
    time.sleep(0.01)


def attention(Q, K, V, mask=None):
    return V
