"""A small BM25 index (pure Python) standing in for WebShop's pyserini/Lucene search.

WebShop searches its catalogue with Lucene BM25 (pyserini, a Java index) and shows the top 50 hits.
This index ranks the same way (Okapi BM25, ``k1=0.9, b=0.4``: pyserini's defaults; Lucene's idf
``log(1 + (N - df + 0.5) / (df + 0.5))``) over lowercased alphanumeric tokens, ties broken by
index order. A search over 3,000 products takes ~1 ms.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class BM25Index:
    """BM25 over ``docs``; ``search`` returns the ids of the best ``k`` documents."""

    def __init__(self, ids: list[str], docs: list[str], k1: float = 0.9, b: float = 0.4) -> None:
        self.ids = ids
        self.k1, self.b = k1, b
        self._postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        lengths = []
        for i, doc in enumerate(docs):
            tokens = tokenize(doc)
            lengths.append(len(tokens))
            for term, tf in Counter(tokens).items():
                self._postings[term].append((i, tf))
        self._lengths = lengths
        avg = sum(lengths) / max(1, len(lengths))
        self._norm = [k1 * (1 - b + b * n / avg) for n in lengths]
        n_docs = len(docs)
        self._idf = {
            t: math.log(1 + (n_docs - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self._postings.items()
        }

    def search(self, query: str, k: int = 50) -> list[str]:
        scores: dict[int, float] = defaultdict(float)
        for term in set(tokenize(query)):
            idf = self._idf.get(term)
            if idf is None:
                continue
            for doc, tf in self._postings[term]:
                scores[doc] += idf * tf * (self.k1 + 1) / (tf + self._norm[doc])
        best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [self.ids[doc] for doc, _ in best]
