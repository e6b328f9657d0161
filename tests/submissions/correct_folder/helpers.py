import math


def scaled_scores(Q, K):
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
