"""Never returns from the function."""


def attention(Q, K, V, mask=None):
    while True:
        pass
