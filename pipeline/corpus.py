"""The embedded default's English corpus: CPython's own documentation topics.

`pydoc_data.topics` ships with every CPython, needs no network and is real English prose
(~460k characters). Documents are the topics in key order; every tenth one is held out
for the pipeline's training stage, the rest pretrain the tiny checkpoints.
"""

import hashlib

HELD_OUT_EVERY = 10


def documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def pretraining_documents() -> list[str]:
    return [d for i, d in enumerate(documents()) if i % HELD_OUT_EVERY != 0]


def held_out_documents() -> list[str]:
    return [d for i, d in enumerate(documents()) if i % HELD_OUT_EVERY == 0]


def fingerprint() -> str:
    """sha256 of the whole corpus, recorded in every embedded checkpoint."""
    digest = hashlib.sha256()
    for doc in documents():
        digest.update(doc.encode())
        digest.update(b"\0")
    return digest.hexdigest()
